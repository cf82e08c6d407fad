"""``python -m megatron_rl bench`` on a tiny model: every scope reports every field, the phase
breakdown sums to the step time, trained-token counts equal the sum over the samples, and
``--compare`` prints ratios against the first variant.

The ``train`` scope runs through the real CLI (``--compare`` of two token budgets: whole groups
vs groups split across micro-batches), ``rollout`` in this process (its engine is a process of
its own) and ``e2e`` in a one-rank gloo group.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.bench import PHASES, BenchOptions, GroupShape, LengthDist
from megatron_rl.bench.result import BenchResult
from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, make_tiny_rl_model, tiny_rl_config

REPO = Path(__file__).resolve().parents[1]
PROMPTS, G, MAX_NEW = 2, 4, 8
TRAIN_FLAGS = [
    "--scope",
    "train",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--prompt-len",
    "uniform:8,24",
    "--response-len",
    "heavy:5,1.0",
    "--seed",
    "7",
    "--platform",
    TRAIN_PLATFORM,
]
BUDGETS = (256, 40)  # 256: every group whole; 40 < 24 + 4 x 8: some groups split, the prompt repeated


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        trainer={"steps": 2, "prompts_per_batch": PROMPTS},
        control={"kind": "fixed", "group_size": G},
        rollout={"sampling": {"temperature": 1.0, "max_new_tokens": MAX_NEW, "seed": 3}},
    )
    return tmp, config


@pytest.fixture(scope="module")
def compared(setup):
    """stdout of one ``bench --compare`` invocation over the two token budgets (train scope)."""
    _, config = setup
    variants = [f"pipeline.micro_batch_tokens={b}" for b in BUDGETS]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            str(config),
            "data.max_prompt_tokens=24",
            *TRAIN_FLAGS,
            "--compare",
            *variants,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def _compare_record(stdout: str) -> list[dict]:
    return json.loads(stdout.strip().splitlines()[-1])["compare"]


def assert_every_field(rec: dict, scope: str) -> None:
    """Every ``BenchResult`` field is there, numbers are finite, phases / tokens / versions filled."""
    assert set(rec) == {f.name for f in dataclasses.fields(BenchResult)}
    assert rec["scope"] == scope
    for key in (
        "step_s",
        "tokens_per_s_per_device",
        "samples_per_s",
        "completion_tokens_per_s",
        "peak_memory_gb",
        "peak_tflops",
    ):
        assert math.isfinite(rec[key]) and rec[key] > 0, (key, rec[key])
    assert list(rec["phases"]) == list(PHASES) and all(v >= 0 for v in rec["phases"].values())
    assert all(rec["tokens"][k] > 0 for k in ("prompt", "response", "packed", "samples", "groups"))
    assert rec["versions"]["torch"] == torch.__version__ and "megatron-core" in rec["versions"]
    assert rec["world"]["platform"] == ("cpu" if scope == "rollout" else TRAIN_PLATFORM) and rec["devices"] >= 1
    assert rec["config"]["control"]["group_size"] == G
    if scope == "rollout":
        assert rec["mfu"] is None  # nothing trained
    else:
        assert 0 < rec["mfu"] and rec["flops_per_step"] > 0


def assert_breakdown_sums(rec: dict, *, max_idle: float) -> None:
    """Σ phases = step time within 5 %, and the measured phases (not the idle rest) explain it."""
    total = sum(rec["phases"].values())
    assert abs(total - rec["step_s"]) <= 0.05 * rec["step_s"], (rec["phases"], rec["step_s"])
    assert rec["phases"]["idle"] <= max_idle * rec["step_s"], rec["phases"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_scope_returns_every_field(compared):
    for variant in _compare_record(compared):
        rec = variant["bench"]
        assert_every_field(rec, "train")
        assert rec["phases"]["train"] > 0 and rec["phases"]["optimizer"] > 0 and rec["phases"]["generation"] == 0
        assert_breakdown_sums(rec, max_idle=0.5)
        assert rec["world"]["world_size"] == 1 and rec["devices"] == 1


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_scope_trained_tokens_equal_the_samples(setup, compared):
    """Counts read back from the trained micro-batches == sums over the synthetic samples."""
    from megatron_rl.bench.train_scope import SyntheticGroups

    vocab = json.loads((setup[0] / "model" / "config.json").read_text())["vocab_size"]
    source = SyntheticGroups(
        vocab_size=vocab,
        num_prompts=PROMPTS,
        group_size=G,
        prompt_len=LengthDist.parse("uniform:8,24"),
        response_len=LengthDist.parse("heavy:5,1.0"),
        max_prompt_tokens=24,
        max_new_tokens=MAX_NEW,
        seed=7,
    )
    groups = [g for step in (1, 2) for g in source.samples(step)]  # the measured steps (after 1 warm-up)
    samples = [s for g in groups for s in g]
    expect = {
        "prompt": sum(len(s.prompt_ids) for s in samples),
        "response": sum(len(s.response_ids) for s in samples),
        "samples": len(samples),
    }
    whole, split = (v["bench"] for v in _compare_record(compared))
    for rec in (whole, split):
        assert {k: rec["tokens"][k] for k in expect} == expect
        assert rec["tokens_per_s_per_device"] == pytest.approx(
            (expect["prompt"] + expect["response"]) / rec["devices"] / rec["step_s"] / rec["steps"]
        )
    # shared-prompt packing: each prompt once per group; split groups repeat it once per part
    assert whole["tokens"]["packed"] == sum(len(g[0].prompt_ids) + sum(len(s.response_ids) for s in g) for g in groups)
    assert whole["tokens"]["groups"] == len(groups) < split["tokens"]["groups"]
    assert split["tokens"]["packed"] > whole["tokens"]["packed"]


def _linear_weights(model_dir: Path) -> tuple[int, dict]:
    """Parameters of every nn.Linear of the HF model (the per-token matmuls), and its config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)), model.config


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_scope_flops_count_the_prompt_once_per_group(setup, compared):
    """FLOPs per step == 3 x (2 x linear params x packed tokens + 4 x layers x heads x head_dim x
    allowed pairs), from the HF model's modules and the synthetic groups' lengths (heads x
    head_dim = hidden size for this model)."""
    from megatron_rl.bench.train_scope import SyntheticGroups

    params, hf = _linear_weights(setup[0] / "model")
    source = SyntheticGroups(
        vocab_size=hf.vocab_size,
        num_prompts=PROMPTS,
        group_size=G,
        prompt_len=LengthDist.parse("uniform:8,24"),
        response_len=LengthDist.parse("heavy:5,1.0"),
        max_prompt_tokens=24,
        max_new_tokens=MAX_NEW,
        seed=7,
    )
    flops = 0.0
    for step in (1, 2):
        for group in source.samples(step):
            lp, lrs = len(group[0].prompt_ids), [len(s.response_ids) for s in group]
            pairs = lp * (lp + 1) // 2 + sum(r * lp + r * (r + 1) // 2 for r in lrs)
            flops += 3 * (2 * params * (lp + sum(lrs)) + 4 * hf.num_hidden_layers * hf.hidden_size * pairs)
    whole, split = (v["bench"] for v in _compare_record(compared))
    assert whole["flops_per_step"] == pytest.approx(flops / 2)
    assert split["flops_per_step"] > whole["flops_per_step"]  # split groups repeat their prompt


