"""What a reproducibility-minded user needs to know about this environment.

:func:`diagnose` gathers versions, accelerators, the determinism flags of
this process and the determinism environment variables, and turns them into
warnings with what to do about each. ``detctx doctor`` prints it; calling it
inside a training script shows that script's own flags.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import torch

from detctx._basics import MAX_SEED, SEED_ENV, parse_seed
from detctx._environment import WATCHED, EnvSwitch, env_switches, inductor
from detctx._proving.machine import build_info, cpu_info, process_switches
from detctx._sources import active_accelerators
from detctx._switches import describe_npu_level

__all__ = ["ENV_VARIABLES", "SECTIONS", "Diagnosis", "advise", "diagnose"]

SECTIONS: Final = ("versions", "build", "devices", "cpu", "flags", "environment", "warnings")
"""The report's parts, in the order ``--json`` prints them."""

ENV_VARIABLES: Final = (
    SEED_ENV,
    *(switch.variable for switch in env_switches()),
    inductor.VARIABLE,
    *WATCHED.variables,
    "HCCL_LOGIC_SUPERPOD_ID",
    "NCCL_ALGO",
    "NCCL_NVLS_ENABLE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "TORCH_MKLDNN_MATMUL_MIN_DIM",
)
"""The environment variables the report shows."""

_ENV_SWITCHES: Final = {switch.name: switch for switch in env_switches()}
_HASH_SEED: Final = _ENV_SWITCHES["hash_seed"]
_CUBLAS: Final = _ENV_SWITCHES["cublas_workspace"]
_HCCL: Final = _ENV_SWITCHES["hccl"]


@dataclass
class Diagnosis:
    """The report: plain data (``as_dict()`` is what ``--json`` prints)."""

    versions: dict[str, str]
    devices: list[dict[str, Any]]
    flags: dict[str, Any]
    environment: dict[str, str | None]
    warnings: list[str] = field(default_factory=list)
    build: dict[str, Any] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        report = asdict(self)
        return {key: report[key] for key in SECTIONS}

    def format(self) -> str:
        """The human-readable report."""
        out = ["versions"]
        out += [f"  {name:<12} {value}" for name, value in self.versions.items()]
        if self.build:
            out.append("build (what torch was compiled with, not the devices this machine has)")
            out += _rows(self.build)
        out.append("devices")
        if not self.devices:
            cuda = self.build.get("torch.version.cuda")
            built = f"; the build's CUDA {cuda} is not a device" if cuda else ""
            out.append(f"  CPU only (no accelerator available{built})")
        for device in self.devices:
            state = "initialised" if device["initialised"] else "not initialised"
            names = ", ".join(device.get("names", [])) or "names not read"
            out.append(f"  {device['type']:<12} {device['count']} device(s), {state} ({names})")
            if device.get("capabilities"):
                out.append(f"  {'':<12} compute capability {', '.join(device['capabilities'])}")
        if self.cpu:
            out.append("cpu")
            out += _rows(self.cpu)
        out.append("flags (this process)")
        out += _rows(self.flags)
        out.append("environment")
        width = max(len(name) for name in self.environment)
        out += [
            f"  {name:<{width}}  {'(unset)' if value is None else value}"
            for name, value in self.environment.items()
        ]
        if self.warnings:
            out.append(f"warnings ({len(self.warnings)})")
            out += [f"  ! {text}" for text in self.warnings]
        else:
            out.append("no warnings")
        return "\n".join(out)


