"""The declarative description of a cache format: what bytes one token of one layer occupies.

A `FormatSpec` is the single definition of a format. The torch codec (`codec.py`), the GPU
kernels, the capacity math and the `formats` table all read it; none of them restates a byte
count or an offset.

Exact arithmetic (shared by the torch codec and the GPU writers, so both agree bit for bit):
all in float32, IEEE round-to-nearest-even.
1. Outer scale (optional, per layer, `outer_scale`): v = c * r_l with r_l = 1 / s_l (one correctly
   rounded reciprocal, `rcp.rn.f32`), applied to the latent (and to the rope too where
   `OuterScale.applies_to_rope`); where `OuterScale.bf16_result` the product is rounded to bf16
   (RNE) before anything else, as an engine that scales its bf16 tensor in torch ahead of the
   writer holds it. The reader multiplies s_l back.
2. Per-token scale (two-level mode, `token_scale`): s_t = max(amax(v over the token's latent) / 2688,
   FLT_MIN) (`div.rn.f32`), stored as fp32; the latent becomes v * (1 / s_t) before its group
   scales are taken.
3. Group scales, per `ScaleRule` (amax = max |v| over the group; `floor` = `VectorCoding.scale_floor`):
   - AMAX_FP32:    s = max(amax / qmax, floor), stored as fp32 (vLLM: floor = FLT_MIN).
   - AMAX_FP32_POW2: s = 2^ceil(log2(max(amax / qmax, floor))), stored as fp32 (FlashMLA's
     test quantiser: floor = 1e-4, then the power of two at or above; ceil(log2) is exact here).
   - AMAX_E4M3:    s = e4m3_rn_satfinite(amax / 6) stored as E4M3 (NVFP4 block scale); s may be 0.
   - AMAX_E4M3_RCP6: s = e4m3_rn_satfinite(amax * rcp.approx.ftz(6)) (NVIDIA's NVFP4 recipe,
     `cvt_warp_fp16_to_fp4` at global scale 1; the measured rcp.approx(6) equals f32(1/6)); s may be 0.
     With an engine global scale S (`VectorCoding.global_scale`, the recipe's SFScaleVal):
     s = e4m3_rn_satfinite(S * (amax * rcp.approx.ftz(6))), the inner product rounded to f32 first.
   - AMAX_FP32_MUL: s = amax * f32(1 / qmax) (a compile-time constant), stored as fp32; s may be 0.
   - AMAX_E4M3_UP: f = max(amax / 6, floor); s = e4m3_rn_satfinite(f), then one E4M3 step up where
     s < f and s < 448 (upstream vLLM nvfp4_fp8_ds_mla: amax / s never exceeds 6); never 0.
   - E8M0_CEIL:    s = 2^ceil(log2(max(amax / 6, floor))) stored as E8M0 (SGLang's KVFP4 block scale,
     exact ceil of the exact log2 here).
   - UE8M0_CEIL:   s = 2^ceil(log2(max(amax, floor) / qmax)) stored as E8M0 (DeepSeek-V4's UE8M0 FP8 and V4.1's
     MXFP8 records: the floor bounds amax itself, 1e-4 in every engine; the float32 quotient is taken with
     div.rn.f32 -- an engine that multiplies by f32(1 / qmax) instead reaches the same power of two for every
     input tested, tests/test_engine_ports_v4.py); never 0.
   - AMAX_E4M3_CLAMP6: s = e4m3_rn(clamp(amax * f32(1/6), floor, 448)) (vLLM's DeepSeek-V4.1 NVFP4 record: no
     global scale, the smallest E4M3 subnormal as floor, so s is never 0).
   - OCP_E8M0:     s = 2^(floor(log2 amax) - 2) (OCP MX v1.0: emax of E2M1 is 2), exponent
     clamped to [-127, 127], 2^-127 for amax = 0; stored as E8M0.
   - TENSOR:       no stored scale; the group is scaled only by the outer scale.
   - NONE:         stored as bf16, no scale.
4. Elements, per `ScaleApply` (`VectorCoding.apply`):
   - MUL_RCP: q = cvt.rn.satfinite(v * r) with r = 1 / s (`rcp.rn.f32`), and r = 0 where s = 0.
   - MUL_RCP_APPROX: q = cvt.rn.satfinite(v * rcp.approx.ftz(s)), 0 where s = 0. For an E4M3 s the
     reciprocal is looked up in the table measured on the GPU (`approx.py`); for an fp32 s (not
     tabulable) the codec uses rcp.rn and the format's engine note gives the measured residual.
     With a global scale S the factor is rcp.approx.ftz(s * rcp.approx.ftz(S)); S and the product are
     arbitrary fp32 values, so the codec takes both reciprocals with rcp.rn (residual measured on the
     GPU by kernels/measure_trtllm_nvfp4_residual.py). Where `zero_scale_saturates` (TensorRT-LLM tests
     amax != 0, not s != 0), a group with s = 0 but amax > 0 gets the factor +inf: a nonzero v becomes
     +-inf and saturates to code +-6, v = +-0 becomes NaN, taken here as +6 (E2M1 has no NaN; the PTX
     ISA's cvt .satfinite rule for NaN-less narrow formats, positive MAX_NORM, as we read it: not checked
     on hardware, since sm_90 has no cvt to e2m1x2; only reached where S * amax / 6 < 2^-10).
   - DIV:     q = cvt.rn.satfinite(v / s) (`div.rn.f32`; the engine divides, e.g. vLLM's
     `scaled_convert`), s is never 0 under these rules (floored).
   Scales are stored in group order, or permuted (`ScaleOrder`): see `scale_positions`.
5. Residual E2M1 (`VectorCoding.residual`, TensorRT-LLM's residual MLA quantisation of the rope): per group
   of 16, v = x * S (S = the global scale, on the values here, 1 without one); main scale s1 =
   e4m3_rn_satfinite(max(amax(v) * rcp.approx.ftz(6), floor)), codes q1 = cvt(v * rcp.approx.ftz(s1))
   (E4M3 s1: the measured table); residual r = v - q1 * s1 (the product is exact, one rounding); s2, q2 the
   same on r. The group's 16 bytes of data are [q1 codes | q2 codes], its two scale bytes [s1, s2]. The
   decoder returns fma(q2, s2 * D, q1 * (s1 * D)) (float64 arithmetic reproduces the fused multiply-add
   exactly here), D = `GlobalScale.dequant` (1 without a global scale). The fma is nvcc's default contraction
   of the reader's `values += residual * scale`, assumed, not inspected in SASS; the other contraction or none
   differs only where a float32 ulp moves the later E4M3 rounding.
6. SGLang's DSA NVFP4 rule (`ScaleRule.AMAX_E4M3_DIV6G`, `VectorCoding.elem_rounding` "midpoints"), with g =
   `GlobalScale.dequant` (the per-layer fp32 scale the engine keeps outside the row): x = clamp(x, -b, b) with
   b = f32(2688 * g); s = e4m3_rn(clamp(amax / f32(6 * g), 0, 448)); D = f32(s * g); the code of |x| counts the
   seven midpoints f32(D * k), k = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, passed with `>` at k = 0.25, 1.25, 2.5, 5
   and `>=` at the others (each product rounded to f32: no reciprocal), sign bit = signbit(x); all codes +0 where
   D = 0. The decoder returns (q * s) * g.
7. ggml block types (`ElemType` q8_0 / q4_0 / q5_1, `ScaleRule.GGML_BLOCK`): 32 values per block, each block
   carrying its own fp16 scale (and q5_1 its fp16 minimum) in front of its codes; the arithmetic is ggml's
   reference quantisers, spelled out in `ggml.py`.
8. Per-token scale s_t, two rules (`FormatSpec.token_scale_rule`): DIV_FLOORED is step 2 above (mla-eval's own);
   MUL_FOLDED is b12x's: s_t = amax * f32(1/2688) (no floor), r_t = rcp.approx.ftz(s_t) (rcp.rn here: not
   tabulable), group scale e4m3((amax_g * r_t) * rcp.approx.ftz(6)) from the unscaled values, codes
   cvt(x * (rcp.approx.ftz(s) * r_t)) (s from the measured table), all codes and scales 0 where s_t = 0.
Decoding returns q * s (then * s_t, then * s_l), all exact products of the stored values; with a global scale it
returns q * (s * D), D = `GlobalScale.dequant` (the engine's reader multiplies its fp32 dequant scale into the
block scale first), except SGLang's DSA rule (step 6). Where `FormatSpec.reader_e4m3` the engine's attention
reads an E4M3 copy of those values, so the decoder rounds them to E4M3 (RN, satfinite) last.
Non-finite inputs are refused (`codec.check_finite`) unless the caller asks for the engine's own policy and the
spec names one (`FormatSpec.nonfinite`): "nan_zero_inf_saturate" (SGLang's DSA writer) turns latent NaN into +0
(the step-6 clamp takes +-inf to +-b) and rope NaN into +0, rope +-inf into +-bf16 max.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Literal

ElemType = Literal["bf16", "e4m3", "e2m1", "q8_0", "q4_0", "q5_1"]
ScaleDType = Literal["fp32", "e4m3", "e8m0"]

BITS = {"bf16": 16, "e4m3": 8, "e2m1": 4, "fp32": 32, "e8m0": 8, "pad": 8}
# ggml block types: a Field of these counts whole 32-value blocks (scale(s) and codes), bits per block
GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q5_1": 24}
GGML_BLOCK_VALUES = 32
BITS.update({kind: 8 * nbytes for kind, nbytes in GGML_BLOCK_BYTES.items()})
LATENT_DIM = 512  # kv_lora_rank of DeepSeek-V3 / V3.2, Kimi-K2, GLM-5
ROPE_DIM = 64  # qk_rope_head_dim of the same models
# DeepSeek-V4 caches one 512-d head per entry (K = V, transformers `deepseek_v4`: head_dim 512, 64 of them rotated):
# its records store the 448 values without rope as the "latent" and the 64 rotated ones as the "rope"
DSV4_NOPE_DIM = 448
DSV4_ROPE_DIM = 64
TOKEN_SCALE_DENOMINATOR = 6.0 * 448.0  # E2M1 max x E4M3 max: s_t maps the token amax onto 6*448
OUTER_SCALE_SCHEMA = "nvfp4_ds_mla_outer_scale_v1"
CONTROL_PREFIX = "control:"  # the name of every control format (formats/controls.py), and only theirs
FLT_MIN = 2.0**-126  # smallest normal float32: vLLM's guard for all-zero groups


class ScaleRule(str, enum.Enum):
    NONE = "none"
    TENSOR = "tensor"
    AMAX_FP32 = "amax/qmax fp32"
    AMAX_FP32_POW2 = "pow2ceil(amax/qmax) fp32"
    AMAX_E4M3 = "e4m3(amax/6)"
    AMAX_E4M3_UP = "e4m3 up(max(amax/6, floor))"
    AMAX_E4M3_RCP6 = "e4m3(amax*rcp.approx(6))"
    AMAX_FP32_MUL = "amax*f32(1/qmax) fp32"
    E8M0_CEIL = "2^ceil(log2(max(amax/6, floor))) e8m0"
    UE8M0_CEIL = "2^ceil(log2(max(amax, floor)/qmax)) e8m0"
    AMAX_E4M3_CLAMP6 = "e4m3(clamp(amax*f32(1/6), floor, 448))"
    OCP_E8M0 = "2^(floor(log2 amax)-2) e8m0"
    AMAX_E4M3_DIV6G = "e4m3(clamp(amax/(6g),0,448))"
    GGML_BLOCK = "ggml block (fp16 scale in each block)"


class TokenScaleRule(str, enum.Enum):
    """How the per-token scale s_t is taken and applied (spec steps 2 and 8)."""

    DIV_FLOORED = "max(amax/2688, FLT_MIN); latent * (1/s_t) first"
    MUL_FOLDED = "amax * f32(1/2688); rcp(s_t) folded into each group's factor"


class ScaleApply(str, enum.Enum):
    """How the elements of a scaled group are brought to the element range (step 4 above)."""

    MUL_RCP = "x * rcp.rn(s)"
    MUL_RCP_APPROX = "x * rcp.approx.ftz(s)"
    DIV = "x / s"


class ScaleOrder(str, enum.Enum):
    """Where the scale of group s sits inside the scale field (byte-sized scales)."""

    LINEAR = "linear"  # group s at byte s
    TRANSPOSE_8X4 = "8*(s&3)+(s>>2)"  # vLLM/FlashMLA nvfp4_sf_byte: an 8x4 -> 4x8 transpose of 32 scales


def scale_positions(order: ScaleOrder, n_groups: int) -> tuple[int, ...]:
    """Element s = position (in scale entries) of group s's scale within the scale field."""
    if order is ScaleOrder.LINEAR:
        return tuple(range(n_groups))
    return tuple(8 * (s & 3) + (s >> 2) for s in range(n_groups))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The values one record holds per token: `latent_dim` stored without rope, then `rope_dim` rotated ones."""

    name: str
    latent_dim: int
    rope_dim: int
    models: str


MLA_GEOMETRY = Geometry("mla", LATENT_DIM, ROPE_DIM, "DeepSeek-V3/V3.2, Kimi-K2, GLM-5 (kv_lora_rank 512 + 64 rope)")
DSV4_GEOMETRY = Geometry("deepseek_v4", DSV4_NOPE_DIM, DSV4_ROPE_DIM, "DeepSeek-V4 / V4.1 (head 512: 448 nope + 64 rope)")
GEOMETRIES = (MLA_GEOMETRY, DSV4_GEOMETRY)


def geometry_of(latent_dim: int, rope_dim: int) -> Geometry | None:
    return next((g for g in GEOMETRIES if (g.latent_dim, g.rope_dim) == (latent_dim, rope_dim)), None)


@dataclasses.dataclass(frozen=True)
class Engine:
    """The serving engine whose writer defines a format's bytes (the codec follows it step for step).

    `flag` is the engine's own name for the format (its --kv-cache-dtype value or dtype name);
    `symbol` the function whose arithmetic we follow, in `path` of `repository` at `commit`.
    """

    name: str
    repository: str
    path: str
    symbol: str
    commit: str
    flag: str
    note: str = ""

    def citation(self) -> str:
        return f"{self.repository}@{self.commit[:12]} {self.path} {self.symbol}"


@dataclasses.dataclass(frozen=True)
class EngineName:
    """What one engine calls a cache record, in one version: `name` is its own spelling (a --kv-cache-dtype
    value or a dtype), `version` where that meaning holds (repository@commit or PR, and any setting or model
    geometry it depends on), `record_bytes` what it writes per token and layer. `format` is the built-in
    format with those bytes, or None for a record that is known but not built in (`not_built_in` says why)."""

    engine: str
    name: str
    version: str
    record_bytes: int
    format: str | None
    not_built_in: str = ""

    def describe(self) -> str:
        what = self.format if self.format is not None else f"not built in: {self.not_built_in}"
        return f"{self.engine} {self.name!r} ({self.version}): {what}, {self.record_bytes} B"


@dataclasses.dataclass(frozen=True)
class Field:
    """A run of `count` elements of `dtype` at byte `offset` inside the record."""

    name: str
    offset: int
    dtype: str  # one of BITS' keys
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * BITS[self.dtype] // 8

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest even), as a Python float; pure Python (no torch here)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclasses.dataclass(frozen=True)
class GlobalScale:
    """An engine's per-tensor second-level NVFP4 scale, derived from an assumed max |value| `amax`.

    The engine computes (Python doubles, stored as float32 tensors) dequant = amax / denominator and
    quant = 1 / dequant; the writer's block scales are quant * amax_group / 6 and its reader multiplies
    dequant back. Not stored in the record.
    """

    amax: float
    denominator: float = TOKEN_SCALE_DENOMINATOR
    source: str = ""  # where the engine takes `amax` from (environment variable, default)

    @property
    def dequant(self) -> float:
        return _f32(self.amax / self.denominator)

    @property
    def quant(self) -> float:
        return _f32(1.0 / (self.amax / self.denominator))


@dataclasses.dataclass(frozen=True)
class VectorCoding:
    """How one vector (the 512-d latent or the 64-d rope) is stored."""

    dim: int
    elem: ElemType
    data: Field
    scale_rule: ScaleRule
    group: int  # values sharing one scale (== dim for one scale per vector)
    scale: Field | None = None  # where the group scales live; None for NONE / TENSOR
    apply: ScaleApply = ScaleApply.MUL_RCP  # how elements are scaled (multiply by 1/s or divide by s)
    # lower bound of amax / qmax for the fp32 rules, AMAX_E4M3_UP and AMAX_E4M3_CLAMP6; of amax itself for UE8M0_CEIL
    scale_floor: float = FLT_MIN
    scale_order: ScaleOrder = ScaleOrder.LINEAR  # where each group's scale sits in the scale field
    zero_scale_clears: bool = False  # a group whose scale is 0 stores code 0 (+0) for every value (b12x)
    # E2M1 code choice: cvt's RNE, SGLang KVFP4's `>= bound` (ties away), or SGLang DSA's midpoint comparisons (step 6)
    elem_rounding: Literal["rne", "ties_away", "midpoints"] = "rne"
    global_scale: GlobalScale | None = None  # the recipe's SFScaleVal (AMAX_E4M3_RCP6 only); None = 1
    zero_scale_saturates: bool = False  # s = 0 < amax: factor +inf, codes +-6 and +6 for zeros (TensorRT-LLM)
    residual: bool = False  # a second E2M1 pass over each group's residual (step 5); data and scales doubled

    @property
    def scale_count(self) -> int:
        return self.dim // self.group * (2 if self.residual else 1)

    @property
    def scale_positions(self) -> tuple[int, ...]:
        return scale_positions(self.scale_order, self.dim // self.group)

    @property
    def qmax(self) -> float:
        return {"bf16": float("inf"), "e4m3": 448.0, "e2m1": 6.0}.get(self.elem, float("nan"))  # nan: ggml blocks

    @property
    def ggml(self) -> bool:
        """A ggml block type: the data field holds whole blocks (scales inside), no separate scale field."""
        return self.elem in GGML_BLOCK_BYTES


@dataclasses.dataclass(frozen=True)
class OuterScale:
    """A per-layer scale s_l supplied by the caller (calibrated), not stored in the record.

    `denominator` maps the calibrated max |c_kv| onto the format's range: s_l = max / denominator.
    Without a scale (where it is optional) the values are stored unscaled, i.e. s_l = 1.
    """

    required: bool
    denominator: float
    applies_to_rope: bool = False
    # The engine divides its bf16 latent by s_l in torch before the cache writer: on CUDA a tensor
    # divided by a Python float is bf16(float(x) * (1.0f / float(s_l))) (torch's div_true_kernel_cuda
    # multiplies by the opmath reciprocal of a CPU scalar), so the writer sees bf16 values.
    bf16_result: bool = False


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    name: str
    title: str
    description: str
    source: str  # where the layout comes from
    record_bytes: int
    latent: VectorCoding
    rope: VectorCoding
    token_scale: Field | None = None
    pads: tuple[Field, ...] = ()
    outer_scale: OuterScale | None = None
    align: int = 16
    engine: Engine | None = None  # None: a layout of our own choosing (`source` says why)
    # Separate allocations the engine keeps per token (name, start, end) inside this logical record,
    # e.g. SGLang's packed data and scale buffers; () = one record. Capacity counts their sum.
    buffers: tuple[tuple[str, int, int], ...] = ()
    # Other names that select this format: the engine-facing '<engine>:<its name>' (e.g. 'vllm:fp8_ds_mla'),
    # and any older name of ours. Results always record `name`.
    aliases: tuple[str, ...] = ()
    # The engine's attention reads an E4M3 copy of the decoded cache (TensorRT-LLM's NVFP4 MLA gather into
    # an fp8 scratch before its FMHA): decode() rounds its output to E4M3 last.
    reader_e4m3: bool = False
    token_scale_rule: TokenScaleRule = TokenScaleRule.DIV_FLOORED  # how s_t is taken (steps 2 and 8)
    # The engine's writer defines what NaN / inf become (see the module docstring); None: refused, as always
    nonfinite: Literal["nan_zero_inf_saturate"] | None = None
    # A control (mla_eval.formats.controls): a deliberately damaging record of no engine, named 'control:...',
    # that results mark as not a real format
    control: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def fields(self) -> tuple[Field, ...]:
        """Every field of the record, in byte order."""
        parts = [self.latent.data, self.rope.data, *self.pads]
        parts += [c.scale for c in (self.latent, self.rope) if c.scale is not None]
        if self.token_scale is not None:
            parts.append(self.token_scale)
        return tuple(sorted(parts, key=lambda f: f.offset))

    @property
    def geometry(self) -> Geometry:
        """The model geometry whose values the record holds (validated: one of GEOMETRIES)."""
        geometry = geometry_of(self.latent.dim, self.rope.dim)
        assert geometry is not None
        return geometry

    @property
    def bits_per_value(self) -> float:
        """Stored bits per cached value (576 per token in the MLA geometry), scales and padding included."""
        return self.record_bytes * 8 / (self.latent.dim + self.rope.dim)

    def layout(self) -> str:
        """One-line byte map, e.g. '[0,256) latent e2m1x512 | [256,288) latent_scale e4m3x32 | ...'."""
        return " | ".join(f"[{f.offset},{f.end}) {f.name} {f.dtype}x{f.count}" for f in self.fields)


def _validate(spec: FormatSpec) -> None:
    """The fields must tile the record exactly: no overlap, no hole, nothing past the end."""
    if spec.control != spec.name.startswith(CONTROL_PREFIX) or (spec.control and spec.engine is not None):
        raise ValueError(f"{spec.name}: a control format (control=True) is named 'control:...', has no engine, and only it")
    if geometry_of(spec.latent.dim, spec.rope.dim) is None:
        known = ", ".join(f"{g.latent_dim} + {g.rope_dim} ({g.name})" for g in GEOMETRIES)
        raise ValueError(f"{spec.name}: formats are defined for a latent + rope of {known}")
    pos = 0
    for f in spec.fields:
        if f.offset != pos:
            raise ValueError(f"{spec.name}: field {f.name} starts at {f.offset}, expected {pos} (hole or overlap)")
        pos = f.end
    if pos != spec.record_bytes:
        raise ValueError(f"{spec.name}: fields end at byte {pos} but record_bytes is {spec.record_bytes}")
    if spec.buffers:
        ends = [0] + [end for _, _, end in spec.buffers]
        if [start for _, start, _ in spec.buffers] != ends[:-1] or ends[-1] != spec.record_bytes:
            raise ValueError(f"{spec.name}: buffers must split the record [0,{spec.record_bytes}) in order")
    if spec.outer_scale is not None and spec.outer_scale.bf16_result and spec.outer_scale.applies_to_rope:
        raise ValueError(f"{spec.name}: bf16_result is defined for a latent-only outer scale (no engine scales the rope so)")
    if spec.record_bytes % spec.align:
        raise ValueError(f"{spec.name}: record of {spec.record_bytes} B is not {spec.align}-byte aligned")
    for c in (spec.latent, spec.rope):
        if c.dim % c.group:
            raise ValueError(f"{spec.name}: group {c.group} does not divide dim {c.dim}")
        if c.ggml != (c.scale_rule is ScaleRule.GGML_BLOCK):
            raise ValueError(f"{spec.name}: ggml block types go with scale rule {ScaleRule.GGML_BLOCK.value!r} and only with it")
        if c.ggml and not (c.group == GGML_BLOCK_VALUES and c.data.dtype == c.elem and c.data.count * c.group == c.dim):
            raise ValueError(f"{spec.name}: a ggml coding stores {c.dim // GGML_BLOCK_VALUES} {c.elem} blocks of 32 values")
        per_value = 2 if c.residual else 1  # a residual coding stores two codes per value
        if not c.ggml and c.data.count != c.dim * per_value:
            raise ValueError(f"{spec.name}: data field {c.data.name} holds {c.data.count} codes, not {c.dim * per_value}")
        needs_scale = c.scale_rule not in (ScaleRule.NONE, ScaleRule.TENSOR, ScaleRule.GGML_BLOCK)
        if needs_scale != (c.scale is not None):
            raise ValueError(f"{spec.name}: scale field presence does not match rule {c.scale_rule.value}")
        if c.scale is not None and c.scale.count != c.scale_count:
            raise ValueError(f"{spec.name}: {c.scale.count} scales for {c.dim // c.group} groups")
        if c.residual and not (c.elem == "e2m1" and c.group == 16 and c.scale is not None and c.scale.dtype == "e4m3"
                               and c.scale_rule is ScaleRule.AMAX_E4M3_RCP6 and c.apply is ScaleApply.MUL_RCP_APPROX
                               and not c.zero_scale_saturates
                               and c.scale_order is ScaleOrder.LINEAR):
            raise ValueError(f"{spec.name}: residual coding is defined for e2m1 groups of 16 with linear E4M3 RCP6 scales")
        divisible = (ScaleRule.AMAX_FP32, ScaleRule.AMAX_FP32_POW2, ScaleRule.E8M0_CEIL, ScaleRule.AMAX_E4M3_CLAMP6)
        if c.apply is ScaleApply.DIV and c.scale_rule not in divisible:
            raise ValueError(f"{spec.name}: division by the scale needs a floored fp32 scale rule (never divides by 0)")
        if c.scale_order is ScaleOrder.TRANSPOSE_8X4 and (c.scale is None or c.scale.count != 32 or c.scale.dtype == "fp32"):
            raise ValueError(f"{spec.name}: the 8x4 scale transpose is defined for 32 byte-sized scales")
        if not 0.0 < c.scale_floor < 1.0:
            raise ValueError(f"{spec.name}: scale_floor {c.scale_floor} must lie in (0, 1)")
        if (c.elem == "bf16") != (c.scale_rule is ScaleRule.NONE):
            raise ValueError(f"{spec.name}: bf16 data goes with scale rule NONE and only with it")
        if c.scale_rule is ScaleRule.UE8M0_CEIL and not (c.elem == "e4m3" and c.scale is not None
                                                        and c.scale.dtype == "e8m0" and c.apply is ScaleApply.MUL_RCP):
            raise ValueError(f"{spec.name}: the UE8M0 rule is E4M3 codes times the exact 2^-e of an E8M0 scale")
        if c.scale_rule is ScaleRule.AMAX_E4M3_CLAMP6 and not (c.elem == "e2m1" and c.scale is not None
                                                              and c.scale.dtype == "e4m3" and c.apply is ScaleApply.DIV):
            raise ValueError(f"{spec.name}: the clamped E4M3 rule is E2M1 codes divided by an E4M3 scale")
        recipe = c.scale_rule is ScaleRule.AMAX_E4M3_RCP6 and c.apply is ScaleApply.MUL_RCP_APPROX
        dsa = c.scale_rule is ScaleRule.AMAX_E4M3_DIV6G
        gs = c.global_scale
        if gs is not None and not (recipe or dsa):
            raise ValueError(f"{spec.name}: a global scale is defined for the AMAX_E4M3_RCP6 rule with MUL_RCP_APPROX only")
        if dsa != (c.elem_rounding == "midpoints") or (dsa and not (
                gs is not None and c.elem == "e2m1" and c.scale is not None and c.scale.dtype == "e4m3"
                and c.scale_order is ScaleOrder.LINEAR and not (c.zero_scale_clears or c.zero_scale_saturates))):
            raise ValueError(f"{spec.name}: SGLang's DSA rule is E2M1 with linear E4M3 scales, midpoint codes and a global g")
        if gs is not None and not (0.0 < gs.amax < float("inf") and gs.denominator > 0):
            raise ValueError(f"{spec.name}: global scale amax {gs.amax} must be positive and finite")
        if c.zero_scale_saturates and (c.zero_scale_clears or c.elem != "e2m1" or c.apply is not ScaleApply.MUL_RCP_APPROX):
            raise ValueError(f"{spec.name}: zero_scale_saturates is defined for e2m1 with MUL_RCP_APPROX, not with clearing")
    if spec.reader_e4m3 and (spec.token_scale is not None or spec.outer_scale is not None):
        raise ValueError(f"{spec.name}: reader_e4m3 is defined for formats without s_t or s_l")
    if spec.token_scale_rule is TokenScaleRule.MUL_FOLDED:
        lat = spec.latent
        if not (spec.token_scale is not None and lat.elem == "e2m1" and lat.scale_rule is ScaleRule.AMAX_E4M3_RCP6
                and lat.apply is ScaleApply.MUL_RCP_APPROX and lat.global_scale is None and lat.zero_scale_clears):
            raise ValueError(f"{spec.name}: b12x's folded s_t is defined for a cleared E2M1 RCP6 latent with s_t stored")
    if spec.nonfinite is not None and spec.latent.scale_rule is not ScaleRule.AMAX_E4M3_DIV6G:
        raise ValueError(f"{spec.name}: the non-finite policy {spec.nonfinite!r} is SGLang's DSA writer's")
