"""`mla-eval formats`: every registered cache format, its bytes and its byte layout."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from mla_eval.formats import FormatSpec, control_formats, get_format, parse_format_list
from mla_eval.formats.builtin import ENGINE_NAMES as MLA_ENGINE_NAMES
from mla_eval.formats.builtin import KNOWN_NOT_BUILT_IN
from mla_eval.formats.registry import ambiguous_engine_names, geometry_formats
from mla_eval.formats.spec import DSV4_GEOMETRY, EngineName
from mla_eval.formats.v4 import DSV4_BF16, DSV4_FP8_DS_MLA, V4_CONFIGS, V4_ENGINE_NAMES, V4_NOT_BUILT

ENGINE_NAMES = MLA_ENGINE_NAMES + V4_ENGINE_NAMES

WIDE_TABLE = 110  # terminal columns the formats table needs with every column (the longest labels unwrapped)


def _engine_name_row(e: EngineName) -> dict:
    return {"engine": e.engine, "name": e.name, "version": e.version, "record_bytes": e.record_bytes,
            "format": e.format, "not_built_in": e.not_built_in or None}


def format_row(spec: FormatSpec) -> dict:
    """The figures the table and --json show for one format (all derived from the spec)."""
    v4 = spec.geometry is DSV4_GEOMETRY  # ratios against the same geometry's bf16 and fp8 records
    bf16 = (DSV4_BF16 if v4 else get_format("bf16")).record_bytes
    fp8 = (DSV4_FP8_DS_MLA if v4 else get_format("fp8_ds_mla")).record_bytes
    return {
        "name": spec.name,
        "geometry": spec.geometry.name,  # "mla" (512 + 64) or "deepseek_v4" (448 + 64): which models it caches
        "control": spec.control,  # a deliberately damaging yardstick, not a real format (formats.controls)
        "title": spec.title,
        "bytes_per_token_per_layer": spec.record_bytes,
        "bits_per_value": round(spec.bits_per_value, 4),
        "tokens_per_byte_vs_bf16": round(bf16 / spec.record_bytes, 4),
        "tokens_per_byte_vs_fp8_ds_mla": round(fp8 / spec.record_bytes, 4),
        "latent": {"elem": spec.latent.elem, "group": spec.latent.group, "scale_rule": spec.latent.scale_rule.value,
                   "residual": spec.latent.residual},
        "rope": {"elem": spec.rope.elem, "group": spec.rope.group, "scale_rule": spec.rope.scale_rule.value,
                 "residual": spec.rope.residual},
        "token_scale": spec.token_scale is not None,
        "outer_scale": None
        if spec.outer_scale is None
        else {"required": spec.outer_scale.required, "denominator": spec.outer_scale.denominator,
              "applies_to_rope": spec.outer_scale.applies_to_rope, "bf16_result": spec.outer_scale.bf16_result},
        "fields": [
            {"name": f.name, "offset": f.offset, "bytes": f.nbytes, "dtype": f.dtype, "count": f.count} for f in spec.fields
        ],
        "description": spec.description,
        "source": spec.source,
        "engine": None if spec.engine is None else {
            "name": spec.engine.name,
            "flag": spec.engine.flag,
            "repository": spec.engine.repository,
            "path": spec.engine.path,
            "symbol": spec.engine.symbol,
            "commit": spec.engine.commit,
            "note": spec.engine.note,
        },
        "arithmetic": {"latent_apply": spec.latent.apply.value, "latent_scale_floor": spec.latent.scale_floor},
        "aliases": list(spec.aliases),
        "buffers": [{"name": n, "start": a, "end": b} for n, a, b in spec.buffers],
        # An engine's per-tensor NVFP4 scale (not stored per token) and whether its attention reads an E4M3 copy.
        "global_scale": None if (gs := spec.latent.global_scale) is None
        else {"amax": gs.amax, "quant": gs.quant, "dequant": gs.dequant, "source": gs.source},
        "reader_e4m3": spec.reader_e4m3,
        # What engines call this record, per engine and version (builtin.ENGINE_NAMES)
        "engine_names": [_engine_name_row(e) for e in ENGINE_NAMES if e.format == spec.name],
    }


def formats(
    names: str = typer.Option(None, "--formats", "-f", help="Comma-separated formats to show (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    layout: bool = typer.Option(True, "--layout/--no-layout", help="Show the byte layout column."),
) -> None:
    """List cache formats: bytes per token per layer, bits per value, ratios and byte layout.

    Ratios are tokens per byte relative to bf16 (1152 B) and fp8_ds_mla (656 B): 1.52 means 52 %
    more tokens fit in the same memory. The per-layer outer scale s_l is not stored per token.
    """
    rows = [format_row(s) for s in parse_format_list(names)]
    if as_json:
        known = [_engine_name_row(e) for e in ENGINE_NAMES if e.format is None]
        controls = [format_row(s) for s in control_formats()] if not names else []
        v4 = ({"formats": [format_row(s) for s in geometry_formats()], "configurations": [_config_row(c) for c in V4_CONFIGS],
               "not_built_in": list(V4_NOT_BUILT)} if not names else None)
        typer.echo(json.dumps({"formats": rows, "known_not_built_in": known, "controls": controls,
                               **({"deepseek_v4": v4} if v4 else {})}, indent=2))
        return
    specs = parse_format_list(names)
    console = Console()
    # below this width the ratio and bits columns give way (named under the table) so no cell is cut to "late..."
    narrow = console.width < WIDE_TABLE
    table = Table(title="MLA KV-cache formats: bytes per token per layer (512 latent + 64 rope values)")
    table.add_column("format", style="bold", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("bits", justify="right")
    table.add_column("x bf16", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("x fp8", justify="right", no_wrap=True)
    table.add_column("latent", overflow="fold")
    table.add_column("rope", overflow="fold")
    table.add_column("scales", overflow="fold")
    for spec, row in zip(specs, rows):
        extra = []
        if spec.token_scale is not None:
            extra.append("s_t/token")
        if spec.outer_scale is not None:
            extra.append("s_l opt.")
        if spec.buffers:
            extra.append(f"{len(spec.buffers)} buffers")
        if spec.latent.global_scale is not None:
            extra.append(f"global S={spec.latent.global_scale.quant:.4g}")
        if spec.reader_e4m3:
            extra.append("read as e4m3")
        if spec.rope.residual or spec.latent.residual:
            extra.append("residual pass")
        cells = [spec.name, str(spec.record_bytes)]
        cells += [] if narrow else [f"{spec.bits_per_value:.2f}"]
        cells += [f"{row['tokens_per_byte_vs_bf16']:.2f}"]
        cells += [] if narrow else [f"{row['tokens_per_byte_vs_fp8_ds_mla']:.2f}"]
        cells += [_coding_label(spec.latent), _coding_label(spec.rope), ", ".join(extra) or "-"]
        table.add_row(*cells)
    console.print(table)
    if narrow:
        console.print(f"Not shown below {WIDE_TABLE} columns: bits, x fp8 (widen the terminal, or --json).")
    if layout:
        lt = Table(title="Byte layouts [start,end)", show_lines=False)
        lt.add_column("format", style="bold", no_wrap=True)
        lt.add_column("fields", overflow="fold")
        for spec in specs:
            lt.add_row(spec.name, "  ".join(f"[{f.offset},{f.end}) {f.name} {f.dtype}x{f.count}" for f in spec.fields))
        console.print(lt)
    et = Table(title="Defining engine: the bytes are those this engine writes (its own name for the format)")
    et.add_column("format", style="bold", no_wrap=True)
    et.add_column("engine", no_wrap=True)
    et.add_column("engine's name")
    et.add_column("source (repository@commit path symbol)", overflow="fold")
    for spec in specs:
        eng = spec.engine
        aliases = f" (also: {', '.join(spec.aliases)})" if spec.aliases else ""
        if eng is None:
            et.add_row(spec.name + aliases, "-", "-", f"no engine pinned: {spec.source}")
        else:
            et.add_row(spec.name + aliases, eng.name, eng.flag, eng.citation())
    console.print(et)
    nt = Table(title="Engine names, per engine and version (a name with several records is refused alone)")
    nt.add_column("engine's name", style="bold", no_wrap=True)
    nt.add_column("engine", no_wrap=True)
    nt.add_column("version / setting", overflow="fold")
    nt.add_column("bytes", justify="right")
    nt.add_column("format", overflow="fold")
    shown = {spec.name for spec in specs}
    for e in ENGINE_NAMES:
        if e.format is None or e.format in shown:
            nt.add_row(e.name, e.engine, e.version, str(e.record_bytes), e.format or f"not built in: {e.not_built_in}")
    console.print(nt)
    for name, meanings in ambiguous_engine_names().items():
        sizes = ", ".join(f"{e.record_bytes} B" for e in meanings)
        console.print(f"'{name}' alone is ambiguous ({sizes}): use our name or its '<engine>:<name>' alias.")
    console.print(
        "bits = stored bits per cached value; x bf16 / x fp8 = tokens that fit in the same memory as "
        "with bf16 / fp8_ds_mla; s_l = per-layer outer scale (not stored per token); global S = an engine's "
        "per-tensor NVFP4 scale (not stored per token); read as e4m3 = the engine's attention reads an E4M3 copy; "
        "residual pass = a second E2M1 pass over the first one's error."
    )
    if not names:
        _print_controls(console)
        _print_v4(console)


def _print_controls(console: Console) -> None:
    """The control ladder, apart from the real formats: it exists to show what a test can detect."""
    ct = Table(title="Control formats: NOT real formats -- deliberately damaging yardsticks, mildest first "
               "(--formats control:* selects them all; needle --power reports which ones a grid detects)")
    ct.add_column("control", style="bold", no_wrap=True)
    ct.add_column("bytes", justify="right")
    ct.add_column("latent")
    ct.add_column("rope")
    ct.add_column("what it does", overflow="fold")
    for spec in control_formats():
        outer = spec.outer_scale is not None
        ct.add_row(spec.name, str(spec.record_bytes), _coding_label(spec.latent, outer), _coding_label(spec.rope, outer),
                   spec.description.removeprefix("Control, not a real format: "))
    console.print(ct)


def _config_row(c) -> dict:
    return {"name": c.name, "title": c.title, "sliding": c.sliding.spec.name, "compressed": c.compressed.spec.name,
            "binding": c.sliding.binding, "bytes": {"sliding": c.sliding.spec.record_bytes,
                                                    "compressed": c.compressed.spec.record_bytes,
                                                    "indexer": c.indexer_bytes},
            "indexer_record": c.indexer_record, "source": c.source}


def _print_v4(console: Console) -> None:
    """DeepSeek-V4's records (448 + 64) and what each engine configuration writes to each kind of entry."""
    vt = Table(title="DeepSeek-V4 records (448 NoPE + 64 rope per entry; --formats for a V4 model takes the "
               "configuration names below)")
    vt.add_column("format", style="bold", no_wrap=True)
    vt.add_column("bytes", justify="right")
    vt.add_column("latent")
    vt.add_column("rope")
    vt.add_column("engine (repository@commit path symbol)", overflow="fold")
    for spec in geometry_formats():
        vt.add_row(spec.name, str(spec.record_bytes), _coding_label(spec.latent), _coding_label(spec.rope),
                   "-" if spec.engine is None else f"{spec.engine.name}: {spec.engine.citation()}")
    console.print(vt)
    ct = Table(title="DeepSeek-V4 cache configurations: the record of each kind of entry (bytes per entry)")
    ct.add_column("--formats", style="bold", no_wrap=True)
    ct.add_column("sliding window")
    ct.add_column("compressed (rate 4 / 128)")
    ct.add_column("indexer keys")
    ct.add_column("engine", overflow="fold")
    for c in V4_CONFIGS:
        whole = " (whole head)" if c.sliding.binding == "whole_head" else ""
        ct.add_row(c.name, f"{c.sliding.spec.name}{whole} {c.sliding.spec.record_bytes} B",
                   f"{c.compressed.spec.name} {c.compressed.spec.record_bytes} B", f"{c.indexer_bytes} B", c.source)
    console.print(ct)


def _coding_label(coding, outer: bool = True) -> str:
    """'e2m1 e4m3/16' = E2M1 values, one E4M3 scale per 16 values ('2x' with a residual pass); a per-tensor
    coding is scaled by s_l where the format takes one (`outer`), else stored unscaled."""
    if coding.ggml:
        return f"{coding.elem} blocks/{coding.group}"
    if coding.scale is None:
        return coding.elem if coding.scale_rule.value == "none" else f"{coding.elem} {'x s_l' if outer else 'unscaled'}"
    return f"{'2x ' if coding.residual else ''}{coding.elem} {coding.scale.dtype}/{coding.group}"


def _known_not_built_in() -> str:
    """The help epilog: records engines write that no built-in format covers."""
    return "Known, not built in: " + " | ".join(KNOWN_NOT_BUILT_IN + V4_NOT_BUILT)


def register(app: typer.Typer) -> None:
    app.command("formats", epilog=_known_not_built_in())(formats)
