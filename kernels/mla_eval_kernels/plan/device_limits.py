"""Where the CuTe kernels may run, and the device limits they size their tiles by (pure Python + torch).

`TESTED_ARCHS` is the one list of GPU architectures the kernels are compiled for and tested on
(`compile_check` targets sm_90a; `tests/test_kernels_gpu.py` ran on an H200). The dispatcher's
"auto" picks the kernels only there; adding an architecture means compiling and testing on it.

Shared memory is read from the device (`shared_memory_per_block_optin`: the opt-in limit of one
CTA; `shared_memory_per_multiprocessor`: what CTAs on one SM share), never assumed. The Hopper
values below are what an H200 reports (232448 and 233472 bytes); they are used only where no
device is at hand (the CPU compile check).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

TESTED_ARCHS = ("sm_90",)

HOPPER_SMEM_PER_BLOCK = 227 * 1024  # shared_memory_per_block_optin of sm_90 parts
HOPPER_SMEM_PER_SM = 228 * 1024  # shared_memory_per_multiprocessor of sm_90 parts
HOPPER_REGS_PER_SM = 65536  # 32-bit registers of one sm_90 SM (a v3 CTA has the SM to itself)


def arch_name(device) -> str:
    """'sm_90' for a compute capability (9, 0) CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def untested_arch_reason(device) -> str | None:
    """None on an architecture in TESTED_ARCHS, else the one-line reason the kernels are not used."""
    arch = arch_name(device)
    if arch in TESTED_ARCHS:
        return None
    return f"kernels are compiled and tested for {', '.join(TESTED_ARCHS)} only; this GPU is {arch}"


def smem_per_block(device) -> int:
    """Bytes of shared memory one CTA may opt into on `device`."""
    props = torch.cuda.get_device_properties(device)
    # torch builds without the opt-in field report only the 48 KB default: smaller, never wrong
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return int(optin if optin is not None else props.shared_memory_per_block)


def smem_per_sm(device) -> int:
    """Bytes of shared memory the CTAs resident on one SM of `device` share."""
    return int(torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What a launch plan needs to know of a GPU (`mla_eval_kernels.plan.launch`); hashable, part of its cache key."""

    sms: int
    smem_per_block: int
    smem_per_sm: int


# An H100 SXM or H200 (both 132 SMs and the sm_90 limits above): what launch plans are made for where no device is at
# hand (tools/compile_check, the CPU construction test)
HOPPER_FACTS = DeviceFacts(sms=132, smem_per_block=HOPPER_SMEM_PER_BLOCK, smem_per_sm=HOPPER_SMEM_PER_SM)


def device_facts(device) -> DeviceFacts:
    """The facts of a CUDA device, read once per device."""
    device = torch.device(device)
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(int(props.multi_processor_count), smem_per_block(index), smem_per_sm(index))
