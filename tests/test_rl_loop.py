"""End-to-end RL loop on a tiny model with the real hf engine in its own process.

On-policy equivalence (DESIGN §1): with seeded sampling, ``periodic`` mode (groups trained as the
engine finishes them, while the others are still decoding) ends with the same weight changes
after 3 steps as the ``sync`` loop: at TP=1, TP=2 and PP=2, for GRPO, decoupled PPO and Dr.GRPO
with a reference model, with 2 mini-batches per batch, and with groups split across micro-batches.

Nothing here trusts the code's own version labels: every behaviour log-prob the engine reported
for batch t is checked against a transformers forward of the checkpoint written after t optimizer
steps (θ_t), found by the step in the request id. An engine handed stale weights, or weights synced
before the optimizer step, fails that check in both modes.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.distributed import run_distributed
from tests.rl_fixtures import (
    load_weights,
    make_tiny_rl_model,
    teacher_forced_logprobs,
    tiny_rl_config,
    train_recorded,
    train_recorded_ahead,
)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """Multi-turn: the tiny chat model (turns end at <eos>) and the deterministic echo environment
    (2 model turns, one user observation between them)."""
    from tests.multiturn_fixtures import make_tiny_chat_model

    tmp = tmp_path_factory.mktemp("rl_multiturn")
    model = make_tiny_chat_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        environment={"kind": "echo", "options": {"turns": 2}, "max_turns": 3, "max_total_tokens": 160},
        trainer={"steps": 3, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        trainer={"steps": 3, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


def _run(tmp, config, name, world, overrides, *, body=train_recorded, extra=()):
    out = tmp / name
    ranks = run_distributed(
        body, world, config, [*overrides, f"trainer.save_dir={out}", "trainer.save_every=1"], *extra, timeout_s=900
    )
    history, results = ranks[0]
    return out, history, results


def _checkpoint(tmp, out, step):
    """θ_step: the initial model for step 0, else the checkpoint written after `step` optimizer steps."""
    return tmp / "model" if step == 0 else out / f"step_{step}" / "model"


def assert_engine_sampled_from_trained_weights(tmp, out, results, *, version_of=None):
    """Each result of batch t (from its request id) has behaviour log-probs of θ_t (or of θ_v with
    v = version_of(result) in stale mode, after checking it lies in the allowed window)."""
    by_ckpt = {}
    for r in results:
        step = int(r.request_id.split("/")[0])
        by_ckpt.setdefault(version_of(r) if version_of else step, []).append(r)
    for ckpt, rs in sorted(by_ckpt.items()):
        refs = teacher_forced_logprobs(_checkpoint(tmp, out, ckpt), [(r.prompt_ids, r.response_ids) for r in rs])
        for r, ref in zip(rs, refs, strict=True):
            gap = (torch.tensor(r.logprobs, dtype=torch.float64) - torch.tensor(ref)).abs().max().item()
            assert gap <= 1e-4, f"{r.request_id}: engine log-probs differ from θ_{ckpt} by {gap:.2e}"


def assert_same_update(tmp, a_dir, b_dir, tol):
    initial = load_weights(tmp / "model")
    a, b = load_weights(a_dir / "step_3" / "model"), load_weights(b_dir / "step_3" / "model")
    moved = max((a[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "training did not move the weights"
    for key, w0 in initial.items():
        da, db = a[key] - w0, b[key] - w0
        rel = (da - db).abs().max().item() / max(da.abs().max().item(), 1e-12)
        assert rel <= tol, f"{key}: weight changes differ by {rel:.2e} (relative to the change)"
        # Summation order differs (micro-batch cuts, arrival order) and Adam's m / sqrt(v) amplifies
        # it where v is tiny: ~1e-6 of |w| after 3 steps (1.02e-6 seen for ppo_decoupled at TP=2).
        raw = (a[key] - b[key]).abs().max().item() / a[key].abs().max().item()
        assert raw <= 2e-6, f"{key}: weights differ by {raw:.2e} (relative)"


VARIANTS = {
    "grpo_tp1": (1, ["parallel.tp=1"], []),
    "ppo_decoupled_recompute_tp2": (2, ["parallel.tp=2", "algorithm.loss=ppo_decoupled"], []),
    "dapo_kl_pp2": (2, ["parallel.pp=2", "algorithm.loss=dapo", "algorithm.kl.coef=0.1"], []),
    # sync packs whole groups; periodic splits each group across micro-batches (136 < 128 + 4 x 8)
    "dr_grpo_kl_minibatches2_split": (
        1,
        ["algorithm.loss=dr_grpo", "algorithm.kl.coef=0.1", "trainer.mini_batches=2"],
        ["pipeline.micro_batch_tokens=136"],
    ),
    # multi-turn trajectories (chat_setup): every turn checked against θ_t like a response, loss mask on
    "multiturn_echo_dapo_overlong": (
        1,
        ["algorithm.loss=dapo", "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=4"],
        [],
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_periodic_equals_sync_and_samples_come_from_the_trained_weights(request, variant):
    tmp, config = request.getfixturevalue("chat_setup" if variant.startswith("multiturn") else "setup")
    world, common, periodic_only = VARIANTS[variant]
    multiturn = variant.startswith("multiturn")
    logged = [f"rollout.record={tmp / variant}.jsonl", f"trainer.log_dir={tmp / variant}_logs"] if multiturn else []
    sync_dir, sync_hist, sync_results = _run(tmp, config, f"{variant}_sync", world, [*common, "pipeline.mode=sync"])
    per_dir, per_hist, per_results = _run(
        tmp,
        config,
        f"{variant}_periodic",
        world,
        [*common, "pipeline.mode=periodic", "rollout.max_batch_size=4", *periodic_only, *logged],
    )
    assert_same_update(tmp, sync_dir, per_dir, tol=1e-4)
    for out, results in ((sync_dir, sync_results), (per_dir, per_results)):
        assert len({"/".join(r.request_id.split("/")[:3]) for r in results}) == 3 * 4 * 4  # trajectories
        assert_engine_sampled_from_trained_weights(tmp, out, results)
    mini = 2 if "minibatches2" in variant else 1
    for hist in (sync_hist, per_hist):
        assert [h["train/optimizer_steps"] for h in hist] == [mini] * 3
        assert all(h["rollout/staleness_max"] == 0 for h in hist)
    # Real overlap: some micro-batches were trained while the engine was still decoding the step.
    assert sum(h["train/overlapped_micro_batches"] for h in per_hist) >= 1
    assert all(h["train/overlapped_micro_batches"] == 0 for h in sync_hist)
    if "split" in variant:
        assert all(h["train/micro_batches"] >= 4 for h in per_hist)  # every group went in two parts
    if multiturn:
        assert_trained_ids_are_engine_and_template_ids(tmp / f"{variant}.jsonl", per_results)
        assert any(h["multiturn/turns_mean"] > 1 and h["multiturn/observation_tokens"] > 0 for h in per_hist)
        assert_multiturn_dashboard(tmp / f"{variant}_logs")


def assert_trained_ids_are_engine_and_template_ids(recording, results):
    """Every trained sample (the queue, recorded) is its engine turns' exact ids with the
    observation ids between them: each turn's prompt + response is a prefix of the trajectory,
    the loss mask is 1 exactly on the turns' tokens and the behaviour log-probs are theirs."""
    from megatron_rl.pipeline.recording import read_recording
    from megatron_rl.pipeline.records import ScoredGroup

    turns = {}
    for r in results:
        turns.setdefault(r.request_id.rsplit("/", 1)[0], []).append(r)
    groups = [item for item in read_recording(recording) if isinstance(item, ScoredGroup)]
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 3 * 4 * 4
    for g in groups:  # DAPO overlong, written out: the whole response against the budget left after the
        room, buffer = 160 - len(g.samples[0].prompt_ids), 4  # prompt; a truncated one counts as reaching it
        for s, shaped in zip(g.samples, g.rewards.tolist(), strict=True):
            length = room if s.truncated else len(s.response_ids)
            penalty = 0.0 if length <= room - buffer else -1.0 if length > room else -(length - room + buffer) / buffer
            assert shaped == pytest.approx(s.reward + penalty, abs=1e-6), s.request_id
    for s in samples:
        own = sorted(turns[s.request_id], key=lambda r: int(r.request_id.rsplit("/", 1)[1]))
        full, mask, behav = s.prompt_ids + s.response_ids, [0] * len(s.response_ids), [0.0] * len(s.response_ids)
        assert len(own) == s.turns
        for r in own:
            start = len(r.prompt_ids) - len(s.prompt_ids)
            assert full[: len(r.prompt_ids) + len(r.response_ids)] == r.prompt_ids + r.response_ids
            mask[start : start + len(r.response_ids)] = [1] * len(r.response_ids)
            behav[start : start + len(r.response_ids)] = r.logprobs
        assert tuple(mask) == s.loss_mask and tuple(behav) == s.behav_logprobs


