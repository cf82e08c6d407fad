"""CUDA tensor-type names and ``Tensor.cuda()`` inside the few megatron-core functions that need them.

Why: megatron-core 0.16 recognises parameters by ``tensor.type()`` strings
(``'torch.cuda.FloatTensor'`` ...) when building optimizer parameter groups and when clipping
gradients, and moves the tied embedding to the device with ``weight.data.cuda()`` in
``LanguageModule.setup_embeddings_and_output_layer`` (PP > 1, tied embeddings; on the emulated
device the stage is moved there first: ``cpu_param.data = device_tensor`` is refused for a
PrivateUse1 device, see ``platform/placement.py``). On CPU those strings read
``'torch.FloatTensor'`` (``'torch.emulated.FloatTensor'`` on the emulated device) and
``.cuda()`` raises.

How: only while one of the listed functions runs, ``Tensor.type()`` (no arguments) reports
the CUDA name of a CPU / emulated tensor's type and ``Tensor.cuda()`` moves the tensor to the
target device of ``cpu_torch_proxy`` (on CPU: returns it). The functions are wrapped where
they are defined and rebound where they were imported by name. These run at set-up and once
per optimizer step, never per op.

Versions: megatron-core 0.16.x. Delete with the CPU adaptor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

from megatron_rl.platform.patches.cpu_torch_proxy import target_device
from megatron_rl.platform.placement import to_device_

_LOCK = threading.RLock()
_ORIG_TYPE = torch.Tensor.type
_ORIG_CUDA = torch.Tensor.cuda

# (module, attribute path) of each function to wrap, and modules that import it by name.
_TARGETS = (
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", ("megatron.core.optimizer.optimizer",)),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups", ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__", ()),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        (),
    ),
)


def _cuda_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type in ("cpu", "emulated"):
        return _ORIG_TYPE(self).replace("torch.emulated.", "torch.", 1).replace("torch.", "torch.cuda.", 1)
    return _ORIG_TYPE(self, dtype, non_blocking, **kwargs)


def _cuda_to_target(self, device=None, non_blocking=False, **kwargs):
    return self.to(target_device(), non_blocking=non_blocking)


@contextlib.contextmanager
def cuda_tensor_api_on_cpu():
    """Within the block, CPU / emulated tensors report CUDA type names and ``.cuda()`` moves a tensor
    to the target device (on CPU: keeps it)."""
    with _LOCK:
        torch.Tensor.type, torch.Tensor.cuda = _cuda_type, _cuda_to_target
        try:
            yield
        finally:
            torch.Tensor.type, torch.Tensor.cuda = _ORIG_TYPE, _ORIG_CUDA


def _wrap(fn):
    if getattr(fn, "_megatron_rl_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if fn.__name__ == "setup_embeddings_and_output_layer" and target_device().type != "cpu":
            # It runs `weight.data = weight.data.cuda()` on a CPU-initialised weight, which torch
            # refuses for a PrivateUse1 device: move the module first (kept parameters, as on CUDA).
            to_device_(args[0], target_device())
        with cuda_tensor_api_on_cpu():
            return fn(*args, **kwargs)

    wrapped._megatron_rl_wrapped = True
    return wrapped


def apply() -> None:
    """Wrap the target functions (idempotent)."""
    for module_name, path, importers in _TARGETS:
        module = importlib.import_module(module_name)
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        raw = owner.__dict__[attr]
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(_wrap(raw.__func__)))
        else:
            setattr(owner, attr, _wrap(raw))
        for importer in importers:
            setattr(importlib.import_module(importer), attr, getattr(owner, attr))
