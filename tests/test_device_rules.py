"""The emulated accelerator bites: two planted device bugs of the kind issue 17 found by reading
the training path, each failing a one-step training run on ``emulated`` (as it would on CUDA /
NPU) while the same run passes on ``cpu``, where host and device are one.

1. A host tensor in the loss: the micro-batch is not moved to the device (``MicroBatch.to`` made
   a no-op), so the host advantages / behaviour log-probs meet the device log-probs.
2. A host tensor handed to a collective: the loss totals are all-reduced as a host tensor on the
   default (device) group, as ``_global_totals`` did before the fix.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config

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


PLANTED = {"host_tensor_in_loss": _host_batch_in_the_loss, "host_tensor_in_collective": _host_totals_in_a_collective}


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
    return str(tiny_rl_config(tmp, model, pipeline={"mode": "sync", "micro_batch_tokens": 256},
                              trainer={"steps": 1, "prompts_per_batch": 2}))


@pytest.mark.parametrize(("bug", "world", "message"), [
    ("host_tensor_in_loss", 1, "Expected all tensors to be on the same device"),
    ("host_tensor_in_collective", 2, "No backend type associated with device type cpu"),
])
def test_a_planted_device_bug_fails_on_emulated_and_passes_on_cpu(config, bug, world, message):
    on_cpu = run_distributed(_train_planted, world, bug, "cpu", config, timeout_s=600)
    assert on_cpu == ["ok"] * world, on_cpu
    on_device = run_distributed(_train_planted, world, bug, "emulated", config, timeout_s=600)
    assert any(message in r for r in on_device), on_device
