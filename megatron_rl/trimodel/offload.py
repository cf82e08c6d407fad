"""Host-memory residency of a frozen model copy (the reference or the old policy).

Between micro-steps the copy's parameters point at host tensors (pinned when the compute
device is an accelerator); ``onload`` gives each parameter a device copy for one
micro-step, ``release`` points it back at the host tensor. The copy is frozen, so the host
tensor stays authoritative and release copies nothing back; writes between micro-steps
(``TriModel.refresh_old``) land in host memory. Parameter objects keep their identity, so
module references stay valid. On a CPU-only run host and device coincide and both calls
move nothing (the bookkeeping still runs).
"""

from __future__ import annotations

import torch


def _on_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = t.detach().to("cpu", copy=t.device.type != "cpu")
    return host.pin_memory() if pin else host


class HostOffload:
    """Keep ``module``'s parameters in host memory; move them to ``device`` per micro-step."""

    def __init__(self, module: torch.nn.Module, *, device: torch.device) -> None:
        self.device = torch.device(device)
        self._params = list(module.parameters())
        pin = self.device.type != "cpu" and torch.cuda.is_available()
        self._host = [_on_host(p, pin) for p in self._params]
        for p, h in zip(self._params, self._host, strict=True):
            p.data = h
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
                p.data = h.to(self.device, non_blocking=True)
            self.bytes_onloaded += self.nbytes
        self.on_device = True

    def release(self) -> None:
        """Point every parameter back at its host tensor; the device copies are freed."""
        for p, h in zip(self._params, self._host, strict=True):
            p.data = h
        self.on_device = False