def assert_multiturn_dashboard(log_dir):
    """tools/plot_metrics.py draws the multi-turn row (3 x 3 panels) from the run's metrics."""
    import subprocess
    import sys
    from pathlib import Path

    from matplotlib.image import imread

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(repo / "tools" / "plot_metrics.py"), str(log_dir)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    height, width, _ = imread(log_dir / "dashboard.png").shape
    assert (width, height) == (16 * 80, int(12.5 * 80))


def _a3po_loss(tmp, out, results, step, clip=0.2):
    """The decoupled-PPO loss of batch ``step`` written out: A-3PO proximal, behaviour weight,
    clipped ratio, token mean over the batch; θ from the checkpoint, rewards recomputed."""
    from transformers import AutoTokenizer

    from tests.rl_fixtures import digit_share_reward

    tok = AutoTokenizer.from_pretrained(tmp / "model")
    rs = [r for r in results if int(r.request_id.split("/")[0]) == step]
    groups = {}
    for r in rs:
        groups.setdefault(r.request_id.split("/")[1], []).append(r)
    logps = teacher_forced_logprobs(_checkpoint(tmp, out, step), [(r.prompt_ids, r.response_ids) for r in rs])
    logp_of = {r.request_id: lp for r, lp in zip(rs, logps, strict=True)}
    total, tokens = 0.0, 0
    for members in groups.values():
        members.sort(key=lambda r: int(r.request_id.split("/")[2]))
        rewards = [digit_share_reward(None, tok.decode(r.response_ids, skip_special_tokens=True)) for r in members]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        for r, reward in zip(members, rewards, strict=True):
            adv = 0.0 if std == 0 else (reward - mean) / (std + 1e-6)
            alpha = 1.0 / max(step - r.weight_version, 1)
            for lp, behav in zip(logp_of[r.request_id], r.logprobs, strict=True):
                prox = alpha * behav + (1 - alpha) * lp
                ratio, weight = torch.tensor(lp - prox).exp().item(), torch.tensor(prox - behav).exp().item()
                clipped = min(max(ratio, 1 - clip), 1 + clip)
                total += -min(ratio * adv, clipped * adv) * weight
                tokens += 1
    return total / tokens


