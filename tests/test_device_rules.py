"""The emulated accelerator bites: planted device bugs of the kinds issues 17 and 29 found by
reading the training path, each failing a one-step training run on the emulated device while the
same run passes where the rule does not hold.

Under CUDA's rules (``emulated``; the same run passes on ``cpu``, where host and device are one):

1. A host tensor in the loss: the micro-batch is not moved to the device (``MicroBatch.to`` made
   a no-op), so the host advantages / behaviour log-probs meet the device log-probs.
2. A host tensor handed to a collective: the loss totals are all-reduced as a host tensor on the
   default (device) group, as ``_global_totals`` did before the fix.

Under the Ascend 910B's (``emulated-npu``; the same run passes under CUDA's rules, ``emulated``):

3. fp64 computed on the device: the mismatch metrics' k3 in float64 (``expm1`` of a Double
   tensor), as ``mismatch_metrics`` did before issue 29 (CANN's expm1 has no DOUBLE kernel).
4. An fp64 all-reduce: the loss totals reduced as float64, as ``_global_totals`` did before
   issue 29 (torch_npu's HCCL all-reduce refuses ``at::kDouble``; NCCL accepts it).
(The third kind, megatron's ``torch.cuda.*Tensor`` checks, is ``test_npu_adaptor``.)
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import CUDA_PLATFORM, TRAIN_PLATFORM, make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _host_batch_in_the_loss() -> None:
    from megatron_rl.pipeline.records import MicroBatch

    MicroBatch.to = lambda self, device: self


def _host_totals_in_a_collective() -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.trainer.policy_step import PolicyTrainer

    def host_totals(self):
        totals = torch.stack([self._denominator, self._numerator]).cpu()  # the planted bug
        dist.all_reduce(totals)
        return totals.tolist()

    PolicyTrainer._global_totals = host_totals


def _fp64_on_the_device() -> None:
    import torch

    import megatron_rl.algorithms.correction as correction

    def k3_in_fp64(delta):
        d64 = delta.double()  # the planted bug
        return (torch.expm1(d64) - d64).to(delta.dtype)

    correction.k3_of_log_ratio = k3_in_fp64


def _fp64_all_reduce() -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.trainer.policy_step import PolicyTrainer

    def fp64_totals(self):
        totals = torch.stack([self._denominator.double(), self._numerator.double()])  # the planted bug
        dist.all_reduce(totals)
        return tuple(float(t) for t in totals.cpu())

    PolicyTrainer._global_totals = fp64_totals


PLANTED = {
    "host_tensor_in_loss": _host_batch_in_the_loss,
    "host_tensor_in_collective": _host_totals_in_a_collective,
    "fp64_on_the_device": _fp64_on_the_device,
    "fp64_all_reduce": _fp64_all_reduce,
}


def _train_planted(bug: str, platform: str, config: str) -> str:
    """A rank's body: plant ``bug``, train one step on ``platform``; "ok" or the error's text."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    os.environ.pop("MEGATRON_RL_PLATFORM", None)  # this test chooses the platform itself
    PLANTED[bug]()
    try:
        train(load_config(config, []), platform=platform)
    except RuntimeError as err:  # the device rule, raised by PyTorch / the collective backend
        return f"{type(err).__name__}: {err}"
    return "ok"


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_rules")
    model = make_tiny_rl_model(tmp / "model")
    return str(
        tiny_rl_config(
            tmp,
            model,
            pipeline={"mode": "sync", "micro_batch_tokens": 256},
            trainer={"steps": 1, "prompts_per_batch": 2},
        )
    )


@pytest.mark.parametrize(
    ("bug", "world", "passes_on", "fails_on", "message"),
    [
        ("host_tensor_in_loss", 1, "cpu", CUDA_PLATFORM, "Expected all tensors to be on the same device"),
        ("host_tensor_in_collective", 2, "cpu", CUDA_PLATFORM, "No backend type associated with device type cpu"),
        ("fp64_on_the_device", 1, CUDA_PLATFORM, TRAIN_PLATFORM, "aten::expm1: argument 'self' is a Double tensor"),
        ("fp64_all_reduce", 2, CUDA_PLATFORM, TRAIN_PLATFORM, "Unsupported data type at::kDouble"),
    ],
)
def test_a_planted_device_bug_fails_where_its_rule_holds(config, bug, world, passes_on, fails_on, message):
    passing = run_distributed(_train_planted, world, bug, passes_on, config, timeout_s=600)
    assert passing == ["ok"] * world, passing
    failing = run_distributed(_train_planted, world, bug, fails_on, config, timeout_s=600)
    assert any(message in r for r in failing), failing
