"""CUDA tensor-type names and ``Tensor.cuda()`` inside the few megatron-core functions that need
them, on every device that is not CUDA: the CPU, the emulated device and Ascend NPUs.

Why: megatron-core 0.16 recognises parameters by ``tensor.type()`` strings
(``'torch.cuda.FloatTensor'`` ...) when building optimizer parameter groups (the bf16 and the
distributed optimizer raise on any other name) and when clipping gradients (``clip_grads.py``
asserts ``'torch.cuda.FloatTensor'`` every step), and moves the tied embedding to the device with
``weight.data.cuda()`` in ``LanguageModule.setup_embeddings_and_output_layer`` (PP > 1, tied
embeddings). Those names read ``'torch.FloatTensor'`` on the CPU, ``'torch.emulated.FloatTensor'``
on the emulated device and ``'torch.npu.FloatTensor'`` on an NPU: torch_npu's ``transfer_to_npu``
patches ``is_cuda``, ``.cuda()`` and ``torch.cuda.*`` but not ``Tensor.type``, so a 910B run
stops building its optimizer. MindSpeed's ``type_wrapper`` renames them process-wide, but
MindSpeed is optional and pinned to other megatron-core versions. On a PrivateUse1 device (the
emulated device, an NPU) torch also refuses ``cpu_param.data = device_tensor`` (see
``platform/placement.py``), so the tied embedding's stage is moved to the device first.

How: only while one of the listed functions runs, ``Tensor.type()`` (no arguments) reports the
CUDA name of a tensor's type (``torch.<device>.X`` or ``torch.X`` -> ``torch.cuda.X``), and
``Tensor.cuda()`` moves a tensor to this rank's compute device. The functions are wrapped where
they are defined and rebound where they were imported by name. They run at set-up and once per
optimizer step, never per op.

Versions: megatron-core 0.16.x. Delete when megatron-core stops comparing type strings.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

from megatron_rl.platform.placement import to_device_

_LOCK = threading.RLock()
_TARGET = {"device": torch.device("cpu")}
_DEVICE_PREFIXES = ("torch.emulated.", "torch.npu.")

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


def cuda_type_name(name: str) -> str:
    """The CUDA spelling of a tensor type name: ``torch.npu.FloatTensor`` / ``torch.emulated.
    FloatTensor`` / ``torch.FloatTensor`` -> ``torch.cuda.FloatTensor`` (CUDA names unchanged)."""
    if name.startswith("torch.cuda."):
        return name
    for prefix in _DEVICE_PREFIXES:
        if name.startswith(prefix):
            return "torch.cuda." + name[len(prefix) :]
    return name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def cuda_tensor_api():
    """Within the block, ``Tensor.type()`` reports CUDA type names and ``.cuda()`` moves a tensor to
    this rank's compute device (on the CPU: keeps it)."""
    with _LOCK:
        device_type, device_cuda = torch.Tensor.type, torch.Tensor.cuda  # as the platform left them

        def type_(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None and not kwargs:
                return cuda_type_name(device_type(self))
            return device_type(self, dtype, non_blocking, **kwargs)

        def cuda(self, device=None, non_blocking=False, **kwargs):
            return self.to(_TARGET["device"], non_blocking=non_blocking)

        torch.Tensor.type, torch.Tensor.cuda = type_, cuda
        try:
            yield
        finally:
            torch.Tensor.type, torch.Tensor.cuda = device_type, device_cuda


def _wrap(fn):
    if getattr(fn, "_megatron_rl_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if fn.__name__ == "setup_embeddings_and_output_layer" and _TARGET["device"].type != "cpu":
            # It runs `weight.data = weight.data.cuda()` on a CPU-initialised weight, which torch
            # refuses for a PrivateUse1 device: move the module first (kept parameters, as on CUDA).
            to_device_(args[0], _TARGET["device"])
        with cuda_tensor_api():
            return fn(*args, **kwargs)

    wrapped._megatron_rl_wrapped = True
    return wrapped


def apply(device: torch.device | str) -> None:
    """Wrap the target functions (idempotent); ``.cuda()`` inside them moves to ``device``."""
    _TARGET["device"] = torch.device(device)
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
