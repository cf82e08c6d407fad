"""The emulated device's Ascend 910B profile: each rule of ``platform/emulated/profiles.py`` fires
under ``npu`` and not under ``cuda`` (fp64 device compute, HCCL's collectives, ``torch.npu.*`` type
strings), and on both the memory capacity raises ``torch.OutOfMemoryError`` and data-dependent
shapes count as host syncs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.platform import emulated
from megatron_rl.platform.emulated.profiles import PROFILES
from tests.distributed import run_distributed

DEV = "emulated:0"
FIX = "compute in float32 on the device, or in float64 on the host"


@pytest.fixture(autouse=True)
def _cuda_profile_around(monkeypatch):
    """Every test starts and ends on the default profile (the worker's other tests rely on it)."""
    monkeypatch.delenv(emulated.MEMORY_ENV, raising=False)
    emulated.set_profile("cuda")
    yield
    emulated.set_profile("cuda")


def test_profile_api_switches_and_restores():
    assert emulated.current_profile() == "cuda" and emulated.memory_capacity() == 141 * 10**9
    with emulated.profile("npu"):
        assert emulated.current_profile() == "npu" and emulated.memory_capacity() == 64 << 30
    assert emulated.current_profile() == "cuda" and torch.Tensor.type is emulated._ORIGINAL_TYPE
    with pytest.raises(ValueError, match="emulated profile 'tpu'"):
        emulated.set_profile("tpu")  # type: ignore[arg-type]


def test_every_rule_cites_a_source():
    for profile in PROFILES.values():
        for field in dataclasses.fields(profile):
            value = getattr(profile, field.name)
            rules = value if isinstance(value, tuple) else (value,)
            for rule in rules:
                if dataclasses.is_dataclass(rule):
                    assert len(rule.source) > 20, (profile.name, field.name)
    from megatron_rl.platform.emulated.__main__ import rules_table

    assert "ProcessGroupHCCL.cpp checkSupportedDataType" in rules_table("npu")  # --rules npu prints it


def test_fp64_compute_on_the_device_fails_under_npu_only():
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    d = x.to(DEV)
    torch.testing.assert_close(torch.expm1(d).cpu(), torch.expm1(x))  # cuda: fp64 computes
    with emulated.profile("npu"):
        with pytest.raises(
            RuntimeError,
            match=rf"aten::expm1: argument 'self' is a Double tensor on {DEV}, "
            rf"and the NPU .* does not compute Double; {FIX}",
        ):
            torch.expm1(d)
        with pytest.raises(RuntimeError, match=r"aten::sum.dim_IntList: its result is a Double"):
            d.float().sum(0, dtype=torch.float64)  # fp64 made on the device from fp32 inputs
        with pytest.raises(RuntimeError, match=r"aten::add_.Tensor: argument 'self' is a Double"):
            d.add_(1.0)
        torch.testing.assert_close(torch.expm1(d.float()).cpu(), torch.expm1(x).float())  # the fix


def test_fp64_storage_casts_and_views_work_under_npu():
    x = torch.arange(6, dtype=torch.float64)
    with emulated.profile("npu"):
        d = x.to(DEV)  # h2d, stored as fp64
        moved = [
            d.clone(),
            d.view(2, 3).t().contiguous(),
            torch.cat([d, d])[:6],
            torch.stack([d])[0],
            d.float().double(),
            d[1:],
            torch.zeros(6, dtype=torch.float64, device=DEV),
        ]
        assert all(t.dtype == torch.float64 and t.device == torch.device(DEV) for t in moved)
        assert torch.equal(moved[1].cpu(), x.view(2, 3).t().contiguous()) and d[2].item() == 2.0
        assert torch.equal(d.cpu(), x) and d.float().sum().item() == 15.0
        assert torch.equal(moved[-1].fill_(2.0)[:3].copy_(d[:3]).cpu(), x[:3])


def test_type_strings_read_torch_npu_under_npu():
    x, p = torch.ones(2, device=DEV), torch.nn.Parameter(torch.ones(2, device=DEV, dtype=torch.bfloat16))
    assert x.type() == "torch.emulated.FloatTensor"
    with emulated.profile("npu"):
        assert (x.type(), x.double().type(), p.type()) == (
            "torch.npu.FloatTensor",
            "torch.npu.DoubleTensor",
            "torch.npu.BFloat16Tensor",
        )
        assert torch.ones(1).type() == "torch.FloatTensor"  # host tensors unchanged
        cast = x.type(torch.float64)  # .type(dtype) still casts
        assert isinstance(cast, torch.Tensor) and cast.dtype == torch.float64
    assert x.type() == "torch.emulated.FloatTensor"


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_allocation_past_capacity_raises_out_of_memory(name):
    device = PROFILES[name].device_name
    with emulated.profile(name):
        emulated.set_memory_capacity(torch.emulated.memory_allocated(0) + (3 << 20))  # 3 MiB free
        keep = torch.empty(1 << 19, device=DEV)  # 2 MiB
        before = torch.emulated.memory_allocated(0)
        with pytest.raises(
            torch.OutOfMemoryError,
            match=rf"{device} out of memory. Tried to allocate 2.00 MiB "
            rf"\(emulated:0; .* total capacity; .* already allocated\)",
        ):
            torch.empty(1 << 19, device=DEV)
        with pytest.raises(torch.OutOfMemoryError):
            keep * 2  # an op's output counts too
        free, total = torch.emulated.mem_get_info(0)
        assert total == emulated.memory_capacity() and free == total - torch.emulated.memory_allocated(0)
        assert torch.emulated.memory_allocated(0) == before  # the failed ones left nothing counted
        emulated.set_memory_capacity(None)
        assert (keep * 2).device == torch.device(DEV)


def test_capacity_from_the_environment(monkeypatch):
    monkeypatch.setenv(emulated.MEMORY_ENV, "0.5")
    with emulated.profile("npu"):
        assert emulated.memory_capacity() == 1 << 29
    monkeypatch.setenv(emulated.MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="MEGATRON_RL_EMULATED_MEMORY_GB='lots'"):
        emulated.set_profile("npu")
    assert emulated.current_profile() == "cuda"  # unchanged by the refused value
    monkeypatch.delenv(emulated.MEMORY_ENV)


def _syncs(fn) -> emulated.TransferCounts:
    before = emulated.transfer_counts()
    fn()
    return emulated.transfer_counts() - before


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_data_dependent_shapes_count_as_host_syncs(name):
    x = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEV)
    mask, idx, reps = x > 0, torch.tensor([0, 2], device=DEV), torch.tensor([1, 2, 0, 1], device=DEV)
    with emulated.profile(name):
        for op in (
            lambda: x[mask],
            lambda: torch.nonzero(x),
            lambda: torch.unique(x),
            lambda: x.masked_select(mask),
            lambda: torch.repeat_interleave(reps),
            lambda: x.repeat_interleave(reps, dim=0),
            lambda: x.index_put_((mask,), torch.ones(2, device=DEV)),
        ):
            delta = _syncs(op)
            assert (delta.syncs, delta.d2h, delta.h2d) == (1, 1, 0)
        for op in (
            lambda: x[idx],
            lambda: x[1:],
            lambda: torch.where(mask, x, 0.0),
            lambda: torch.repeat_interleave(reps, output_size=4),
            lambda: x.masked_fill(mask, 0.0),
        ):
            assert _syncs(op) == emulated.TransferCounts()


