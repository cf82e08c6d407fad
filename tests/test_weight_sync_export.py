"""Only the rank that sends a stage materialises its HF tensors (issue 29, defect 5): at TP 2 x
DP 2 the other TP rank of replica 0 sends its shards and keeps nothing, replica 1 takes no part;
with routed experts (EP 2 x DP 2) replica 1 joins the expert gathers and keeps nothing. The
sender's tensors equal the all-gather export on every rank (``export_hf_tensors``), and each
rank's peak device memory during the export is measured on the emulated device."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = [pytest.mark.multiproc]


def _export(model_dir: str, tp: int, ep: int) -> dict:
    """This rank: the sync export's names, whether they equal the reference, its peak device bytes."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models import export_hf_tensors, load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.policy_weights import PolicyWeights

    plat, _ = initialize_parallel(tp=tp, pp=1, ep=ep, platform="emulated")
    model, spec = load_model_from_hf(model_dir, attention_backend="split")
    reference = {n: t.cpu().clone() for n, t in export_hf_tensors(model, spec)}  # every rank, all-gathers
    base = torch.emulated.memory_allocated(plat.device)
    torch.emulated.reset_peak_memory_stats(plat.device)
    got = PolicyWeights(model, spec, model_dir).export()
    peak = torch.emulated.max_memory_allocated(plat.device) - base
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "peak": peak,
        "names": [n for n, _ in got],
        "reference": list(reference),
        "equal": all(torch.equal(t.cpu(), reference[n]) for n, t in got),
        "model_bytes": sum(t.nbytes for t in reference.values()),
        "largest": max(t.nbytes for t in reference.values()),
    }


def _check(results: list[dict]) -> None:
    for r in results:
        print(
            f"tp {r['tp']} dp {r['dp']}: export peak {r['peak'] / 1e3:.1f} kB of a {r['model_bytes'] / 1e3:.1f} kB "
            f"stage, {len(r['names'])} tensors kept"
        )
        if r["tp"] == 0 and r["dp"] == 0:
            assert r["names"] == r["reference"] and r["equal"]
        else:
            assert r["names"] == [] and r["peak"] < r["largest"], r


def test_tp2_dp2_only_the_sender_keeps_the_export(tmp_path):
    from tests.rl_fixtures import make_tiny_rl_model

    model_dir = str(make_tiny_rl_model(tmp_path / "model"))
    _check(run_distributed(_export, 4, model_dir, 2, 1, timeout_s=240))


def test_ep2_dp2_replica1_joins_the_expert_gathers_only(tmp_path):
    from tests.hf_moe_models import make_tiny_moe

    model_dir = str(make_tiny_moe(tmp_path / "moe", layers=2))
    _check(run_distributed(_export, 2, model_dir, 1, 2, timeout_s=240))
