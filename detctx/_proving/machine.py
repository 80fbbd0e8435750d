"""What differs between two machines besides versions: the torch build, the CPU, and this
process's threads, oneDNN and attention-kernel switches.

Two runs of one program on two machines part in their last bits from the first op
when they take other kernels: oneDNN picks its kernels by the CPU's instruction
set (AVX2, AVX-512, AMX), a reduction splits its work by the thread count, and
scaled-dot-product attention takes the flash, memory-efficient, cuDNN or math
kernel among those switched on and available. ``torch.version.cuda`` is the CUDA
torch was built with, also on a machine without a GPU: it is reported with the
build, never as a device.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any, Final

import torch

__all__ = ["build_info", "cpu_info", "process_switches"]

ISA_FLAGS: Final = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    # Arm ("Features" in /proc/cpuinfo)
    "asimd",
    "asimdhp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)
"""The CPU features that choose a kernel in oneDNN, MKL or ATen's vectorised code (the
x86 names Linux prints, and Arm's); the rest of ``/proc/cpuinfo``'s flags do not."""

_SDPA: Final = ("flash", "mem_efficient", "cudnn", "math")
_CPUINFO: Final = Path("/proc/cpuinfo")


def build_info() -> dict[str, Any]:
    """What this torch was built with: CUDA, ROCm and cuDNN versions, oneDNN, MKL, OpenMP
    and the flash-attention kernels; the same on a machine with or without a device."""
    backends = torch.backends
    build: dict[str, Any] = {
        "torch.version.cuda": torch.version.cuda,
        "torch.version.hip": getattr(torch.version, "hip", None),
        "torch.backends.cudnn.version": (
            _asked(backends.cudnn, "version") if _asked(backends.cudnn, "is_available") else None
        ),
        "oneDNN": _onednn_version(),
        "torch.backends.mkldnn.is_available": _asked(backends.mkldnn, "is_available"),
        "torch.backends.mkl.is_available": _asked(backends.mkl, "is_available"),
        "torch.backends.openmp.is_available": _asked(backends.openmp, "is_available"),
    }
    flash = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if flash is not None:
        build["torch.backends.cuda.is_flash_attention_available"] = bool(flash())
    return build


def cpu_info() -> dict[str, Any]:
    """The CPU: its model, logical cores, the vector code torch's kernels take
    (``torch.backends.cpu.get_cpu_capability()``) and the :data:`ISA_FLAGS` it has."""
    fields = _cpuinfo_fields()
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "logical cores": os.cpu_count(),
        "torch.backends.cpu.get_cpu_capability": capability() if capability else None,
        "ISA flags": " ".join(flag for flag in ISA_FLAGS if flag in flags)
        if fields
        else "not read (no /proc/cpuinfo)",
    }


def process_switches() -> dict[str, Any]:
    """This process's switches that choose kernels: threads, oneDNN, cuDNN, the SDPA
    kernels switched on, reduced-precision reductions (TF32 is with the determinism
    flags)."""
    cuda = torch.backends.cuda
    switches: dict[str, Any] = {
        "torch.get_num_threads": torch.get_num_threads(),
        "torch.get_num_interop_threads": torch.get_num_interop_threads(),
        "torch.backends.mkldnn.enabled": bool(torch.backends.mkldnn.enabled),
        "torch.backends.cudnn.enabled": bool(torch.backends.cudnn.enabled),
    }
    for kernel in _SDPA:
        enabled = getattr(cuda, f"{kernel}_sdp_enabled", None)
        if enabled is not None:  # torch 2.1 has no cuDNN attention
            switches[f"torch.backends.cuda.{kernel}_sdp_enabled"] = bool(enabled())
    for precision in ("fp16", "bf16"):
        name = f"allow_{precision}_reduced_precision_reduction"
        if hasattr(cuda.matmul, name):
            switches[f"torch.backends.cuda.matmul.{name}"] = bool(getattr(cuda.matmul, name))
    return switches


def _asked(holder: object, name: str) -> Any:
    """``holder.name()``: torch's availability checks are untyped, and a release may lack one."""
    function = getattr(holder, name, None)
    return function() if function is not None else None


def _onednn_version() -> str | None:
    """oneDNN's version as torch reports it (``Intel(R) MKL-DNN v3.12.0``), or ``None``."""
    try:
        info = torch.__config__.parallel_info()
    except Exception:  # a build without it: nothing to report
        return None
    match = re.search(r"(?:MKL-DNN|oneDNN)\D*v?(\d+(?:\.\d+)+)", info)
    return match.group(1) if match else None


def _cpuinfo_fields() -> dict[str, str]:
    """The first value of each field of ``/proc/cpuinfo`` (its first processor), or ``{}``
    where there is none (macOS, Windows)."""
    try:
        text = _CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon:
            fields.setdefault(name.strip(), value.strip())
    return fields
