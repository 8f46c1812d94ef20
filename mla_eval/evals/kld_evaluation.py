"""The KLD evaluation as a library call: `evaluate_kld(KldSettings(...)) -> KldResult`.

Settings are validated when built and every default is resolved once (`resolve_protocol`);
the result serialises to the versioned `mla-eval/kld/v1` document (`to_document`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mla_eval.attention import dispatch
from mla_eval.attention.semantics import (
    MATH_HELP,
    SEMANTICS_HELP,
    AttentionMath,
    Semantics,
    parse_math_list,
    parse_semantics_list,
    row_label,
)
from mla_eval.errors import UserError
from mla_eval.evals import distributed as dist_ranks
from mla_eval.evals import kld_plan, text_sources
from mla_eval.evals.calibrate import calibrate, calibration_workload
from mla_eval.evals.kld import (
    DEFAULT_KLD_PREFILL,
    KldProtocol,
    KldRun,
    check_prefill,
    gather_arrays,
    plan_windows,
    resolve_prefill,
    run_kld,
)
from mla_eval.evals.ref_store import REF_STORE_MODES, RefStore
from mla_eval.evals.settings import (
    DEFAULT_CTX,
    DEFAULT_STRIDE,
    SCALES_MODES,
    ModelSettings,
    check_ctx,
    check_math_backend,
    default_min_context,
    default_stride,
)
from mla_eval.evals.variants import PlanVariant, Variant, check_plan_model, parse_variants
from mla_eval.formats import OuterScales
from mla_eval.formats.v4 import V4_CONFIGS
from mla_eval.model.deepseek_v4 import check_mla_rows, check_variant
from mla_eval.model.fp8_linear import fp8_calls
from mla_eval.protocol import ProgressCallback, no_progress, option, say
from mla_eval.result_schemas import KLD_SCHEMA
from mla_eval.results import environment

DEFAULT_FORMATS = (
    "fp8_ds_mla,fp8_ds_mla_pow2,nvfp4,nvfp4+s_l,nvfp4_fp8rope,nvfp4_fp8rope+s_l,nvfp4_fp8rope_st,mxfp4,fp8_e4m3"
)


@dataclasses.dataclass(frozen=True)
class KldSettings(ModelSettings, text_sources.TextSettings):
    """Everything `mla-eval kld` takes: each field is one of its options (and a recipe's [kld] key)."""

    formats: str | list[str] = option(
        DEFAULT_FORMATS, "--formats", "-f", help="Comma-separated formats; append +s_l to use the per-layer outer scales."
    )
    ref: str = option(
        "bf16", "--ref", help="Reference cache format (bf16, or e.g. fp8_ds_mla to compare against production fp8)."
    )
    # None: DEFAULT_CTX, or --sample-len for self-samples
    ctx: int | None = option(None, "--ctx", help=f"Window length in tokens (default {DEFAULT_CTX}; self-samples: --sample-len).")
    # None: default_stride(ctx, min_context)
    stride: int | None = option(
        None, "--stride", help=f"Window stride in tokens (default {DEFAULT_STRIDE}, or ctx - min-context if smaller)."
    )
    min_context: int | None = option(  # None: default_min_context(ctx)
        None, "--min-context", help="Score only tokens with at least this much context (default ctx/2)."
    )
    batch: int | None = option(  # None: 1 window, or every self-sample at once
        None, "--batch", help="Windows per forward (default: 1; self-samples: all samples at once)."
    )
    scales: str = option(  # SCALES_MODES or a scales JSON path
        "auto", "--scales",
        help="Outer scales for +s_l: a JSON file (nvfp4_ds_mla_outer_scale_v1), 'auto' (calibrate on a held-out slice), "
        "or 'none'.",
    )
    calib_tokens: int = option(
        2048, "--calib-tokens",
        help="--scales auto on a text: its first tokens held out to calibrate s_l, not scored (the text then needs "
        "more than twice as many; self-samples calibrate on one more sample instead).",
    )
    layer_stats: bool = option(
        True, "--layer-stats/--no-layer-stats", help="Per-layer attention-output error and latent SNR."
    )
    save_ref: Path | None = option(
        None, "--save-ref", path="write",
        help="Store the reference log-probs here, to score more formats later with --ref-file.",
    )
    ref_file: Path | None = option(
        None, "--ref-file", path="read",
        help="Reuse stored reference log-probs (same model, text and window settings) instead of the reference forward.",
    )
    ref_store: str = option(
        "topk", "--ref-store",
        help="--save-ref encoding: topk (64 largest + tail mass; KL is a lower bound) or fp16 (full rows).",
    )
    # mla_eval.attention.semantics: cache, engine:C or a preset; a list
    semantics: str | list[str] = option("cache", "--semantics", help=SEMANTICS_HELP)
    math: str | list[str] = option("bf16", "--math", help=MATH_HELP)  # attention math(s): bf16, fp8-q, fp8-qp
    # a format: add its storage-only / compute-only / both rows and breakdown
    explain: str | None = option(
        None, "--explain",
        help="A format (e.g. nvfp4): add its storage-only (format cache, bf16 math), compute-only (bf16 cache, fp8 "
        "math) and both rows under every --semantics, and the breakdown in the JSON.",
    )
    # KLD_PREFILL_MODES: how a window's forward reads the cache. None (not asked): DEFAULT_KLD_PREFILL (auto), quietly:
    # where auto falls back to absorbed (the default layer stats, fp8 math, a DSA model) the reason goes into
    # settings.prefill_reason only; asked for by name, auto's fallback is also a note (printed by the command)
    prefill: str | None = option(
        None, "--prefill", show_default=False,
        help="How each window's forward reads the quantised cache: 'absorbed' runs every position through the absorbed "
        "MQA attention (decode's arithmetic), 'mha' decodes the cache once, up-projects it through kv_b_proj and runs "
        "causal SDPA (flash on CUDA; the same mathematics with bf16 math, up to bf16 rounding of K/V; 2.5-3.2x faster "
        "on an H200). 'auto': mha wherever it computes the same semantics (bf16 math, no --explain fp8 rows, "
        "--no-layer-stats, not a DSA model), else absorbed; the reason is recorded (settings.prefill_reason) and, when "
        f"--prefill auto is given, printed as a note. Default {DEFAULT_KLD_PREFILL}. The JSON records the path "
        "(settings.prefill); give 'absorbed' to compare with figures computed that way.",
    )

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        text_sources.TextSettings.__post_init__(self)
        check_ctx(self.ctx)
        if self.stride is not None and self.stride < 1:
            raise UserError(f"--stride must be positive, got {self.stride}")
        if self.min_context is not None and self.min_context < 0:
            raise UserError(f"--min-context must be >= 0, got {self.min_context}")
        if self.batch is not None and self.batch < 1:
            raise UserError(f"--batch must be at least 1, got {self.batch}")
        if self.calib_tokens < 1:
            raise UserError(f"--calib-tokens must be at least 1, got {self.calib_tokens}")
        if self.prefill is not None:
            check_prefill(self.prefill)
        if self.ref_store not in REF_STORE_MODES:
            raise UserError(f"--ref-store {self.ref_store!r}: choose one of {', '.join(REF_STORE_MODES)}")
        if self.save_ref is not None and self.ref_file is not None:
            raise UserError("give --save-ref or --ref-file, not both")
        self.variants()  # a bad format name fails here, before any model is loaded
        self.ref_variant()
        self.semantics_list()
        check_math_backend(self.math_list(), self.backend)
        self.explain_variant()

    def prefill_mode(self) -> str:
        """The --prefill mode in effect (KLD_PREFILL_MODES): the one asked, else the default."""
        return DEFAULT_KLD_PREFILL if self.prefill is None else self.prefill

    def semantics_list(self) -> list[Semantics]:
        return parse_semantics_list(self.semantics)

    def math_list(self) -> list[AttentionMath]:
        return parse_math_list(self.math)

    def explain_variant(self) -> Variant | None:
        if self.explain is None:
            return None
        found = parse_variants(self.explain, option="--explain")
        if len(found) != 1 or found[0].name == "bf16":
            raise UserError(f"--explain takes one quantised format (e.g. nvfp4), got {self.explain!r}")
        return found[0]

    def variants(self) -> list[Variant | PlanVariant]:
        return parse_variants(self.formats, plans=True)

    def ref_variant(self) -> Variant:
        refs = parse_variants(self.ref, option="--ref")
        if len(refs) != 1:
            raise UserError(f"--ref takes one format, got {self.ref!r}")
        return refs[0]

    def resolved_ctx(self, self_samples: bool) -> int:
        """The one place the default window length is decided."""
        if self.ctx is not None:
            return self.ctx
        return self.sample_len if self_samples else DEFAULT_CTX


@dataclasses.dataclass
class KldResult:
    """One KLD run: what was evaluated (model, text, resolved settings) and the per-format figures."""

    model: dict[str, Any]
    text: dict[str, Any]
    settings: dict[str, Any]
    outer_scales: OuterScales | None
    windows: int
    seconds: float
    formats: dict[str, dict]  # per format: kld_mean, kld_se, ... (see kld_stats.TokenStats.summary)
    environment: dict[str, Any]
    run: KldRun = dataclasses.field(repr=False)  # the per-token arrays behind `formats` (plots)
    rank: int = 0  # under torchrun, only rank 0's result holds a document worth writing

    def mean_kld(self, fmt: str) -> float:
        return self.formats[fmt]["kld_mean"]

    notes: list[str] = dataclasses.field(default_factory=list)  # one-line facts the reader must not miss
    explain: dict[str, Any] | None = None  # see explain_breakdown
    execution: dict[str, Any] | None = None  # the run plan, what streaming read, peak memory per phase

    def to_document(self) -> dict[str, Any]:
        doc = {
            "schema": KLD_SCHEMA,
            "model": self.model,
            "text": self.text,
            "settings": self.settings,
            "outer_scales": None if self.outer_scales is None else self.outer_scales.to_json(),
            "windows": self.windows,
            "seconds": self.seconds,
            "environment": self.environment,
            "formats": self.formats,
            "notes": self.notes,
        }
        if self.explain is not None:
            doc["explain"] = self.explain
        if self.execution is not None:
            doc["execution"] = self.execution
        return doc


def explain_breakdown(formats: dict[str, dict], fmt: str, semantics: list[Semantics], maths: list[AttentionMath]) -> dict:
    """Per semantics: the mean KLD of storage only (fmt's cache, bf16 math), compute only (bf16 cache,
    each fp8 math), both (fmt's cache, each fp8 math), and what both adds over the sum of the two."""
    fp8 = [m.name for m in maths if m.name != "bf16"] or ["fp8-q"]
    out: dict[str, Any] = {"format": fmt, "semantics": {}}
    for sem in semantics:
        def kld(f: str, m: str, sem=sem) -> float:
            return formats[row_label(f, sem, m)]["kld_mean"]

        storage = kld(fmt, "bf16")
        out["semantics"][sem.label] = {
            "storage_only": storage,
            "compute_only": {m: kld("bf16", m) for m in fp8},
            "both": {m: kld(fmt, m) for m in fp8},
            "interaction": {m: kld(fmt, m) - storage - kld("bf16", m) for m in fp8},
        }
    return out


def plan_figures(formats: dict[str, dict], variants) -> dict[str, dict]:
    """Each plan row's figures with the plan beside them: its file, layers, bytes per token and the KLD its maker
    predicted (the sum of single-layer KLDs), so the measured `kld_mean` reads against the prediction."""
    plans = {v.name: v for v in variants if isinstance(v, PlanVariant)}
    out = {}
    for key, row in formats.items():
        pv = plans.get(row.get("format"))
        if pv is not None:
            row = {**row, "plan": {"file": pv.source, "layers": [v.name for v in pv.plan.layers],
                                   "bytes_per_token": pv.plan.bytes_per_token, "predicted_kld": pv.plan.predicted_kld,
                                   "budget": pv.plan.budget}}
        out[key] = row
    return out


def plan_notes(formats: dict[str, dict], variants) -> list[str]:
    """One line per plan row: measured against predicted KLD (the plan's additivity, seen once per run)."""
    notes = []
    for v in variants:
        if isinstance(v, PlanVariant) and v.plan.predicted_kld is not None:
            for row in formats.values():
                if row.get("format") == v.name:
                    m, p = row["kld_mean"], v.plan.predicted_kld
                    notes.append(f"{v.name} ({v.plan.bytes_per_token} B/token): measured KLD {m:.5f} vs predicted {p:.5f} "
                                 f"({(m - p) / p:+.0%})" if p > 0 else f"{v.name}: measured KLD {m:.5f}, predicted {p}")
    return notes


def semantics_notes(semantics: list[Semantics], ctx: int, is_dsa: bool, maths: list[AttentionMath]) -> list[str]:
    """What the chosen semantics mean for these numbers, in one line each."""
    notes = []
    for sem in semantics:
        if not sem.is_engine:
            continue
        if is_dsa:
            notes.append(
                f"{sem.label}: this DSA model's sparse prefill reads every selected key from the quantised cache "
                "(as vLLM's FlashMLA sparse backend does), so engine semantics equal cache semantics here"
            )
        elif sem.chunk >= ctx:
            fp8 = " (only the fp8-math rows can differ from 0)" if any(m.name != "bf16" for m in maths) else ""
            notes.append(
                f"{sem.label}: one chunk covers each {ctx}-token window, so no position reads the cache and every "
                f"format's KLD is exactly 0 with bf16 math{fp8}: a single-chunk prefill never sees the storage error, "
                "decode does"
            )
    return notes


def prefill_notes(asked: str | None, why_absorbed: str | None) -> list[str]:
    """Which path computed the numbers, when the reader asked for one that could have run the other.

    `asked` None (the default auto): no note. The default layer stats alone keep auto on absorbed, so a note
    there would stand on every plain run and teach readers to skip notes; the reason is in settings.prefill_reason
    and the table title names the path."""
    if asked == "auto" and why_absorbed is not None:
        return [f"--prefill auto: every forward ran the absorbed path ({why_absorbed})"]
    return []


def distributed(device: str | None = "auto") -> dist_ranks.Ranks:
    """This rank's place under torchrun (rank 0 of 1 without it); starts the process group once.
    Backend, timeout and the rank checks: `mla_eval.evals.distributed`."""
    return dist_ranks.start(device)


def _split_calibration(source: text_sources.TokenSource, calib_tokens: int):
    """Take the calibration slice off the front of the first sequence; evaluate on the rest."""
    first = source.sequences[0]
    if first.numel() <= calib_tokens * 2:
        raise UserError(
            f"text too short to hold out {calib_tokens} calibration tokens ({first.numel()} tokens; --scales auto needs "
            f"more than 2 x --calib-tokens = {2 * calib_tokens}): give a longer text (or a larger --max-tokens), "
            "--scales FILE, or fewer --calib-tokens"
        )
    calib = text_sources.TokenSource(
        source.kind, f"first {calib_tokens} tokens of {source.label}", [first[:calib_tokens]], "calib"
    )
    rest = text_sources.TokenSource(  # the title says which tokens were scored (the count above is the whole text's)
        source.kind, source.label + f"; its first {calib_tokens} tokens calibrate s_l (--scales auto), not scored",
        [first[calib_tokens:], *source.sequences[1:]], source.digest,
    )
    return calib, rest


def evaluation_sources(lm, st, needs_outer: bool, progress: ProgressCallback):
    """(evaluation tokens, calibration tokens or None) of a kld or plan run (`st`: its TextSettings, scales and
    calib_tokens). Self-samples are always drawn as --samples + 1 sequences in one decoding batch, the last kept
    apart to calibrate on where --scales auto needs it: the text a seed gives must not depend on which formats
    were asked (sampling one more sequence in the batch changes every sequence, so drawing it only for +s_l runs
    scored different text under the same title and seed)."""
    if st.self_samples:
        both = text_sources.self_samples(lm, st.samples + 1, st.sample_len, st.seed, progress)
        calib = None
        if st.scales == "auto" and needs_outer:
            calib = text_sources.TokenSource("self-samples", "a separate self-sample", both.sequences[-1:], "calib")
        return text_sources.self_samples_subset(both, st.samples), calib
    source = text_sources.load_source(lm, st, progress)
    if st.scales == "auto" and needs_outer:
        calib, source = _split_calibration(source, st.calib_tokens)
        return source, calib
    return source, None


def v4_settings(st: KldSettings, lm) -> tuple[KldSettings, list[str]]:
    """The settings a DeepSeek-V4 model runs (`model.deepseek_v4`): the default --formats become its cache
    configurations; per-layer statistics are off (no latent to compare); and the notes that say so."""
    if not getattr(lm.adapter, "is_v4", False):
        check_mla_rows(lm, [*st.variants(), st.ref_variant(), *filter(None, [st.explain_variant()])])
        return st, []
    if st.latent_profile != "none":
        raise UserError("--latent-profile reparametrises an MLA latent; no DeepSeek-V4 profile is published: drop it")
    if any(sem.is_engine for sem in st.semantics_list()) or any(m.name != "bf16" for m in st.math_list()) or st.explain:
        raise UserError("DeepSeek-V4 runs cache semantics in its own attention's math: drop --semantics engine:*, "
                        "--math fp8-* and --explain")
    notes = ["DeepSeek-V4: each row is a cache configuration (sliding-window and compressed heads through their "
             "records, indexer keys exact); the attention is the model's own (transformers' eager, sinks and top-k "
             "included) over the heads as the records read them, one whole window per forward"]
    changes: dict = {}
    if st.formats == DEFAULT_FORMATS:
        changes["formats"] = ",".join(c.name for c in V4_CONFIGS if c.name != "bf16")
    if st.layer_stats:
        changes["layer_stats"] = False
        notes.append("per-layer statistics are not measured on DeepSeek-V4 (--no-layer-stats implied)")
    for v in (*parse_variants(changes.get("formats", st.formats), plans=True), *parse_variants(st.ref, option="--ref")):
        check_variant(v)
    return (dataclasses.replace(st, **changes) if changes else st), notes


def _protocol(st: KldSettings, lm, source: text_sources.TokenSource) -> tuple[KldProtocol, str | None]:
    """The resolved protocol of a run (every default decided once) and why auto prefill chose absorbed, if it did."""
    ctx = st.resolved_ctx(source.kind == "self-samples")
    min_context = st.min_context if st.min_context is not None else default_min_context(ctx)
    stride = st.stride if st.stride is not None else default_stride(ctx, min_context)
    batch = st.batch if st.batch is not None else (len(source.sequences) if source.kind == "self-samples" else 1)
    semantics, maths = st.semantics_list(), st.math_list()
    for sem in semantics:
        sem.check_positions(lm.max_positions)
    protocol = KldProtocol(
        tuple(st.variants()), st.ref_variant(), ctx, stride, min_context, batch, layer_stats=st.layer_stats,
        semantics=tuple(semantics), maths=tuple(maths), explain=st.explain_variant(),
    )
    plan_windows(lm, source, protocol)  # bad settings fail here, before any work
    prefill, why_absorbed = resolve_prefill(st.prefill_mode(), protocol, lm.adapter.is_dsa)
    return dataclasses.replace(protocol, prefill=prefill), why_absorbed


def _ref_meta(lm, source: text_sources.TokenSource, protocol: KldProtocol, outer: OuterScales | None) -> dict:
    """What a stored reference must agree on with this run (`ref_store.RefStore`)."""
    model_id = str(lm.path) if lm.is_random else str(lm.path.resolve())  # a random spec has no folder
    meta = {"model": model_id, "text": source.digest, "ctx": protocol.ctx, "stride": protocol.stride,
            "min_context": protocol.min_context, "ref": protocol.ref.name}
    if protocol.semantics[0].is_engine:  # the stored reference ran that forward schedule
        meta["semantics"] = protocol.semantics[0].label
    if protocol.prefill == "mha":  # the stored reference ran the mha form (unset: absorbed, as older files)
        meta["prefill"] = protocol.prefill
    if protocol.ref.outer:
        meta["ref_scales"] = list(outer.scales)
    return meta


def plan_kld_run(st: KldSettings, progress: ProgressCallback = no_progress, measure: bool = True,
                 read_bps: float | None = None, read_source: str = "") -> kld_plan.KldPlan:
    """`mla-eval kld --dry-run`: the plan of the run these settings ask for, without running it. A checkpoint folder
    needs only config.json, its safetensors index and its tokenizer (no shard); with the shards present and
    `measure`, one layer of each build is read and timed on the device (with shards absent: random values of the
    same shapes) and the run's time projected."""
    from mla_eval.model.strategy import ExecutionStrategy

    with dispatch.use_backend(st.backend), ExecutionStrategy.open(kld_plan.request(st), dry_run=True) as ex:
        try:
            source = kld_plan.planning_source(st, ex.lm)
            needs_outer = any(v.outer for v in [*st.variants(), st.ref_variant(), *filter(None, [st.explain_variant()])])
            if st.scales == "auto" and needs_outer and not st.self_samples:
                _calib, source = _split_calibration(source, st.calib_tokens)  # the run evaluates the rest
            protocol, _ = _protocol(st, ex.lm, source)
            protocol = dataclasses.replace(protocol, outer_scales=None)
            return kld_plan.plan_kld(ex, source, protocol, measure, ref_file=st.ref_file, read_bps=read_bps,
                                     read_source=read_source)
        finally:
            ex.lm = None  # the skeleton and its stack refer to each other: collected now, its device memory with it
            import gc

            gc.collect()


def evaluate_kld(st: KldSettings, progress: ProgressCallback = no_progress) -> KldResult:
    """Teacher-forced KL divergence of each format of `st.formats` against `st.ref`.

    `progress(stage, done, total)` reports calibration ("calibrate", windows) and scoring
    ("score", tokens); the run plan is said first (`protocol.say`). Under torchrun every rank calls
    this; rank 0's result holds the document.
    """
    from mla_eval.model.loader import resolve_device
    from mla_eval.model.strategy import ExecutionStrategy

    with dispatch.use_backend(st.backend) as log:
        ranks = distributed(st.device)
        rank, world = ranks.rank, ranks.world
        if world > 1 and st.device_map != "none":
            raise UserError(
                "--device-map auto spreads one model over the GPUs; under torchrun each rank holds its own copy: "
                "use one or the other"
            )
        if world > 1 and st.save_ref is not None:
            raise UserError("--save-ref is single-process only; run it without torchrun")
        variants, ref = st.variants(), st.ref_variant()
        needs_outer = any(v.outer for v in [*variants, ref, *filter(None, [st.explain_variant()])])
        if st.scales == "none" and needs_outer:
            raise UserError("--scales none, but +s_l formats were asked for; drop them or give --scales FILE")
        given = None
        if st.scales not in SCALES_MODES:
            given = OuterScales.load(st.scales)  # a bad file fails before the model loads
        phases = kld_plan.PhasePeaks(resolve_device(st.device) if st.device_map == "none" else None)
        phases.start("load")
        ex = ExecutionStrategy.open(kld_plan.request(st))
        try:
            lm = ex.lm
            st, v4_notes = v4_settings(st, lm)
            variants, ref = st.variants(), st.ref_variant()
            needs_outer = any(v.outer for v in [*variants, ref, *filter(None, [st.explain_variant()])])
            if given is not None:
                given.check_layers(lm.num_layers, source=st.scales)
            check_plan_model(variants, lm, st.latent_profile)
            source, calib = evaluation_sources(lm, st, needs_outer, progress)
            protocol, why_absorbed = _protocol(st, lm, source)
            ctx, stride, min_context, semantics, maths = (protocol.ctx, protocol.stride, protocol.min_context,
                                                          list(protocol.semantics), list(protocol.maths))
            phases.start("plan")
            kp = kld_plan.plan_kld(ex, source, protocol, measure=False, ref_file=st.ref_file, rank=rank, world=world)
            phases.start("load")
            lm = ex.realise()
            notes = list(v4_notes)
            if ex.mode == "stream":
                phases.start("plan")
                kp = kld_plan.plan_kld(ex, source, protocol, measure=True, ref_file=st.ref_file, rank=rank, world=world)
                if calib is not None:
                    notes.append("--scales auto on a streamed run: the calibration text ran as one more pass over the "
                                 "layers (every layer read once more); give --scales FILE to skip it")
            profile = st.apply_profile(lm, (calib or source).sequences[0], (calib or source).label, progress)
            outer = given
            loaded = None
            if st.ref_file is not None and not ref.outer:  # a mismatched stored reference: refused before the plan
                # is said (the scales of a +s_l reference come from calibration, later)
                loaded = RefStore.load(st.ref_file, _ref_meta(lm, source, protocol, None))
            for line in kp.lines():
                say(progress, f"plan: {line}")
            if calib is not None:
                phases.start("calibrate")
                outer = calibrate(lm, calib, ctx, progress=progress, runner=ex.runner_for(calibration_workload(lm, calib, ctx)))
            protocol = dataclasses.replace(protocol, outer_scales=outer if needs_outer else given)
            ref_meta = _ref_meta(lm, source, protocol, outer)
            saver = RefStore(mode=st.ref_store, meta=ref_meta) if st.save_ref is not None else None
            if st.ref_file is not None and loaded is None:
                loaded = RefStore.load(st.ref_file, ref_meta)
            phases.start("score")
            run = run_kld(lm, source, protocol, progress=progress, save_ref=saver, ref_file=loaded, rank=rank, world=world,
                          runner=ex.runner)
        finally:
            ex.close()
        phases.stop()
        if saver is not None:
            saver.save(st.save_ref)
        with dist_ranks.collective(ranks, "gathering the per-token statistics"):
            run.stats = gather_arrays(run.stats, group=ranks.cpu_group)
        env = phases.merge_peaks(environment(attention=log))
    execution = {"strategy": ex.mode, "plan": kp.as_dict(), "phases": phases.as_dict(), "read": ex.record()["read"],
                 "fp8_gemm_calls": fp8_calls()}
    weights = lm.weights()
    return KldResult(
        model={"name": lm.name, "path": str(lm.path), "default": lm.is_default, "layers": lm.num_layers,
               "random": lm.is_random, "label": lm.label, "max_positions": lm.max_positions,
               "rope_scaling": lm.rope_scaling, **({"weights": weights} if weights is not None else {}), **lm.compute(),
               **({"latent_profile": profile} if profile is not None else {})},
        text={"kind": source.kind, "label": source.label, "digest": source.digest, "tokens": source.num_tokens,
              **({"note": st.text_note} if st.text_note else {})},
        settings={"ref": ref.name, "ctx": ctx, "stride": stride, "min_context": min_context, "batch": protocol.batch,
                  "block_size": protocol.block_size, "world_size": world, "backend": log.backend,
                  "unscored_tokens": run.unscored, "semantics": [s.as_dict() for s in semantics],
                  "math": [m.name for m in maths], "explain": None if st.explain is None else protocol.explain.name,
                  "prefill": protocol.prefill, "prefill_asked": st.prefill_mode(), "prefill_reason": why_absorbed,
                  "offload": st.offload, "controls": [v.name for v in variants if v.spec.control],
                  **st.placement(lm)},
        outer_scales=protocol.outer_scales,
        windows=run.windows,
        seconds=run.seconds,
        formats=plan_figures(run.summary(), variants),
        environment=env,
        run=run,
        rank=rank,
        notes=semantics_notes(semantics, ctx, lm.adapter.is_dsa, maths) + prefill_notes(st.prefill, why_absorbed) + notes
        + plan_notes(run.summary(), variants),
        explain=None if protocol.explain is None else explain_breakdown(
            run.summary(), protocol.explain.name, semantics, maths),
        execution=execution,
    )