def diagnose(*, read_device_names: bool = False) -> Diagnosis:
    """Gather the report for this process and environment.

    Devices are never initialised unless ``read_device_names`` asks for the
    device names (reading them initialises CUDA); ``detctx doctor`` does, as
    it runs in a process of its own. Importing torch_npu, if installed, is
    attempted (as every detctx block does); a failure becomes a warning.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerators = active_accelerators()
    devices = []
    for accelerator in accelerators:
        device: dict[str, Any] = {
            "type": accelerator.device_type,
            "count": accelerator.device_count(),
            "initialised": accelerator.is_initialized(),
        }
        get_name = getattr(accelerator.module, "get_device_name", None)
        if get_name is not None and (read_device_names or device["initialised"]):
            device["names"] = [str(get_name(i)) for i in range(device["count"])]
            get_capability = getattr(accelerator.module, "get_device_capability", None)
            if get_capability is not None:
                device["capabilities"] = [
                    ".".join(map(str, get_capability(i))) for i in range(device["count"])
                ]
        devices.append(device)
    environment = {name: os.environ.get(name) for name in ENV_VARIABLES}
    diagnosis = Diagnosis(
        _versions(), devices, _flags(), environment, build=build_info(), cpu=cpu_info()
    )
    diagnosis.warnings = [str(w.message) for w in caught] + advise(
        diagnosis, torch_npu_installed=importlib.util.find_spec("torch_npu") is not None
    )
    return diagnosis


def _rows(values: Mapping[str, Any]) -> list[str]:
    width = max(len(name) for name in values)
    return [f"  {name:<{width}}  {value}" for name, value in values.items()]


def advise(diagnosis: Diagnosis, *, torch_npu_installed: bool = False) -> list[str]:
    """The warnings a report calls for, each saying what to do."""
    env: Mapping[str, str | None] = diagnosis.environment
    types = {device["type"]: device for device in diagnosis.devices}
    advice = []
    hash_seed = env.get(_HASH_SEED.variable)
    if hash_seed is None or hash_seed.strip() in ("", "random"):
        advice.append(
            f"hash randomisation is on ({_HASH_SEED.variable} unset): iteration over sets of "
            f"strings changes from run to run; export {_export(_HASH_SEED)} (or any fixed value) "
            "before launch (detctx run does)"
        )
    misspelt = _misspelt(env)
    advice += misspelt.values()
    # Compared as written: torch's check of the variable is exact (aten Context.cpp,
    # checkCuBLASConfigDeterministic).
    cublas = env.get(_CUBLAS.variable)
    if "cuda" in types and cublas not in _CUBLAS.on_values and _CUBLAS.name not in misspelt:
        advice.append(
            f"{_CUBLAS.variable} is not {_either(_CUBLAS.on_values)}: cuBLAS matmuls are not "
            f"deterministic; export {_export(_CUBLAS)} before launch (it is read when the first "
            "cuBLAS handle is created)"
        )
    if "cuda" in types and types["cuda"]["count"] > 1 and env.get("NCCL_NVLS_ENABLE") != "0":
        advice.append(
            "NCCL may pick NVLS reductions, which are not deterministic: export "
            "NCCL_NVLS_ENABLE=0 (and NCCL_ALGO=Ring to pin the algorithm)"
        )
    hccl = env.get(_HCCL.variable)
    if hccl is not None and hccl.strip().lower() not in _HCCL.accepted_values:
        advice.append(
            f"{_HCCL.variable}={hccl} is not a value torch_npu accepts "
            f"({_either(_HCCL.accepted_values)}) and is ignored: export {_export(_HCCL)}"
        )
    elif ("npu" in types or torch_npu_installed) and (
        hccl is None or hccl.strip().lower() not in _HCCL.on_values
    ):
        advice.append(
            f"{_HCCL.variable} is unset or {_HCCL.off}: HCCL reductions are not deterministic; "
            f"export {_export(_HCCL)} before launch (read once, when the first communicator is "
            "created)"
        )
    if env.get("HCCL_LOGIC_SUPERPOD_ID"):
        advice.append(
            "HCCL_LOGIC_SUPERPOD_ID is set: with RoCE links, collective results depend on the "
            "cluster topology, so compare runs only on the same topology"
        )
    if diagnosis.flags.get("torch.backends.cudnn.benchmark"):
        advice.append(
            "cuDNN benchmark is on: it picks convolution algorithms by timing, which varies "
            "run to run; set torch.backends.cudnn.benchmark = False (deterministic() does)"
        )
    seed = env.get(SEED_ENV)
    if seed is not None and seed.strip():
        try:
            parse_seed(seed, SEED_ENV)
        except ValueError:
            advice.append(
                f"{SEED_ENV}={seed} is not a seed in [0, {MAX_SEED}]: deterministic(seed=None) "
                "will raise; set it to such an integer or unset it"
            )
    return advice


def _misspelt(env: Mapping[str, str | None]) -> dict[str, str]:
    """Advice for each switch variable set to an accepted value but for whitespace or
    letter case, by switch name: the block and ``detctx run`` write the exact value
    (:meth:`EnvSwitch.spelling`), a process launched with this environment reads it
    as written."""
    advice = {}
    for switch in env_switches():
        value = env.get(switch.variable)
        if value is None:
            continue
        exact = switch.spelling(value, switch.target(setting=True, seed=0, current=None) or "")
        if exact is not None and exact != value:
            advice[switch.name] = (
                f"{switch.variable}={value!r} differs from {exact!r} by whitespace or letter "
                "case, which its reader need not ignore (torch compares CUBLAS_WORKSPACE_CONFIG "
                f"as written); detctx blocks and detctx run set {exact!r} for their duration, "
                f"but export {switch.variable}={exact} before launch"
            )
    return advice


def _export(switch: EnvSwitch) -> str:
    """``VARIABLE=value``: what a block with seed 0 would set."""
    return f"{switch.variable}={switch.target(setting=True, seed=0, current=None)}"


def _either(values: frozenset[str]) -> str:
    ordered = sorted(values)
    return ", ".join(ordered[:-1]) + f" or {ordered[-1]}" if len(ordered) > 1 else ordered[0]


def _versions() -> dict[str, str]:
    from detctx._version import __version__

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_npu": _torch_npu_version(),
        "detctx": __version__,
    }
    return versions


def _torch_npu_version() -> str:
    module = sys.modules.get("torch_npu")
    if module is not None:
        return str(getattr(module, "__version__", "imported"))
    if importlib.util.find_spec("torch_npu") is None:
        return "not installed"
    try:
        return f"{importlib.metadata.version('torch_npu')} (installed, not importable)"
    except importlib.metadata.PackageNotFoundError:
        return "installed, not importable"


def _flags() -> dict[str, Any]:
    cudnn = torch.backends.cudnn
    flags: dict[str, Any] = {
        "torch.are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled(),
        "torch.is_deterministic_algorithms_warn_only_enabled": (
            torch.is_deterministic_algorithms_warn_only_enabled()
        ),
        "torch.backends.cudnn.deterministic": bool(cudnn.deterministic),
        "torch.backends.cudnn.benchmark": bool(cudnn.benchmark),
        "torch.backends.cudnn.allow_tf32": bool(cudnn.allow_tf32),
        "torch.backends.cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "torch.get_float32_matmul_precision": torch.get_float32_matmul_precision(),
        **process_switches(),
    }
    utils_det = getattr(torch.utils, "deterministic", None)
    if hasattr(utils_det, "fill_uninitialized_memory"):
        flags["torch.utils.deterministic.fill_uninitialized_memory"] = bool(
            utils_det.fill_uninitialized_memory  # type: ignore[union-attr]
        )
    level = describe_npu_level()
    if level is not None:
        flags["torch_npu.npu._get_deterministic_level"] = level
    npu = getattr(torch, "npu", None)
    for part in ("matmul", "conv"):
        holder = getattr(npu, part, None)
        if holder is not None and hasattr(holder, "allow_hf32"):
            flags[f"torch.npu.{part}.allow_hf32"] = bool(holder.allow_hf32)
    return flags
