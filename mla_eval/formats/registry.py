"""The format registry: built-in specs plus any a user registers from Python.

    from mla_eval.formats import register_format, FormatSpec, Field, VectorCoding, ScaleRule
    register_format(FormatSpec(name="my_fmt", ...))   # then usable everywhere by name

A registered spec is validated when it is built (fields must tile the record exactly), and its
name must not clash with an existing one unless `replace=True`.
"""

from __future__ import annotations

from mla_eval.errors import UnknownFormatError, UserError
from mla_eval.formats.builtin import BUILTIN_FORMATS, ENGINE_NAMES
from mla_eval.formats.controls import ALL_CONTROLS, CONTROL_FORMATS
from mla_eval.formats.spec import CONTROL_PREFIX, LATENT_DIM, ROPE_DIM, EngineName, FormatSpec
from mla_eval.formats.v4 import DSV4_FORMATS, V4_ENGINE_NAMES

_REGISTRY: dict[str, FormatSpec] = {spec.name: spec for spec in BUILTIN_FORMATS}
# Records of another model geometry (DeepSeek-V4's 448 + 64, mla_eval.formats.v4): resolved by name and alias, but
# outside every list of the 512 + 64 formats (a default --formats, all_formats(), a lookup by record width).
_OTHER_GEOMETRY: dict[str, FormatSpec] = {spec.name: spec for spec in DSV4_FORMATS}
_ENGINE_NAMES: tuple[EngineName, ...] = ENGINE_NAMES + V4_ENGINE_NAMES
# Controls resolve by name but sit outside the registry's lists: never in a default, a table of all
# formats, or a lookup by record width (mla_eval.formats.controls).
_CONTROLS: dict[str, FormatSpec] = {spec.name: spec for spec in CONTROL_FORMATS}


# Aliases that once selected a format under a name its engine never used: refused with the engine's real name.
RETIRED_ALIASES = {
    "vllm:nvfp4_fp8_ds_mla": "format name 'vllm:nvfp4_fp8_ds_mla' is not vLLM's name (only PR 51724's text): vLLM calls "
    "the 352 B record nvfp4_ds_mla; use nvfp4_fp8_ds_mla or vllm:nvfp4_ds_mla",
}


def _aliases() -> dict[str, FormatSpec]:
    """Other names that select a format (each spec lists its own under `aliases`)."""
    return {alias: spec for spec in (*_REGISTRY.values(), *_OTHER_GEOMETRY.values()) for alias in spec.aliases}


def alias_note(name: str) -> str | None:
    """'X selects Y' when `name` is an alias, for commands to show once; else None."""
    spec = _aliases().get(name)
    return None if spec is None else f"format name {name!r} is an alias of {spec.name!r}; results record {spec.name!r}"


def engine_name_meanings(name: str) -> tuple[EngineName, ...]:
    """Every record an engine calls `name`, per engine and version (`builtin.ENGINE_NAMES`)."""
    return tuple(e for e in _ENGINE_NAMES if e.name == name)


def ambiguous_engine_names() -> dict[str, tuple[EngineName, ...]]:
    """Engine names that mean more than one record: refused bare, with the candidates (our own format names,
    such as nvfp4, keep selecting our format)."""
    names = dict.fromkeys(e.name for e in _ENGINE_NAMES if e.name not in _REGISTRY)
    meanings = {n: engine_name_meanings(n) for n in names}
    return {n: m for n, m in meanings.items() if len({(e.record_bytes, e.format) for e in m}) > 1}


def _ambiguous(name: str) -> UnknownFormatError:
    options = "; ".join(
        f"{e.engine} {e.version}: "
        + (f"{e.format} ({e.record_bytes} B{_alias_text(e.format)})" if e.format else f"{e.record_bytes} B, not built in")
        for e in engine_name_meanings(name)
    )
    return UnknownFormatError(f"format name {name!r} is ambiguous (engines use it for several records): {options}")


def _alias_text(fmt: str) -> str:
    aliases = (_REGISTRY.get(fmt) or _OTHER_GEOMETRY[fmt]).aliases
    return f", alias {' / '.join(aliases)}" if aliases else ""


def register_format(spec: FormatSpec, *, replace: bool = False) -> FormatSpec:
    """Add a user-defined format. Raises ValueError if the name is taken (unless replace)."""
    if not isinstance(spec, FormatSpec):
        raise TypeError("register_format takes a FormatSpec")
    if spec.control or spec.name in _CONTROLS:
        raise ValueError(f"{spec.name!r}: control formats are built in (mla_eval.formats.controls), not registered")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"format {spec.name!r} is already registered; pass replace=True to override it")
    ambiguous = ambiguous_engine_names()
    taken = set(_REGISTRY) | set(_OTHER_GEOMETRY) | set(_aliases()) | set(ambiguous)
    clashes = [a for a in spec.aliases if a in taken or a == spec.name]
    if spec.name in _aliases() or spec.name in _OTHER_GEOMETRY or spec.name in ambiguous or clashes:
        raise ValueError(f"format {spec.name!r}: name or alias {(clashes or [spec.name])[0]!r} is already taken")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_format(name: str) -> None:
    """Remove a user-registered format (built-ins cannot be removed)."""
    if any(spec.name == name for spec in BUILTIN_FORMATS) or name in _CONTROLS or name in _OTHER_GEOMETRY:
        raise ValueError(f"{name!r} is a built-in format and cannot be removed")
    _REGISTRY.pop(name, None)


