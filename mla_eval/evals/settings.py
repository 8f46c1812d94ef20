"""What every evaluation shares: the model to load and where, the attention backend, the
protocol defaults (one definition each), and settings from a recipe table.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from mla_eval.attention import dispatch
from mla_eval.errors import UserError
from mla_eval.model.latent_profile import PROFILE_HELP
from mla_eval.model.loader import DEVICE_MAP_HELP, MAX_MEMORY_HELP, MODEL_HELP
from mla_eval.model.rope_scaling import ROPE_SCALING_HELP
from mla_eval.protocol import ProgressCallback, no_progress, option, say

PROFILE_CALIBRATION_TOKENS = 2048  # tokens a latent profile measures the model's own magnitudes on
SCALES_MODES = ("auto", "none")  # --scales: one of these, or a path to an outer-scale JSON
DEFAULT_CTX = 2048  # window length of text / dataset evaluations (self-samples: their --sample-len)
DEVICES_HELP = "cpu, cuda, cuda:N or auto"
BACKEND_HELP = (
    "Attention path: auto (kernel for CUDA tensors where it can run), kernel, or reference (default: MLA_EVAL_BACKEND or auto)."
)


def default_min_context(ctx: int) -> int:
    """A scored token has at least half a window before it unless the user says otherwise."""
    return ctx // 2


DEFAULT_STRIDE = 512


def default_stride(ctx: int, min_context: int) -> int:
    """512 tokens, or less where a window adds fewer new scored positions (no token is skipped)."""
    return max(1, min(DEFAULT_STRIDE, ctx - min_context))


def check_ctx(ctx: int | None, option: str = "--ctx") -> None:
    if ctx is not None and ctx < 2:
        raise UserError(f"{option} must be at least 2 tokens (omit it for the default), got {ctx}")


def check_math_backend(maths, backend: str | None) -> None:
    """An attention math the CuTe kernels cannot compute (P in E4M3) with --backend kernel: refused
    before any work, in one line (auto sends it to the torch reference and says so)."""
    chosen = backend if backend is not None else dispatch.default_backend()
    for m in maths:
        if chosen == "kernel" and m.kernel_blocker is not None:
            where = "--backend kernel" if backend is not None else f"{dispatch.BACKEND_ENV}=kernel"
            raise UserError(f"--math {m.name} with {where}: {m.kernel_blocker}; use --backend reference or auto")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Which checkpoint (None: the embedded default model), on which device, through which attention path."""

    model: Path | str | None = option(None, "--model", "-m", help=MODEL_HELP)  # a folder, or a `random:<preset>` spec
    device: str = option("auto", "--device", help=DEVICES_HELP + ".")
    device_map: str = option("none", "--device-map", help=DEVICE_MAP_HELP)
    # None: MLA_EVAL_BACKEND or auto (dispatch.default_backend)
    backend: str | None = option(None, "--backend", help=BACKEND_HELP)
    # 'yarn:FACTOR' extends the context (mla_eval.model.rope_scaling)
    rope_scaling: str = option("none", "--rope-scaling", help=ROPE_SCALING_HELP)
    # --device-map auto: accelerate's cap per GPU, e.g. "40GiB"
    max_memory: str | None = option(None, "--max-memory", help=MAX_MEMORY_HELP)
    # a built-in profile name, a JSON file of per-layer max |c_kv|, or none (mla_eval.model.latent_profile)
    latent_profile: str = option("none", "--latent-profile", help=PROFILE_HELP)

    def __post_init__(self) -> None:
        from mla_eval.model.latent_profile import parse_profile
        from mla_eval.model.rope_scaling import parse_rope_scaling  # no torch: validated before any load

        if self.backend is not None:
            dispatch.check_backend(self.backend)
        parse_rope_scaling(self.rope_scaling)
        parse_profile(self.latent_profile)  # a bad name or file fails before any load
        if self.max_memory is not None:
            from mla_eval.model.loader import check_max_memory  # torch: only when the option is used

            check_max_memory(self.max_memory, self.device_map)

    def load(self):
        from mla_eval.model.loader import load_model, resolve_device  # torch + transformers: only when used

        if self.device_map == "none":  # --backend kernel where the kernels cannot run: refused before the load
            dispatch.preflight(self.backend, [resolve_device(self.device)])
        lm = load_model(
            self.model, self.device, device_map=self.device_map, rope_scaling=self.rope_scaling, max_memory=self.max_memory
        )
        if self.device_map == "auto" and all(d.type == "cpu" for d in lm.layer_devices):  # said, not silent
            warnings.warn("--device-map auto found no GPU: every layer runs on the CPU (drop --device-map auto for a "
                          "plain CPU run, or make the GPUs visible)", stacklevel=2)
        return lm

    def apply_profile(self, lm, ids, label: str, progress: ProgressCallback = no_progress) -> dict | None:
        """--latent-profile: reparametrise the loaded model so each layer's max |c_kv| over the first window of the
        run's own text (`ids`, 1-D, at most PROFILE_CALIBRATION_TOKENS used) follows the profile; what was done, for
        the result's model.latent_profile (None without a profile). The screen is told (`say`), as of every setting
        that changes the numbers."""
        from mla_eval.model.latent_profile import apply_latent_profile, parse_profile

        profile = parse_profile(self.latent_profile)
        if profile is None:
            return None
        if getattr(lm, "checkpoint", None) is not None:
            raise UserError("--latent-profile reparametrises the whole model in memory: run it with --offload none")
        window = ids[:PROFILE_CALIBRATION_TOKENS].view(1, -1)
        applied = apply_latent_profile(lm, profile, window, f"{window.shape[1]} tokens from the start of {label}")
        say(progress, f"latent profile: {profile.summary()} applied; each layer's latent scaled by "
                      f"{min(applied.factors):.3g}..{max(applied.factors):.3g} (kv_a_layernorm x c_l, kv_b_proj / c_l)")
        return applied.as_dict()

    def placement(self, lm) -> dict:
        """Where the model ran, for the result document: the device map, the per-GPU cap (bytes) and,
        under --device-map auto, each layer's device (its cache lives there too)."""
        from mla_eval.model.loader import check_max_memory

        out = {"device_map": self.device_map, "max_memory_per_gpu": check_max_memory(self.max_memory, self.device_map)}
        if self.device_map == "auto":
            out["layer_devices"] = [str(dev) for dev in lm.layer_devices]
        return out
