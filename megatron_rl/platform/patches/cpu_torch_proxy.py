"""Give every ``megatron.core`` module a view of ``torch`` whose CUDA-only entry points run on the
host device: the CPU, or under the ``emulated`` platform this rank's ``emulated:<local_rank>``.

Why: megatron-core 0.16 calls ``torch.cuda.current_device()`` (~175 sites), builds tensors with
``device="cuda"`` (~60 sites: causal masks, schedule token counters, p2p shape buffers) and
calls ``torch.cuda.synchronize()`` / ``torch.cuda.get_rng_state()``; on a CPU-only torch build
each of those raises "Torch not compiled with CUDA enabled".

How: the global name ``torch`` inside each ``megatron.core.*`` module is replaced by a proxy
module. Attribute reads are forwarded to the real torch and cached on the proxy, so after the
first access there is no per-call overhead; only tensor factories (device argument mapped
from cuda to the target device) and ``torch.cuda`` (a stand-in whose current device is the
target) differ. Nothing outside megatron.core sees a change, and the real ``torch`` module is
untouched. Modules imported later are patched by an import hook. ``set_target`` picks the
device (``apply_cpu_patches`` does, once per process).

Versions: megatron-core 0.16.x with torch 2.13 CPU builds. Delete when megatron-core gains a
device abstraction (or when CPU runs go through a real accelerator plugin).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types

import torch

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "randn_like",
    "rand_like",
    "linspace",
)
_TARGET = {"device": torch.device("cpu")}


def set_target(device: torch.device) -> None:
    """The device that stands in for CUDA: ``cpu`` or ``emulated:<local_rank>``."""
    _TARGET["device"] = torch.device(device)


def target_device() -> torch.device:
    return _TARGET["device"]


def _on_target(device) -> object:
    """Map a cuda device spec (``"cuda"``, ``"cuda:0"``, ``torch.device('cuda')``, an int) to the target."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _TARGET["device"]
    if isinstance(device, torch.device) and device.type == "cuda":
        return _TARGET["device"]
    return device


def _redirect_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_target(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs an accelerator
        return fn(*args, **kwargs)

    return factory


class _HostStream:
    """A CUDA stream stand-in: host work is in program order, so waits and events are no-ops
    (megatron's MoE all-to-all dispatcher makes a side stream for its device-to-host copies)."""

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        return None


_CURRENT_STREAM = _HostStream()


class _CudaOnCPU(types.ModuleType):
    """``torch.cuda`` as megatron-core sees it on a CPU build: the target device is the current
    device, and the CPU generator is the device RNG (the emulated device's random ops run CPU kernels)."""

    def __init__(self):
        super().__init__("torch.cuda")

    @staticmethod
    def current_device():
        return _TARGET["device"]

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    # tensor_parallel.random._get_cuda_rng_state (activation recompute saves the device RNG state)
    random = types.SimpleNamespace(
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    )

    @staticmethod
    def manual_seed(seed):
        # torch.manual_seed would call back into torch.cuda.manual_seed_all: use the generator.
        torch.default_generator.manual_seed(int(seed))

    Stream = _HostStream

    @staticmethod
    def current_stream(device=None):
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(device=None):
        device = _TARGET["device"]
        return 0 if device.type == "cpu" else torch.emulated.memory_allocated(device)

    @staticmethod
    def max_memory_allocated(device=None):
        device = _TARGET["device"]
        return 0 if device.type == "cpu" else torch.emulated.max_memory_allocated(device)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCPU(types.ModuleType):
    """The ``torch`` module as megatron-core modules see it on CPU."""

    def __init__(self):
        super().__init__("torch")
        object.__setattr__(self, "cuda", _CudaOnCPU())

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            value = _redirect_factory(value)
        object.__setattr__(self, name, value)  # cache: later reads skip __getattr__
        return value


TORCH_ON_CPU = _TorchOnCPU()


def _patch_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = TORCH_ON_CPU


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``megatron.core`` modules imported after ``apply()``."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_module(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def apply() -> None:
    """Patch loaded megatron.core modules and install the hook for the rest."""
    import megatron.core  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            _patch_module(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