@pytest.mark.parametrize("k", [1, 2])
def test_stale_mode_reaches_its_staleness_and_trains_the_a3po_loss(setup, k):
    """stale + A-3PO: generation runs up to k versions ahead; every sample's log-probs are those of
    the version it claims (checked against that checkpoint); one step's loss equals the written-out
    A-3PO loss. The engine holds each weight update until the producer is k batches ahead
    (``LeadHoldingEngine``), so the lead does not depend on how the cores are shared."""
    tmp, config = setup
    out, history, results = _run(
        tmp,
        config,
        f"stale_k{k}",
        1,
        [
            "pipeline.mode=stale",
            f"pipeline.max_staleness={k}",
            "pipeline.queue_size=64",
            "algorithm.loss=ppo_decoupled",
            "algorithm.proximal=loglinear",
            "trainer.steps=6",
        ],
        body=train_recorded_ahead,
        extra=(k,),
    )
    assert [h["train/version"] for h in history] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert max(h["rollout/staleness_max"] for h in history) == k  # it really ran ahead by k

    def version_of(r):
        step = int(r.request_id.split("/")[0])
        assert step - k <= r.weight_version <= step, r.request_id
        return r.weight_version

    assert_engine_sampled_from_trained_weights(tmp, out, results, version_of=version_of)
    stale_step = next(t for t, h in enumerate(history) if h["rollout/staleness_max"] >= 1)
    expected = _a3po_loss(tmp, out, results, stale_step)
    assert history[stale_step]["loss/value"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_resume_from_a_checkpoint_continues_exactly(setup):
    """3 steps straight == 1 step, checkpoint (weights, Adam state, controller, prompt stream),
    a new process resuming for the remaining 2 steps."""
    tmp, config = setup
    straight, _, _ = _run(tmp, config, "straight", 1, ["pipeline.mode=sync"])
    assert (straight / "step_1" / "trainer_state.json").is_file()
    assert not list(straight.glob("*.tmp")), "a staging directory was left behind"
    resumed, history, results = _run(
        tmp, config, "resumed", 1, ["pipeline.mode=sync", f"trainer.resume_from={straight / 'step_1'}"]
    )
    assert len(history) == 2
    # versions keep counting optimizer steps: the engines start at the checkpoint's version 1
    assert [h["train/version"] for h in history] == [2.0, 3.0]
    assert {(int(r.request_id.split("/")[0]), r.weight_version) for r in results} == {(1, 1), (2, 2)}
    assert_same_update(tmp, straight, resumed, tol=1e-6)


def test_broadcast_weight_sync_equals_snapshot_sync(setup):
    """rollout.weight_sync=broadcast (trainer leader -> engine workers over a gloo group, the
    NCCL / HCCL path on devices) trains exactly like the snapshot path, at TP=2."""
    tmp, config = setup
    base = ["parallel.tp=2", "pipeline.mode=periodic"]
    snapshot, _, _ = _run(tmp, config, "snapshot_tp2", 2, [*base, "rollout.weight_sync=snapshot"])
    broadcast, hist, results = _run(tmp, config, "broadcast_tp2", 2, [*base, "rollout.weight_sync=broadcast"])
    assert [h["train/version"] for h in hist] == [1.0, 2.0, 3.0]
    assert_same_update(tmp, snapshot, broadcast, tol=1e-4)  # periodic: groups summed in arrival order
    assert_engine_sampled_from_trained_weights(tmp, broadcast, results)
