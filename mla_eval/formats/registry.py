"""The format registry: built-in specs plus any a user registers from Python.

    from mla_eval.formats import register_format, FormatSpec, Field, VectorCoding, ScaleRule
    register_format(FormatSpec(name="my_fmt", ...))   # then usable everywhere by name

A registered spec is validated when it is built (fields must tile the record exactly), and its
name must not clash with an existing one unless `replace=True`.
"""

from __future__ import annotations

from mla_eval.errors import UnknownFormatError
from mla_eval.formats.builtin import BUILTIN_FORMATS
from mla_eval.formats.spec import FormatSpec

_REGISTRY: dict[str, FormatSpec] = {spec.name: spec for spec in BUILTIN_FORMATS}


def register_format(spec: FormatSpec, *, replace: bool = False) -> FormatSpec:
    """Add a user-defined format. Raises ValueError if the name is taken (unless replace)."""
    if not isinstance(spec, FormatSpec):
        raise TypeError("register_format takes a FormatSpec")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"format {spec.name!r} is already registered; pass replace=True to override it")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_format(name: str) -> None:
    """Remove a user-registered format (built-ins cannot be removed)."""
    if any(spec.name == name for spec in BUILTIN_FORMATS):
        raise ValueError(f"{name!r} is a built-in format and cannot be removed")
    _REGISTRY.pop(name, None)


def all_formats() -> list[FormatSpec]:
    """Every registered format: built-ins in their documented order, then user formats."""
    return list(_REGISTRY.values())


def format_names() -> list[str]:
    return list(_REGISTRY)


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Look a format up by name (a FormatSpec passes through)."""
    if isinstance(fmt, FormatSpec):
        return fmt
    try:
        return _REGISTRY[fmt]
    except KeyError:
        raise UnknownFormatError(
            f"unknown cache format {fmt!r}; choose one of: {', '.join(_REGISTRY)} (see `mla-eval formats`)"
        ) from None


def parse_format_list(text: str | None, default: list[str] | None = None) -> list[FormatSpec]:
    """'nvfp4,fp8_ds_mla' -> specs, in the order given; None/'' -> `default` (or all formats)."""
    if not text:
        names = default if default is not None else format_names()
        return [get_format(n) for n in names]
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UnknownFormatError("--formats is empty; give a comma-separated list such as nvfp4,fp8_ds_mla")
    seen: list[FormatSpec] = []
    for n in names:
        spec = get_format(n)
        if spec not in seen:
            seen.append(spec)
    return seen
