"""Save + resume continues exactly, for every Adam megatron-core may build (issue 17).

Reference: one trainer (``build_policy_trainer``: megatron DDP + ``get_megatron_optimizer``,
a chained optimizer) taking 4 optimizer steps on fixed groups. Subject: a trainer taking 2
steps, saving weights (``save_hf_checkpoint``) and the Adam state (``save_optimizer_state``),
then a fresh trainer built from that checkpoint, restored with ``load_optimizer_state``,
taking the last 2. Weights and the Adam state written after step 4 must match (≤ 1e-6).

Cases: torch AdamW (step per parameter, ``state[p]["step"]``); ``GroupStepAdam``, a test-only
Adam(W) that keeps the step per parameter group as apex's and Transformer Engine's
``FusedAdam`` do (``param_groups[i]["step"]``), put where megatron-core 0.16 picks its Adam
class; wrapped as megatron wraps it: bare (fp32), in the float16 wrapper (bf16 model, fp32
master weights saved as ``param/<name>``) and in the distributed optimizer; and on 2 ranks:
PP = 2 with an untied LM head and with tied embeddings (then the last stage holds the output
layer as a parameter of its own, and its state is restored from the embedding's entry),
TP = 2 (bf16), DP = 2 with the distributed optimizer.

A step restarted at 1 (the step lost in the checkpoint) changes Adam's bias correction
1 / (1 - beta^t) (Kingma & Ba 2015, Algorithm 1): the resumed update is off by ~1e-3 here.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.test_policy_trainer import make_groups

TOL = 1e-6
STEPS, SAVE_AT = 4, 2


class GroupStepAdam(torch.optim.Optimizer):
    """Adam(W) keeping the step in ``param_groups[i]["step"]`` and only the moments in
    ``state[p]``, as apex / TE ``FusedAdam`` do (same constructor keywords megatron passes:
    ``adam_w_mode``). Update as FusedAdam's kernel: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
    in AdamW mode (Loshchilov & Hutter), the L2 term folded into the gradient otherwise."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue  # FusedAdam does not count steps of empty groups
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t, wd = group["betas"], group["step"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode or not wd else p.grad + wd * p
                state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = (state["exp_avg"] / (1 - b1**t)) / ((state["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"])
                if self.adam_w_mode and wd:
                    update = update + wd * p
                p.add_(update, alpha=-group["lr"])


def use_group_step_adam() -> None:
    """Make megatron-core 0.16 build ``GroupStepAdam`` where it would build apex's FusedAdam:
    the module globals it reads when it picks the class (``megatron/core/optimizer/__init__.py``:
    ``Adam``, ``USING_PYTORCH_OPTIMIZER``) and checks it (``distrib_optimizer.py``: ``Adam``,
    ``HAVE_APEX_OR_TE``, ``USING_APEX_OPTIMIZER``), as an apex install sets them."""
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as mcore_distrib

    mcore_optimizer.Adam = mcore_distrib.Adam = GroupStepAdam
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False
    mcore_distrib.HAVE_APEX_OR_TE, mcore_distrib.USING_APEX_OPTIMIZER = True, True


def _settings(path, dtype: str, distributed: bool):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    return TrainerSettings(
        hf_path=str(path),
        model=ModelConfig(hf_path=str(path), dtype=dtype),
        parallel=ParallelConfig(distributed_optimizer=distributed),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind="grpo"),
        trainer=TrainerConfig(steps=STEPS, lr=1e-3, weight_decay=0.01, grad_clip=100.0),
    )


def _train(trainer, vocab: int, steps: int) -> None:
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch

    for _ in range(steps):
        trainer.begin_batch()
        for chunk in chunk_by_tokens(make_groups(vocab), 24):
            trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
        assert not trainer.finish_mini_batch().skipped


def _save(trainer, policy, spec, directory, source) -> None:
    from megatron_rl.models import save_hf_checkpoint
    from megatron_rl.trainer.optimizer_state import save_optimizer_state

    save_hf_checkpoint(policy, spec, directory / "model", source_dir=source)
    save_optimizer_state(trainer.optimizer, policy, spec, directory / "optimizer")


def _resume_worker(path, out, dtype, distributed, group_step, tp, pp):
    """Rank body: the straight run and the resumed run; each writes a checkpoint after step 4."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trainer.optimizer_state import load_optimizer_state

    if group_step:
        use_group_step_adam()
    initialize_parallel(tp=tp, pp=pp)
    trainer, policy, spec = build_policy_trainer(_settings(path, dtype, distributed))
    if group_step:
        assert all(isinstance(p.optimizer, GroupStepAdam) for p in trainer.optimizer.chained_optimizers)
    if pp > 1 and ps.is_pipeline_last_stage():  # tied or not, the last stage's LM head is a parameter
        assert "output_layer.weight" in dict(policy.named_parameters())
    _train(trainer, spec.vocab_size, STEPS)
    _save(trainer, policy, spec, out / "straight", path)
    trainer, policy, spec = build_policy_trainer(_settings(path, dtype, distributed))
    _train(trainer, spec.vocab_size, SAVE_AT)
    _save(trainer, policy, spec, out / "saved", path)
    trainer, policy, spec = build_policy_trainer(_settings(out / "saved" / "model", dtype, distributed))
    load_optimizer_state(trainer.optimizer, policy, spec, out / "saved" / "optimizer")
    _train(trainer, spec.vocab_size, STEPS - SAVE_AT)
    _save(trainer, policy, spec, out / "resumed", path)


def _files(directory) -> dict[str, torch.Tensor]:
    from tests.rl_fixtures import load_weights

    return {f"{sub}:{k}": v.float() for sub in ("model", "optimizer") for k, v in load_weights(directory / sub).items()}


def _assert_resumed_equals_straight(out, want_master: bool) -> None:
    import json

    straight, resumed, start = _files(out / "straight"), _files(out / "resumed"), _files(out / "saved")
    assert straight.keys() == resumed.keys()
    assert any(k.startswith("optimizer:param/") for k in straight) == want_master
    moved = max((straight[k] - start[k]).abs().max().item() for k in straight if k.startswith("model:"))
    diffs = {
        k: (straight[k] - resumed[k]).abs().max().item() / max(straight[k].abs().max().item(), 1e-30) for k in straight
    }
    worst = max(diffs, key=diffs.get)
    weights = max((v, k) for k, v in diffs.items() if k.startswith("model:"))
    print(
        f"max relative diff resumed vs straight: {diffs[worst]:.3e} ({worst}); weights {weights[0]:.3e} "
        f"({weights[1]}); steps 3-4 moved weights {moved:.2e}"
    )
    assert moved > 1e-4, "training did not move the weights"
    assert diffs[worst] <= TOL, f"{worst}: resumed run differs from the straight run by {diffs[worst]:.3e} (relative)"
    for sub in ("straight", "saved"):
        meta = json.loads((out / sub / "optimizer" / "optimizer.json").read_text())
        assert meta["step"] == (STEPS if sub == "straight" else SAVE_AT), f"{sub}: step {meta['step']} recorded"


CASES = {  # dtype, distributed optimizer, group-step Adam (FusedAdam-like)
    "torch_adamw_fp32": ("float32", False, False),
    "group_step_fp32": ("float32", False, True),
    "group_step_bf16_fp32_master": ("bfloat16", False, True),
    "group_step_distributed_optimizer": ("float32", True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_continues_exactly_whatever_the_adam(tmp_path, case):
    dtype, distributed, group_step = CASES[case]
    path = make_tiny_hf(tmp_path / "hf", "qwen2", layers=2)
    run_distributed(_resume_worker, 1, path, tmp_path, dtype, distributed, group_step, 1, 1)
    _assert_resumed_equals_straight(tmp_path, want_master=dtype != "float32")


LAYOUTS = {  # 2 ranks: family, tied, dtype, distributed optimizer, (tp, pp)
    "pp2_untied_head": ("llama", False, "float32", False, (1, 2)),
    "pp2_tied_embedding": ("llama", True, "float32", False, (1, 2)),
    "tp2_bf16_fp32_master": ("qwen2", False, "bfloat16", False, (2, 1)),
    "dp2_distributed_optimizer": ("qwen2", False, "float32", True, (1, 1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_on_two_ranks_continues_exactly(tmp_path, layout):
    """PP = 2: embedding on stage 0, output layer on stage 1 (its own parameter also when tied);
    TP = 2: the state gathered to TP rank 0 and split again; DP = 2 with the distributed
    optimizer: each replica owns half of every buffer (both train the same groups)."""
    family, tied, dtype, distributed, (tp, pp) = LAYOUTS[layout]
    path = make_tiny_hf(tmp_path / "hf", family, tied=tied, layers=2)
    run_distributed(_resume_worker, 2, path, tmp_path, dtype, distributed, True, tp, pp)
    _assert_resumed_equals_straight(tmp_path, want_master=dtype != "float32")


def _record_default_group_use() -> list[str]:
    """Pretend the default group is NCCL (as on a GPU) and record every collective our code
    sends through it: on a device run a host tensor there raises "No backend type associated
    with device type cpu", and here every tensor is a host tensor."""
    import torch.distributed as dist

    used: list[str] = []
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group in (None, dist.group.WORLD) else real_backend(group)
    for op in (
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "send",
        "recv",
        "gather",
        "gather_object",
    ):
        setattr(dist, op, _recording(getattr(dist, op), op, used))
    return used


def _recording(real, op: str, used: list[str]):
    import torch.distributed as dist

    def wrapped(*args, **kwargs):
        if kwargs.get("group") in (None, dist.group.WORLD):
            used.append(op)
        return real(*args, **kwargs)

    return wrapped


def _groups_worker(path, out, tp, distributed):
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trainer.optimizer_state import load_optimizer_state

    initialize_parallel(tp=tp, pp=1)
    trainer, policy, spec = build_policy_trainer(_settings(path, "bfloat16", distributed))
    _train(trainer, spec.vocab_size, 1)
    used = _record_default_group_use()
    _save(trainer, policy, spec, out, path)
    load_optimizer_state(trainer.optimizer, policy, spec, out / "optimizer")
    return used


@pytest.mark.parametrize(
    ("world", "tp", "distributed"),
    [(1, 1, True), (2, 2, False), (2, 1, True)],
    ids=["world1_distributed_optimizer", "tp2", "dp2_distributed_optimizer"],
)
def test_saving_sends_nothing_through_the_default_group(tmp_path, world, tp, distributed):
    """Weights and optimizer state move on megatron's TP / DP groups, host bookkeeping (step,
    names, barriers) on a gloo group of its own: the default group (NCCL / HCCL on devices)
    carries none of it, at world 1 neither."""
    path = make_tiny_hf(tmp_path / "hf", "qwen2", layers=1)
    for rank, used in enumerate(run_distributed(_groups_worker, world, path, tmp_path / "ckpt", tp, distributed)):
        assert not used, f"rank {rank}: {used} sent through the default group"