@pytest.mark.slow
@pytest.mark.multiproc
def test_compare_prints_ratios_against_the_first(compared):
    variants = _compare_record(compared)
    assert [v["overrides"] for v in variants] == [[f"pipeline.micro_batch_tokens={b}"] for b in BUDGETS]
    assert all(r == 1.0 for r in variants[0]["ratios"].values())
    first, second = variants[0]["bench"], variants[1]["bench"]
    assert variants[1]["ratios"]["tokens_per_s_per_device"] == pytest.approx(
        second["tokens_per_s_per_device"] / first["tokens_per_s_per_device"]
    )
    assert [v["bench"]["config"]["pipeline"]["micro_batch_tokens"] for v in variants] == list(BUDGETS)
    assert "ratio" in compared and "pipeline.micro_batch_tokens=40" in compared  # the table


@pytest.mark.slow
@pytest.mark.multiproc
def test_rollout_scope_returns_every_field(setup):
    from megatron_rl.bench import run_bench
    from megatron_rl.config import load_config

    _, config = setup
    result = run_bench(load_config(str(config), []), BenchOptions(scope="rollout", steps=1, warmup=0, platform="cpu"))
    rec = dataclasses.asdict(result)
    assert_every_field(rec, "rollout")
    assert rec["tokens"]["samples"] == PROMPTS * G and rec["tokens"]["groups"] == PROMPTS
    assert rec["tokens"]["response"] <= PROMPTS * G * MAX_NEW
    assert rec["phases"]["generation"] > 0 and rec["phases"]["train"] == 0
    assert_breakdown_sums(rec, max_idle=0.5)


