"""Format specs the tests share (imported by plain name: conftest puts tests/ on sys.path)."""

from mla_eval.formats import Field, FormatSpec, ScaleRule, VectorCoding

# A valid spec the kernels refuse (an E4M3 latent with a scale per 8 values; the kernels need groups of 16):
# it keeps the refusal and the reference fallback tested now that every registered format has a kernel.
ODD_GROUP = FormatSpec(
    name="odd_group",
    title="odd",
    description="E4M3 latent with a scale per 8 values",
    source="test",
    record_bytes=896,
    latent=VectorCoding(512, "e4m3", Field("latent", 0, "e4m3", 512), ScaleRule.AMAX_FP32, 8, Field("s", 512, "fp32", 64)),
    rope=VectorCoding(64, "bf16", Field("rope", 768, "bf16", 64), ScaleRule.NONE, 64),
)
