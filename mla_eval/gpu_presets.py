"""Built-in GPU presets: the total memory per GPU that the capacity arithmetic starts from.

vLLM starts from the total that CUDA reports (`torch.cuda.mem_get_info()[1]`, the same figure as
`torch.cuda.get_device_properties().total_memory`), not the datasheet figure, and multiplies it by
`gpu_memory_utilization`. So each preset stores what CUDA reports where we could verify it, and
keeps the datasheet figure beside it for reference. `--gpu-mem-gib` overrides any preset.
"""

from __future__ import annotations

import dataclasses

from mla_eval.errors import UserError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuPreset:
    """One GPU model. `memory_bytes` is the per-GPU total used by the capacity arithmetic."""

    name: str
    title: str
    memory_bytes: int
    datasheet: str
    verified: bool  # True: memory_bytes is what CUDA was seen to report; False: datasheet figure only
    source: str

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def _gib(value: float) -> int:
    return int(round(value * GIB))


GPU_PRESETS: tuple[GpuPreset, ...] = (
    GpuPreset(
        name="h100",
        title="H100 SXM 80GB",
        memory_bytes=_gib(79.19),
        datasheet="80 GB HBM3",
        verified=True,
        source=(
            "79.19 GiB is the total PyTorch/CUDA reports for 'NVIDIA H100 80GB HBM3' (quoted in many "
            "torch OOM messages, e.g. 'GPU 0 has a total capacity of 79.19 GiB'); nvidia-smi shows "
            "81559 MiB (modal-labs/modal-client PR #2797). Rounded to 0.01 GiB."
        ),
    ),
    GpuPreset(
        name="h200",
        title="H200 SXM 141GB",
        memory_bytes=150_109_880_320,
        datasheet="141 GB HBM3e",
        verified=True,
        source=(
            "Measured on this project's H200 device: torch.cuda.get_device_properties(0).total_memory = "
            "150109880320 B (139.80 GiB); nvidia-smi total 143771 MiB of which 616 MiB reserved."
        ),
    ),
    GpuPreset(
        name="b200",
        title="B200 (HGX) 180GB",
        memory_bytes=_gib(178.35),
        datasheet="180 GB HBM3e per GPU in HGX B200 (the B200 package is marketed as up to 192 GB)",
        verified=True,
        source=(
            "178.35 GiB = cudaDeviceProp.totalGlobalMem printed for 'NVIDIA B200' in pytorch/ao PR #4002; "
            "nvidia-smi reports about 179 GB (docs.vultr.com HGX B200 hardware overview). The 180 GB "
            "datasheet figure comes from secondary sources, not from NVIDIA's datasheet itself."
        ),
    ),
    GpuPreset(
        name="b300",
        title="B300 (Blackwell Ultra) 288GB",
        memory_bytes=288_000_000_000,
        datasheet="288 GB HBM3e",
        verified=False,
        source=(
            "UNVERIFIED: 288 GB HBM3e is the announced capacity (secondary sources, e.g. "
            "glennklockwood.com/garden/processors/B300); we found no record of what CUDA reports, so this "
            "preset uses 288e9 bytes (268.2 GiB). Pass --gpu-mem-gib with torch.cuda.mem_get_info()[1] / 2**30 "
            "from a real B300 for an exact figure."
        ),
    ),
    GpuPreset(
        name="rtx-pro-6000",
        title="RTX PRO 6000 Blackwell 96GB",
        memory_bytes=_gib(94.97),
        datasheet="96 GB GDDR7",
        verified=True,
        source=(
            "94.97 GiB total as reported through CUDA on an RTX PRO 6000 Blackwell Workstation "
            "(antirez/ds4 issue #431: 'total=94.97 GiB'; nvidia-smi 97887 MiB). Rounded to 0.01 GiB."
        ),
    ),
)

_ALIASES = {
    "h100-80gb": "h100",
    "h200-141gb": "h200",
    "b200-180gb": "b200",
    "b300-288gb": "b300",
    "rtx-pro-6000-96gb": "rtx-pro-6000",
    "rtxpro6000": "rtx-pro-6000",
    "rtx6000pro": "rtx-pro-6000",
}


def gpu_names() -> list[str]:
    return [g.name for g in GPU_PRESETS]


def get_gpu(name: str) -> GpuPreset:
    """Look a GPU preset up by name (case-insensitive; '_' and ' ' read as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    for gpu in GPU_PRESETS:
        if gpu.name == key:
            return gpu
    raise UserError(f"unknown GPU {name!r}; choose one of: {', '.join(gpu_names())}, or give --gpu-mem-gib")