def all_formats() -> list[FormatSpec]:
    """Every registered format: built-ins in their documented order, then user formats."""
    return list(_REGISTRY.values())


def format_names() -> list[str]:
    return list(_REGISTRY)


def geometry_formats() -> list[FormatSpec]:
    """The built-in records of other model geometries (DeepSeek-V4), outside `all_formats()`."""
    return list(_OTHER_GEOMETRY.values())


def control_formats() -> list[FormatSpec]:
    """The control ladder (not real formats), mildest first."""
    return list(_CONTROLS.values())


def expand_controls(names: list[str]) -> list[str]:
    """A format list with 'control:*' replaced by the whole ladder, mildest first (every list of names reads it so)."""
    return [n for t in names for n in (list(_CONTROLS) if t.strip() == ALL_CONTROLS else [t])]


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Look a format up by name (a FormatSpec passes through)."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if fmt in _REGISTRY:
        return _REGISTRY[fmt]
    if fmt in _CONTROLS:
        return _CONTROLS[fmt]
    if fmt in _OTHER_GEOMETRY:
        return _OTHER_GEOMETRY[fmt]
    if fmt.startswith(CONTROL_PREFIX):
        raise UnknownFormatError(f"unknown control format {fmt!r}; the controls are {', '.join(_CONTROLS)} "
                                 f"(or {ALL_CONTROLS} for all)")
    if fmt in ambiguous_engine_names():
        raise _ambiguous(fmt)
    try:
        return _aliases()[fmt]
    except KeyError:
        pass
    if fmt in RETIRED_ALIASES:
        raise UnknownFormatError(RETIRED_ALIASES[fmt])
    meanings = [e for e in engine_name_meanings(fmt) if e.format is not None]
    hint = f" ({fmt!r} is an engine's name: ours is {meanings[0].format}{_alias_text(meanings[0].format)})" if meanings else ""
    raise UnknownFormatError(
        f"unknown cache format {fmt!r}{hint}; choose one of: {', '.join(_REGISTRY)} (see `mla-eval formats`)"
    )


def parse_format_list(text: str | None, default: list[str] | None = None) -> list[FormatSpec]:
    """'nvfp4,fp8_ds_mla' -> specs, in the order given; None/'' -> `default` (or all formats)."""
    if not text:
        names = default if default is not None else format_names()
        return [get_format(n) for n in names]
    names = [t.strip() for t in text.split(",") if t.strip()]
    names = expand_controls(names)
    if not names:
        raise UnknownFormatError("--formats is empty; give a comma-separated list such as nvfp4,fp8_ds_mla")
    seen: list[FormatSpec] = []
    for n in names:
        spec = get_format(n)
        if spec not in seen:
            seen.append(spec)
    return seen


def format_for_record_bytes(width: int, what: str = "cache tensor") -> FormatSpec:
    """The one format whose record is `width` bytes (reading a cache tensor of unknown format).

    Refuses a width that no format has, and a width several formats share (name the format then).
    """
    matches = [spec for spec in _REGISTRY.values() if spec.record_bytes == width]
    if not matches:
        widths = ", ".join(f"{s.name}={s.record_bytes}" for s in _REGISTRY.values())
        raise UserError(f"{what} has records of {width} B, which matches no cache format ({widths}); check the last dimension")
    if len(matches) > 1:
        names = ", ".join(s.name for s in matches)
        raise UserError(f"{what} has records of {width} B, shared by {names}; name the format explicitly")
    return matches[0]


def check_model_dims(latent_dim: int, rope_dim: int, model: str = "this model") -> None:
    """Every MLA format is a 512 + 64 record; say clearly when an MLA config caches something else.

    DeepSeek-V4 caches 448 no-rope + 64 rope values (mla_eval.formats.v4), but it is not an MLA config (no
    kv_lora_rank): an MLA config of those widths is refused, named as such rather than as a bare mismatch.
    """
    if (latent_dim, rope_dim) == (LATENT_DIM, ROPE_DIM):
        return
    if (latent_dim, rope_dim) == (448, 64):
        raise UserError(
            f"{model} caches 448 + 64 values per token (a DeepSeek-V4 cache) through an MLA config (kv_lora_rank 448): "
            f"not supported; the MLA formats are {LATENT_DIM} + {ROPE_DIM} records, and DeepSeek-V4 loads as model_type "
            "deepseek_v4 (head_dim 512, 64 rotated) with its own records (mla-eval formats)"
        )
    raise UserError(
        f"{model} caches {latent_dim} + {rope_dim} values per token (kv_lora_rank {latent_dim}, qk_rope_head_dim {rope_dim}); "
        f"every cache format is defined for {LATENT_DIM} latent + {ROPE_DIM} rope values (kv_lora_rank {LATENT_DIM}, "
        f"qk_rope_head_dim {ROPE_DIM}), so neither the codecs nor the byte counts apply"
    )