def test_step_metrics_report_device_peak_memory_and_syncs():
    from megatron_rl.trainer.metrics import device_peak_memory_gb, transfer_metrics

    transfer_metrics()
    torch.emulated.reset_peak_memory_stats(0)
    x = torch.zeros(1 << 20, device=DEV)  # 4 MiB
    x[x > 0]
    assert transfer_metrics()["transfers/syncs"] == 1.0
    assert device_peak_memory_gb(torch.device(DEV)) >= x.nbytes / 1e9


def _hccl_rules() -> dict[str, str]:
    """Collectives under the npu profile (2 ranks): each refusal torch_npu makes, and what works."""
    import torch.distributed as dist

    emulated.load()
    rank = int(__import__("os").environ["RANK"])
    torch.emulated.set_device(rank)
    emulated.set_profile("npu")
    dist.init_process_group("eccl")
    dev = torch.device("emulated", rank)
    errors: dict[str, str] = {}
    planted = {
        "fp64_all_reduce": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64, device=dev)),
        "bool_all_reduce": lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool, device=dev)),
        "non_contiguous": lambda: dist.all_reduce(torch.ones(4, 4, device=dev).t()),
        "gather": lambda: dist.gather(
            torch.ones(2, device=dev), [torch.empty(2, device=dev)] * 2 if rank == 0 else None, dst=0
        ),
        "band": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32, device=dev), op=dist.ReduceOp.BAND),
        "fp64_reduce_scatter": lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.float64, device=dev), torch.ones(4, dtype=torch.float64, device=dev)
        ),
    }
    for name, call in planted.items():
        with pytest.raises(RuntimeError) as caught:
            call()
        errors[name] = str(caught.value)
    ok = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(ok)  # fp32: fine
    wide = torch.full((2,), rank + 0.5, dtype=torch.float64, device=dev)
    dist.broadcast(wide, src=1)  # HCCL broadcasts and gathers every mapped dtype, fp64 too
    parts = [torch.empty(2, dtype=torch.float64, device=dev) for _ in range(2)]
    dist.all_gather(parts, wide)
    assert ok.cpu().tolist() == [3.0] * 4 and torch.cat(parts).cpu().tolist() == [1.5] * 4
    emulated.set_profile("cuda")
    fp64 = torch.ones(4, dtype=torch.float64, device=dev)
    dist.all_reduce(fp64)  # NCCL-like: fine
    assert fp64.cpu().tolist() == [2.0] * 4
    dist.destroy_process_group()
    return errors


@pytest.mark.multiproc
def test_hccl_rules_fire_under_npu_and_not_under_cuda():
    errors = run_distributed(_hccl_rules, 2)[0]
    assert "HCCL allreduce: Unsupported data type at::kDouble" in errors["fp64_all_reduce"]
    assert "HCCL allreduce: Unsupported data type at::kByte/at::kBool" in errors["bool_all_reduce"]
    assert "Tensors must be contiguous" in errors["non_contiguous"]
    assert "ProcessGroupHCCL does not support gather" in errors["gather"]
    assert "Cannot use ReduceOp.BAND with HCCL" in errors["band"]
    assert "HCCL _reduce_scatter_base: Unsupported data type at::kDouble" in errors["fp64_reduce_scatter"]
