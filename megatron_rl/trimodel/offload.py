"""Host-memory residency of a frozen model copy (the reference or the old policy).

Between micro-steps the copy's parameters point at host tensors (pinned when the compute
device is an accelerator); ``onload`` gives each parameter a device copy for one
micro-step, ``release`` points it back at the host tensor. The copy is frozen, so the host
tensor stays authoritative and release copies nothing back; writes between micro-steps
(``TriModel.refresh_old``) land in host memory. Parameter objects keep their identity, so
module references stay valid. On a CPU-only run host and device coincide and both calls
move nothing (the bookkeeping still runs).

Between the host and a PrivateUse1 device (an Ascend NPU, the emulated accelerator) torch
refuses ``param.data = tensor`` ("incompatible tensor type"); there the parameter's contents
are swapped instead (``torch.utils.swap_tensors``), keeping the object and its attributes.
"""

from __future__ import annotations

import torch


def _on_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = t.detach().to("cpu", copy=t.device.type != "cpu")
    return host.pin_memory() if pin else host


def _point(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """``param.data = tensor``, also across host and a PrivateUse1 device (module doc)."""
    if torch._has_compatible_shallow_copy_type(param, tensor):
        param.data = tensor
        return
    attributes = dict(param.__dict__)  # megatron's tensor_model_parallel, shared, ...
    torch.utils.swap_tensors(param, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)


class HostOffload:
    """Keep ``module``'s parameters in host memory; move them to ``device`` per micro-step."""

    def __init__(self, module: torch.nn.Module, *, device: torch.device) -> None:
        self.device = torch.device(device)
        self._params = list(module.parameters())
        pin = self.device.type != "cpu"  # page-locked host memory for the per-micro-step copies
        self._host = [_on_host(p, pin) for p in self._params]
        for p, h in zip(self._params, self._host, strict=True):
            _point(p, h)
        self.on_device = False
        self.bytes_onloaded = 0  # cumulative host -> device traffic, for metrics

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self._host)

    def onload(self) -> None:
        """Give every parameter a copy on ``self.device`` (no-op copy when that is the host)."""
        assert not self.on_device, "onload twice without release"
        if self.device.type != "cpu":
            for p, h in zip(self._params, self._host, strict=True):
                _point(p, h.to(self.device, non_blocking=True))
            self.bytes_onloaded += self.nbytes
        self.on_device = True

    def release(self) -> None:
        """Point every parameter back at its host tensor; the device copies are freed."""
        for p, h in zip(self._params, self._host, strict=True):
            _point(p, h)
        self.on_device = False
