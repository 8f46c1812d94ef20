"""DeepGEMM's FP8 GEMMs, when the optional `deep_gemm` package is importable (the `sgl-deep-gemm` wheel: a prebuilt
CUDA-13 build of SGLang's DeepGEMM branch, sgl-project/DeepGEMM, version 0.2.5 read here).

Nothing imports `deep_gemm` until `available()` is asked on a CUDA run: a CPU run and the tests never load it.
`available()` answers (True, "") or (False, the reason in one line); `require()` raises that reason as a UserError
for a run that asked for the kernel by name (`MLA_EVAL_FP8_GEMM=deepgemm`); otherwise the caller falls back to the
torch reference (mla_eval.model.fp8_math) and says so (mla_eval.model.fp8_linear records the backend of every call).

The calls, as the package's `deep_gemm/__init__.py` spells them (0.2.5):

    fp8_gemm_nt((a, sfa), (b, sfb), d)                       a [M, K] e4m3, sfa [M, K/128] fp32 (per token, 1x128)
                                                             b [N, K] e4m3, sfb [N/128, K/128] fp32 (128x128)
                                                             d [M, N] bf16, d = a @ b.T
    m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices)
                                                             b [G, N, K], sfb [G, N/128, K/128]; m_indices [M] int32:
                                                             each row's group, -1 for padding rows; every group's rows
                                                             contiguous, padded to get_mk_alignment_for_contiguous_layout()

The scale-factor layouts the kernels want (MN-major, TMA-aligned) are made inside the calls
(`transform_sf_into_required_layout` in the C++ entry), so plain row-major fp32 scales go in.

Why not torch's own FP8 products: `torch.nn.functional.scaled_grouped_mm` (torch 2.9+, present in 2.11) takes
tensor-wise and row-wise scales on sm_90, not 128x128 weight blocks with 1x128 activation groups
(pytorch/pytorch benchmarks/operator_benchmark/pt/scaled_grouped_mm_test.py @96ed368f: "FP8 (e4m3/e5m2) with
TensorWise and RowWise scaling: CUDA SM90 (H100) only"); expressing block scales through it would need one product
per 128-deep K-group. DeepGEMM computes the engines' block recipe in one kernel.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from mla_eval.errors import UserError

BACKEND_ENV = "MLA_EVAL_FP8_GEMM"  # auto (default) | deepgemm (required) | torch (the reference, never DeepGEMM)
BACKENDS = ("auto", "deepgemm", "torch")


def asked_backend() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise UserError(f"{BACKEND_ENV}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Any, str]:
    """(the deep_gemm module or None, why not)."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible"
    major, _minor = torch.cuda.get_device_capability()
    if major != 9:
        return None, f"DeepGEMM's FP8 kernels here are built for Hopper (sm_90); this GPU is sm_{major}{_minor}"
    try:
        import deep_gemm  # noqa: PLC0415 - optional, loaded only on a GPU run that computes FP8
    except ImportError:
        return None, "the deep_gemm package is not installed (pip install sgl-deep-gemm, a CUDA-13 wheel)"
    except (OSError, RuntimeError) as exc:  # a wheel built against another torch / CUDA fails in its loader
        return None, f"deep_gemm failed to load ({str(exc).splitlines()[0][:200]})"
    missing = [n for n in ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout")
               if not hasattr(deep_gemm, n)]
    if missing:
        return None, f"this deep_gemm has no {', '.join(missing)}"
    return deep_gemm, ""


def available() -> tuple[bool, str]:
    """Whether DeepGEMM computes FP8 GEMMs on this machine, and if not why (one line)."""
    if asked_backend() == "torch":
        return False, f"{BACKEND_ENV}=torch"
    module, why = _load()
    return module is not None, why


def require() -> Any:
    """The deep_gemm module; a UserError naming why it cannot run."""
    module, why = _load()
    if module is None:
        raise UserError(f"{BACKEND_ENV}=deepgemm, but DeepGEMM cannot run: {why}; unset it to use the torch reference")
    return module


def alignment() -> int:
    """Rows each group's segment is padded to in the contiguous grouped layout."""
    return int(require().get_mk_alignment_for_contiguous_layout())


def gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """[M, N] = (xq, xs) @ (wq, ws).T through `fp8_gemm_nt`."""
    dg = require()
    n = wq.shape[0]
    if n % 128:  # kv_a_proj_with_mqa's 576 rows: zero rows up to the block grid, which the scales already cover
        pad = torch.zeros(-(-n // 128) * 128 - n, wq.shape[1], dtype=torch.uint8, device=wq.device)
        wq = torch.cat([wq.view(torch.uint8), pad]).view(wq.dtype)
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)
    dg.fp8_gemm_nt((xq.contiguous(), xs.float().contiguous()), (wq.contiguous(), ws.float().contiguous()), out)
    return out[:, :n]


def grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, m_indices: torch.Tensor,
                 out_dtype=torch.bfloat16) -> torch.Tensor:
    """[M, N] = per row r: (xq[r], xs[r]) @ (wq[g], ws[g]).T with g = m_indices[r] (rows of -1 are padding)."""
    dg = require()
    out = torch.empty(xq.shape[0], wq.shape[1], dtype=out_dtype, device=xq.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((xq.contiguous(), xs.float().contiguous()),
                                        (wq.contiguous(), ws.float().contiguous()), out, m_indices.int().contiguous())
    return out


def supports(n: int, k: int) -> bool:
    """Shapes `gemm` takes: K a multiple of 128 (whole activation groups); N any (rows padded to the block grid)."""
    return k % 128 == 0
