"""The emulated accelerator in one process: device tensors, zero-copy views, CUDA's device rule,
autograd + AdamW equal to the CPU, and the host<->device copy counter."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.platform import emulated
from megatron_rl.platform.device import detect_platform

DEV = "emulated:0"  # a string: torch.device("emulated") parses only once the backend is loaded


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    emulated.load()


def test_device_tensors_report_emulated():
    x = torch.ones(2, 3, device="emulated")
    assert x.device == torch.device(DEV) and x.device.type == "emulated" and x.is_emulated
    assert torch.emulated.device_count() >= 2 and torch.emulated.is_available()
    assert torch.empty(1, device="emulated:1").device == torch.device("emulated:1")
    assert torch.emulated.memory_allocated(0) >= x.nbytes
    assert (x * 2).sum().item() == 12.0


def test_views_share_device_storage():
    x = torch.arange(12.0).to(DEV)
    view = x.view(3, 4)[1]
    view.fill_(-1.0)
    assert x.data_ptr() != 0 and view.data_ptr() == x.data_ptr() + 4 * x.element_size()
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0, 8.0, 9.0, 10.0, 11.0]
    t = x.view(3, 4).t()  # a strided view through the CPU fallback
    assert t.device == torch.device(DEV) and t.stride() == (1, 4) and torch.equal(t.cpu(), x.cpu().view(3, 4).t())
    x.resize_(20)
    assert x.shape == (20,) and x[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "op",
    [
        lambda d, h: d + h,
        lambda d, h: torch.mm(d.view(2, 2), h.view(2, 2)),
        lambda d, h: torch.cat([d, h]),
        lambda d, h: d.index_select(0, h.long()),
        lambda d, h: d.copy_(h) + h,
    ],
)
def test_host_tensor_in_device_op_raises_like_cuda(op):
    d, h = torch.ones(4, device=DEV), torch.zeros(4)
    with pytest.raises(
        RuntimeError,
        match=r"Expected all tensors to be on the same device, but found at least "
        r"two devices, emulated:0 and cpu!",
    ):
        op(d, h)


def test_mixed_device_indices_raise():
    with pytest.raises(RuntimeError, match=r"emulated:0 and emulated:1!"):
        torch.mm(torch.ones(2, 2, device="emulated:0"), torch.ones(2, 2, device="emulated:1"))


def test_what_cuda_allows_is_allowed():
    d = torch.arange(6.0, device=DEV)
    assert torch.equal((d * torch.tensor(2.0)).cpu(), torch.arange(6.0) * 2)  # 0-dim host scalar
    assert torch.where(d > 2, d, torch.tensor(0.0)).device == torch.device(DEV)
    assert d[torch.tensor([0, 5])].cpu().tolist() == [0.0, 5.0]  # host indices
    d[torch.tensor([1])] = 7.0
    assert d[1].item() == 7.0
    assert d.to("cpu").device.type == "cpu" and torch.zeros(3).to(DEV).is_emulated


def _linear_adamw_step(device: str) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    # one implementation on both (torch picks foreach for accelerators, single-tensor on the CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x = torch.randn(5, 8).to(device)
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3, 0], device=device))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return (loss.detach().cpu(), *(p.detach().cpu() for p in model.parameters()))


def test_autograd_and_adamw_equal_the_cpu():
    on_device, on_cpu = _linear_adamw_step(DEV), _linear_adamw_step("cpu")
    for a, b in zip(on_device, on_cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_random_ops_use_the_cpu_generator():
    torch.manual_seed(3)
    a = torch.randn(4, device=DEV)
    torch.manual_seed(3)
    assert torch.equal(a.cpu(), torch.randn(4))


def test_transfer_counter_counts_copies_and_scalar_reads():
    x = torch.arange(4.0)
    emulated.reset_transfer_counts()
    d = x.to(DEV)  # h2d, 16 bytes
    y = (d * 2).sum()  # device only
    assert emulated.transfer_counts() == emulated.TransferCounts(h2d=1, d2h=0, h2d_bytes=16, d2h_bytes=0)
    before = emulated.transfer_counts()
    y.item()  # d2h sync, 4 bytes
    d.cpu()  # d2h, 16 bytes
    assert emulated.transfer_counts() - before == emulated.TransferCounts(h2d=0, d2h=2, h2d_bytes=0, d2h_bytes=20)
    emulated.reset_transfer_counts()
    assert emulated.transfer_counts() == emulated.TransferCounts()


def test_env_override_wins_over_the_requested_platform(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_PLATFORM", "emulated")
    plat = detect_platform("cpu")
    assert (plat.device_type, plat.dist_backend, str(plat.device)) == ("emulated", "eccl", "emulated:0")
    monkeypatch.setenv("MEGATRON_RL_PLATFORM", "tpu")
    with pytest.raises(ValueError, match="MEGATRON_RL_PLATFORM='tpu'"):
        detect_platform("cpu")


def test_step_metrics_report_transfers_per_step():
    from megatron_rl.trainer.metrics import transfer_metrics

    transfer_metrics()  # the baseline
    torch.ones(2).to(DEV).sum().item()
    metrics = transfer_metrics()
    assert (metrics["transfers/h2d"], metrics["transfers/d2h"], metrics["transfers/d2h_bytes"]) == (1.0, 1.0, 4.0)
    assert transfer_metrics()["transfers/h2d"] == 0.0
