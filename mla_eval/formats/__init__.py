"""Cache formats: one `FormatSpec` per format, a registry, and bit-exact torch codecs."""

from mla_eval.formats.codec import decode, encode
from mla_eval.formats.outer_scale import OuterScales
from mla_eval.formats.registry import (
    all_formats,
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
    Field,
    FormatSpec,
    OuterScale,
    ScaleRule,
    VectorCoding,
)

__all__ = [
    "LATENT_DIM",
    "OUTER_SCALE_SCHEMA",
    "ROPE_DIM",
    "Field",
    "FormatSpec",
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
