"""``PolicyTrainer`` on the emulated device at DP = 2 keeps to the 910B's rules (issue 29, defects
1, 2 and 9's host sync), op by op (``tests.device_op_rules.DeviceOpRecorder``):

- each micro-batch's loss path (its share of D, the loss, the rollout correction, the
  accumulation) computes no fp64 on the device, produces no data-dependent shape and reads no
  scalar back: the micro-batch adds to device totals only;
- the batch totals all-reduced over the device group are an int64 count and an fp32 sum (HCCL
  refuses kDouble; a count in fp32 would be inexact past 2^24), read once each after the
  reduction; the world's metrics reach the host without an fp64 stack on the device.

The denominator is the written-out token count (the update itself is pinned by
``test_policy_trainer`` / ``test_policy_step_ranks``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.distributed import run_distributed
from tests.test_policy_trainer import _settings, make_groups
from tests.test_policy_trainer import checkpoint as checkpoint  # noqa: F401 -- the module fixture

pytestmark = [pytest.mark.multiproc]


def _recorded(trainer, name: str, recorder):
    """Wrap ``trainer.<name>`` so that every call runs inside ``recorder``."""
    inner = getattr(trainer, name)

    def wrapped(*args, **kwargs):
        with recorder:
            return inner(*args, **kwargs)

    setattr(trainer, name, wrapped)


def _device_rules_worker(path: str, platform: str):
    import megatron_rl.trainer.policy_step as policy_step
    from megatron_rl.algorithms import RolloutCorrection
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch
    from megatron_rl.platform import emulated
    from megatron_rl.trainer.build import build_policy_trainer
    from tests.device_op_rules import DeviceOpRecorder

    _, layout = initialize_parallel(tp=1, pp=1, platform=platform)
    settings = _settings(path, "dapo")  # sequence_mask + δ: the correction's every branch runs
    correction = RolloutCorrection(mode="sequence_mask", c_min=0.5, c_max=2.0, delta=0.5)
    trainer, _, spec = build_policy_trainer(replace(settings, loss=replace(settings.loss, correction=correction)))
    loss_path, totals_path = DeviceOpRecorder(), DeviceOpRecorder()
    _recorded(trainer, "_micro_loss", loss_path)
    _recorded(trainer, "_global_totals", totals_path)
    denominator = policy_step.loss_denominator
    policy_step.loss_denominator = lambda *a: _call_in(loss_path, denominator, *a)
    groups = make_groups(spec.vocab_size)[layout.dp_rank :: layout.dp]
    trainer.begin_batch()
    chunks = chunk_by_tokens(groups, 20)
    before = emulated.transfer_counts()
    for chunk in chunks:
        trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
    per_micro_batch = (emulated.transfer_counts() - before).d2h / len(chunks)
    result = trainer.finish_mini_batch()
    return {
        "loss_path": loss_path.violations(),
        "totals_fp64": totals_path.fp64,
        "totals_shapes": totals_path.data_dependent,
        "totals_reads": len(totals_path.host_reads),
        "d2h_per_micro_batch": per_micro_batch,
        "denominator": result.denominator,
        "loss": result.loss,
        "skipped": result.skipped,
    }


def _call_in(recorder, fn, *args):
    with recorder:
        return fn(*args)


@pytest.mark.parametrize("platform", ["emulated-npu"])  # the 910B profile: it refuses fp64 itself too
def test_policy_step_at_dp2_keeps_to_the_device_rules(checkpoint, platform):  # noqa: F811
    groups = make_groups(300)  # the tiny checkpoint's vocabulary
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    for rank in run_distributed(_device_rules_worker, 2, checkpoint, platform):
        print(f"{platform}: d2h per micro-batch {rank['d2h_per_micro_batch']:.1f}")  # the whole micro-step
        assert rank["loss_path"] == {}, rank["loss_path"]
        assert rank["totals_fp64"] == [] and rank["totals_shapes"] == [], rank
        assert rank["totals_reads"] == 2  # the count and the sum, once each, after the reduction
        assert not rank["skipped"] and rank["denominator"] == tokens
