"""An independent check of two Ascend 910B device rules, op by op, on any device but the CPU.

``DeviceOpRecorder`` is a ``TorchDispatchMode`` that records, while active:

- ``fp64``: every op with a float64 tensor on a non-CPU device among its arguments or results
  (CANN computes no DOUBLE on a 910B, and torch_npu's HCCL all-reduce refuses kDouble: the
  ``c10d`` collectives pass through the dispatcher too, so an fp64 all-reduce is caught here);
- ``data_dependent``: every op whose result's shape depends on the data (``nonzero``,
  ``masked_select``, ``unique``, an index or index_put with a boolean mask): on a device each
  is a hidden device -> host sync;
- ``host_reads``: every scalar read of a device tensor (``.item()``, ``bool(t)``, ``float(t)``).

It does not depend on the emulated device's own rules (``platform.emulated``), so it checks the
code against the rules even where that device's profile does not (yet) enforce them.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
DATA_DEPENDENT = frozenset(
    {
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.repeat_interleave.Tensor,
    }
)
BOOL_INDEXED = frozenset(
    {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
)
HOST_READS = frozenset({_aten._local_scalar_dense.default, _aten.is_nonzero.default})


def _on_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _bool_index(func, args) -> bool:
    """An index / index_put with a boolean mask, except the masked fill ATen turns
    ``x[mask] = scalar`` into (``canDispatchToMaskedFill``: one mask on ``x``'s device, a
    one-element host value, no accumulate), which has no data-dependent shape."""
    if func not in BOOL_INDEXED:
        return False
    masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks or func == _aten.index.Tensor:
        return bool(masks)
    value, accumulate = args[2], len(args) > 3 and bool(args[3])
    defined = [i for i in args[1] if i is not None]
    fill = (
        len(defined) == 1
        and masks[0].device == args[0].device
        and value.numel() == 1
        and value.device.type == "cpu"
        and not accumulate
    )
    return not fill


class DeviceOpRecorder(TorchDispatchMode):
    """Records the ops that break the rules above (names, in order); ``violations()`` lists them."""

    def __init__(self) -> None:
        super().__init__()
        self.fp64: list[str] = []
        self.data_dependent: list[str] = []
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run ``func``, then record it under each rule it breaks."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        tensors = [t for t in tree_leaves((args, kwargs, out)) if _on_device(t)]
        if any(t.dtype == torch.float64 for t in tensors):
            self.fp64.append(name)
        if tensors and (func in DATA_DEPENDENT or _bool_index(func, args)):
            self.data_dependent.append(name)
        if func in HOST_READS and _on_device(args[0]):
            self.host_reads.append(name)
        return out

    def violations(self, *, host_reads: bool = True) -> dict[str, list[str]]:
        """The rules broken, each with the ops that broke it (empty when none)."""
        found = {"fp64 on the device": self.fp64, "data-dependent shape": self.data_dependent}
        if host_reads:
            found["host read"] = self.host_reads
        return {rule: ops for rule, ops in found.items() if ops}