def _e2e(config: str) -> dict:
    from megatron_rl.bench import run_bench
    from megatron_rl.config import load_config

    result = run_bench(load_config(config, []), BenchOptions(scope="e2e", steps=1, warmup=1, platform=TRAIN_PLATFORM))
    return dataclasses.asdict(result)


@pytest.mark.slow
@pytest.mark.multiproc
def test_e2e_scope_returns_every_field(setup):
    _, config = setup
    (rec,) = run_distributed(_e2e, 1, str(config), timeout_s=600)
    assert_every_field(rec, "e2e")
    assert rec["steps"] == 1 and rec["warmup"] == 1 and rec["devices"] == 2  # one trainer rank + one engine
    assert rec["tokens"]["samples"] == PROMPTS * G
    # the engine's recorded responses == what the loop logged as trained
    assert rec["tokens"]["response"] == rec["extra"]["logged_response_tokens"]
    if "logged_prompt_tokens" in rec["extra"]:  # once the loop logs train/prompt_tokens
        assert rec["tokens"]["prompt"] == rec["extra"]["logged_prompt_tokens"]
    assert rec["phases"]["train"] > 0
    assert_breakdown_sums(rec, max_idle=0.5)


def test_shared_prompt_attention_pairs_match_the_mask():
    """FLOPs count the allowed pairs of the shared-prompt mask (prompt once per group)."""
    from megatron_rl.attention.packing import TokenGroup, concat_groups, pack_group

    shapes = [GroupShape(prompt_len=5, response_lens=(3, 1, 4)), GroupShape(prompt_len=2, response_lens=(6,))]
    packed = concat_groups(
        [
            pack_group(
                TokenGroup(
                    prompt_ids=torch.zeros(s.prompt_len, dtype=torch.int64),
                    response_ids=tuple(torch.zeros(n, dtype=torch.int64) for n in s.response_lens),
                )
            )
            for s in shapes
        ]
    )
    mask = packed.layout.dense_mask(torch.device("cpu"))
    assert int(mask.sum()) == sum(s.attention_pairs for s in shapes)
    assert sum(s.packed_tokens for s in shapes) == packed.num_tokens


def test_length_distributions_are_clipped_and_parsed():
    import numpy as np

    rng = np.random.default_rng(0)
    heavy = LengthDist.parse("heavy:64,1.5").sample(rng, 2000, cap=256)
    assert min(heavy) >= 1 and max(heavy) == 256  # the tail reaches the cap
    assert LengthDist.parse("fixed:7").sample(rng, 3, cap=5) == [5, 5, 5]
    assert set(LengthDist.parse("uniform:2,3").sample(rng, 200, cap=9)) == {2, 3}
    with pytest.raises(ValueError, match="--prompt-len"):
        LengthDist.parse("pareto:2", flag="--prompt-len")
