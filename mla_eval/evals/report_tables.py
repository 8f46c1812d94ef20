"""How the built-in evaluations' documents read as tables (the report page, `mla-eval report`) and which row of a
document the gate compares with which (`identity`): functions of a document alone, declared with each evaluation
in `mla_eval.evals.builtin`."""

from __future__ import annotations

from mla_eval.attention.semantics import row_label
from mla_eval.protocol import Table

KLD_COLUMNS = (
    ("KLD mean", "kld_mean", "{:.5f}"),
    ("± se", "kld_se", "{:.1e}"),  # a standard error is read for its magnitude: 2e-05, not 0.00000
    ("median", "kld_median", "{:.5f}"),
    ("p99", "kld_p99", "{:.4f}"),
    ("max", "kld_max", "{:.3f}"),
    ("same top-1 %", "same_top1_pct", "{:.2f}"),
    ("RMS Δp %", "delta_p_rms_pct", "{:.3f}"),
    ("PPL ratio", "ppl_ratio", "{:.4f}"),
    ("KL(format ‖ ref)", "kld_reverse_mean", "{:.5f}"),  # the other direction ("–" in documents before it)
)


def _rank(kld) -> float:
    """A row's place: its KLD mean (a document's "inf" string or null last)."""
    return kld if isinstance(kld, (int, float)) else float("inf")


def fmt(v, spec: str) -> str:
    return "–" if v is None else spec.format(v)


def _attention(settings: dict) -> str:
    """' — semantics cache, engine:512; math bf16' for documents that name them, else ''."""
    sems = settings.get("semantics")
    if isinstance(sems, dict):  # needle: one semantics
        sems = [sems]
    if not sems:
        return ""
    maths = settings.get("math", "bf16")
    maths = [maths] if isinstance(maths, str) else maths
    return f" — semantics {', '.join(x['semantics'] for x in sems)}; math {', '.join(maths)}"


def _explain_section(ex: dict) -> tuple[str, list[str], list[list[str]]]:
    """Storage-only / compute-only / both rows of the --explain format, per semantics and fp8 math."""
    rows = [
        [sem, m, f"{r['storage_only']:.5f}", f"{r['compute_only'][m]:.5f}", f"{both:.5f}", f"{r['interaction'][m]:+.5f}"]
        for sem, r in ex["semantics"].items()
        for m, both in r["both"].items()
    ]
    head = ["semantics", "math", "storage only (KLD)", "compute only (KLD)", "both (KLD)", "both - sum"]
    return (f"Where {ex['format']}'s error comes from: storage (its cache, bf16 math) vs compute (bf16 cache, fp8 math)",
            head, rows)


def kld_tables(d: dict) -> list[Table]:
    """A kld document: its formats' figures (ranked by KLD mean, lowest first), its notes, and the --explain
    breakdown."""
    ranked = sorted(d["formats"].items(), key=lambda kv: _rank(kv[1].get("kld_mean")))
    rows = [[name] + [fmt(s.get(k), f) for _, k, f in KLD_COLUMNS] for name, s in ranked]
    title = (f"Teacher-forced KLD vs {d['settings']['ref']} — {d['text']['label']}{_attention(d['settings'])}; "
             "ranked by KLD")
    out = [(title, ["format"] + [c for c, _, _ in KLD_COLUMNS], rows)]
    for note in d.get("notes", []):
        out.append((f"Note: {note}", [], []))
    if d.get("explain"):
        out.append(_explain_section(d["explain"]))
    return out


def needle_tables(d: dict) -> list[Table]:
    """A needle document: accuracy and effective length per format, and the format-induced failures."""
    s = d["settings"]
    rows = [[name, f"{v['mean_accuracy']:.3f}", str(v["effective_length"] or "–")] for name, v in d["formats"].items()]
    title = f"Needle retrieval ({s['task']}, {s['values']}; lengths {s['lengths']}){_attention(s)}"
    out = [(title, ["format", "mean accuracy", "effective length"], rows)]
    fails = d.get("format_induced_failures", [])
    if fails:
        head = ["format", "length", "depth %", "expected", "output"]
        cells = [
            [f["format"], str(f["length"]), f"{f['depth']:g}", ", ".join(f["expected"]), f["output"][:40]] for f in fails[:50]
        ]
        out.append(("Format-induced failures (bf16 right, format wrong)", head, cells))
    return out


def capacity_tables(d: dict) -> list[Table]:
    """A capacity document: one row per format of its setup."""
    su = d["setup"]
    # concurrency is null without a max_model_len, the ratio null when fp8_ds_mla fits no block
    rows = [
        [
            r["name"],
            str(r["bytes_per_token_per_layer"]),
            f"{r['bytes_per_token']:,}",
            f"{r['pool_tokens']:,}",
            fmt(r["max_concurrency"], "{:.2f}"),
            fmt(r["ratio_vs_fp8_ds_mla"], "{:.2f}"),
        ]
        for r in d["formats"]
    ]
    dcp = f", DCP {su['dcp']}" if su.get("dcp", 1) > 1 else ""
    setup = f"{d['model']['name']} on {su['gpus']} x {su['gpu'] or 'GPU'}, TP {su['tp']}{dcp}"
    head = ["format", "B/token/layer", "B/token (model)", "pool tokens", "concurrency", "x fp8_ds_mla"]
    return [(f"KV-cache capacity — {setup}", head, rows)]


def identity(row_key: str, row: dict, doc: dict) -> str:
    """A result row's identity: its format with the attention semantics and math it ran under
    (mla_eval.attention.semantics.row_label), so that figures of different semantics or math are
    never compared with each other. A kld row names them itself; a needle document (and any
    document written before they existed: cache, bf16) in its settings."""
    sem, math = row.get("semantics"), row.get("math")
    if sem is None or math is None:
        settings = doc.get("settings", {})
        given = settings.get("semantics")
        sem = given.get("semantics", "cache") if isinstance(given, dict) else "cache"
        math = settings.get("math") if isinstance(settings.get("math"), str) else "bf16"
    return row_label(row.get("format", row_key), sem, math)
