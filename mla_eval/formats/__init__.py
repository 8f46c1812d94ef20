"""Cache formats: one `FormatSpec` per format, a registry, and bit-exact torch codecs."""

from mla_eval.formats.codec import decode, encode
from mla_eval.formats.outer_scale import OuterScales
from mla_eval.formats.registry import (
    alias_note,
    all_formats,
    check_model_dims,
    control_formats,
    format_for_record_bytes,
    format_names,
    get_format,
    parse_format_list,
    register_format,
    unregister_format,
)
from mla_eval.formats.spec import (
    LATENT_DIM,
    OUTER_SCALE_SCHEMA,
    ROPE_DIM,
    Engine,
    EngineName,
    Field,
    FormatSpec,
    GlobalScale,
    OuterScale,
    ScaleApply,
    ScaleRule,
    VectorCoding,
)

__all__ = [
    "Engine",
    "EngineName",
    "ScaleApply",
    "alias_note",
    "check_model_dims",
    "control_formats",
    "format_for_record_bytes",
    "LATENT_DIM",
    "OUTER_SCALE_SCHEMA",
    "ROPE_DIM",
    "Field",
    "FormatSpec",
    "GlobalScale",
    "OuterScale",
    "OuterScales",
    "ScaleRule",
    "VectorCoding",
    "all_formats",
    "decode",
    "encode",
    "format_names",
    "get_format",
    "parse_format_list",
    "register_format",
    "unregister_format",
]
