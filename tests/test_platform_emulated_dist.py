"""The emulated accelerator across ranks: ``eccl`` collectives on device tensors equal gloo's on host
tensors and refuse host tensors (as NCCL / HCCL do); megatron-core at TP=2 on it equals the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed


def _collectives() -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from megatron_rl.platform import setup_platform

    plat = setup_platform("emulated")
    dist.init_process_group(plat.dist_backend)
    gloo = dist.new_group(backend="gloo")  # the reference: the same collectives on host tensors
    rank, dev = dist.get_rank(), plat.device
    assert dev == torch.device("emulated", rank)
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    out: dict[str, torch.Tensor] = {}

    def check(name, device_result, host_result):
        assert device_result.device == dev, (name, device_result.device)
        assert torch.equal(device_result.cpu(), host_result), name
        out[name] = host_result

    d, h = x.to(dev), x.clone()
    dist.all_reduce(d)
    dist.all_reduce(h, group=gloo)
    check("all_reduce", d, h)
    d, h = torch.empty(16, device=dev), torch.empty(16)
    dist.all_gather_into_tensor(d, x.to(dev))
    dist.all_gather_into_tensor(h, x, group=gloo)
    check("all_gather_into_tensor", d, h)
    d, h = torch.empty(4, device=dev), torch.empty(4)
    dist.reduce_scatter_tensor(d, x.to(dev))
    dist.reduce_scatter_tensor(h, x, group=gloo)
    check("reduce_scatter_tensor", d, h)
    d, h = x.to(dev), x.clone()
    dist.broadcast(d, src=1)
    dist.broadcast(h, src=1, group=gloo)
    check("broadcast", d, h)
    parts = [torch.empty(8, device=dev) for _ in range(2)]
    dist.all_gather(parts, x.to(dev))
    check("all_gather", torch.cat(parts), torch.cat([torch.arange(8.0), torch.arange(8.0) * 2]))
    peer, buf = 1 - rank, torch.empty(8, device=dev)
    ops = [dist.P2POp(dist.isend, x.to(dev), peer), dist.P2POp(dist.irecv, buf, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check("send_recv", buf, torch.arange(8.0) * (peer + 1))
    a, b, h = x.to(dev), (x * 3).to(torch.float64).to(dev), x.clone()
    with dist._coalescing_manager(async_ops=True) as cm:  # megatron's DDP bucket all-reduce
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    dist.all_reduce(h, group=gloo)
    check("all_reduce_coalesced", torch.cat([a, b.float() / 3]), torch.cat([h, h]))
    d = torch.empty(2, 4, device=dev)
    with dist._coalescing_manager(async_ops=True) as cm:  # the distributed optimizer's shards
        dist.reduce_scatter_tensor(d[0], x.to(dev))
        dist.reduce_scatter_tensor(d[1], x.to(dev))
    cm.wait()
    check("reduce_scatter_coalesced", d[1], out["reduce_scatter_tensor"])
    dist.barrier()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(x)
    dist.all_reduce(x, group=gloo)  # an explicit gloo group still takes host tensors
    return out


def test_eccl_collectives_equal_gloo_and_refuse_host_tensors():
    results = run_distributed(_collectives, 2)
    assert results[0].keys() == results[1].keys() and len(results[0]) == 8


def _tiny_gpt_tp2(platform: str, model_dir: str) -> dict[str, torch.Tensor]:
    """Forward + backward of a tiny megatron GPT at TP=2 on ``platform``: logits and gradients (host)."""
    os.environ.pop("MEGATRON_RL_PLATFORM", None)  # the reference run must be on the platform asked for
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel

    plat, _ = initialize_parallel(tp=2, pp=1, seed=7, platform=platform)
    assert plat.device_type == platform
    model, _ = load_model_from_hf(model_dir, attention_backend="split")
    assert all(p.device == plat.device for p in model.parameters())  # built on the rank's compute device
    ids = torch.tensor([[3, 9, 4, 1, 7, 7, 2, 5, 8, 6, 1, 3]], device=plat.device)
    logits = model(ids, torch.arange(12, device=plat.device)[None], attention_mask=None)
    assert logits.device == plat.device
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    # megatron's parameter attributes survive the move to the device (grad clipping, DDP read them)
    marks = torch.tensor([float(getattr(p, "tensor_model_parallel", -1)) for p in model.parameters()])
    return {"logits": logits.detach().cpu(), "tensor_model_parallel": marks, **grads}


def test_megatron_tp2_on_emulated_equals_cpu(tmp_path):
    from tests.rl_fixtures import make_tiny_rl_model

    model_dir = str(make_tiny_rl_model(tmp_path / "model"))
    on_cpu = run_distributed(_tiny_gpt_tp2, 2, "cpu", model_dir)
    on_emulated = run_distributed(_tiny_gpt_tp2, 2, "emulated", model_dir)
    for rank in range(2):
        assert on_cpu[rank].keys() == on_emulated[rank].keys() and len(on_cpu[rank]) > 2
        for key, value in on_cpu[rank].items():
            torch.testing.assert_close(on_emulated[rank][key], value, rtol=0, atol=1e-6, msg=key)
