"""Context parallelism on the planning side: ``parallel.cp`` rules, rank layout, memory, advice.

References are independent of the code under test: megatron-core's documented rank order
``tp-cp-ep-dp-pp`` (TP fastest, then CP), the per-layer terms of `plan/memory.py`'s docstring
table and issue 35's K / V all-gather buffer (2 · tokens · kv_heads/tp · head_dim · bytes per
layer) written out by hand with Qwen3-8B's published sizes, and the plan's own verdict on each
CP size it did not suggest (the suggestion is the smallest that fits).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError, load_config, validate_world
from megatron_rl.plan import build_plan, plan_layout
from megatron_rl.plan.longest import with_answer

REPO = Path(__file__).resolve().parents[1]
RECIPE = "examples/recipes/qwen3-8b-longcot-cp4-910b/config.yaml"
QWEN25 = "examples/recipes/qwen2.5-7b-grpo-910b/config.yaml"  # 12 training ranks on 2 × 8 910B
LAYOUT = dict(nodes=2, devices_per_node=8, device="910b")
FLAGS = ["--nodes", "2", "--devices-per-node", "8", "--device", "910b"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def _keys(overrides: list[str], path: str = RECIPE) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.keys


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["parallel.cp=0"], "parallel.cp"),
        (["model.megatron={context_parallel_size: 4}"], "model.megatron.context_parallel_size"),
        (["model.megatron={cp_comm_type: p2p}"], "model.megatron.cp_comm_type"),
    ],
)
def test_check_config_refuses_naming_the_key(overrides, key, capsys):
    assert key in _keys(overrides)
    assert main(["check-config", "--no-files", RECIPE, *overrides]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("cp", [1, 4])
def test_triton_is_accepted_with_and_without_cp(cp):
    """The triton kernel has a CP path (attention/triton_backend.triton_rows_attention)."""
    assert load_config(RECIPE, [f"parallel.cp={cp}", "attention.backend=triton"]).parallel.cp == cp


def test_world_is_tp_pp_cp_dp():
    cfg = load_config(RECIPE)  # tp 2 × cp 4
    assert validate_world(cfg, 8) == 1 and validate_world(cfg, 16) == 2
    for world, key in ((12, "parallel.cp"), (7, "parallel.tp")):  # tp 2 divides 12, not 7
        with pytest.raises(ConfigError) as info:
            validate_world(cfg, world)
        assert info.value.keys == (key,), (world, str(info.value))
    with pytest.raises(ConfigError, match=r"set parallel\.dp to 2") as info:
        validate_world(load_config(RECIPE, ["parallel.dp=3"]), 16)
    assert info.value.keys == ("parallel.dp",)


def test_ranks_follow_megatron_order_tp_then_cp_then_dp():
    lay = plan_layout(load_config(QWEN25, ["parallel.tp=2", "parallel.cp=2"]), nodes=2, devices_per_node=8)
    assert (lay.world_size, lay.tp, lay.cp, lay.dp) == (12, 2, 2, 3)
    assert all(r.rank == r.tp + 2 * r.cp + 4 * r.dp for r in lay.ranks)
    assert lay.warnings() == []  # node 0 holds ranks 0-3: one whole tp × cp block
    spans = plan_layout(load_config(RECIPE), nodes=2, devices_per_node=8)  # 4 + 4 ranks, tp 2 × cp 4
    assert [w.split(":")[0] for w in spans.warnings()] == [
        "cp group of ranks [0, 2, 4, 6] spans nodes [0, 1]",
        "cp group of ranks [1, 3, 5, 7] spans nodes [0, 1]",
    ]
    with pytest.raises(ValueError, match=r"parallel\.cp \(8\) = 16 does not divide the 8 training ranks"):
        plan_layout(load_config(RECIPE, ["parallel.cp=8"]), nodes=2, devices_per_node=8)


def _hand_layer_bytes(tokens: int, rank: int, tp: int) -> int:
    """One Qwen3-8B layer (h 4096, ffn 12288, 32 heads, 8 kv, head_dim 128, qk-norm), bf16, npu
    (flash) attention, no recompute, `rank` of `tokens` tokens on this rank."""
    h, f, nq, nkv, d, b = 4096, 12288, 32 // tp, 8 // tp, 128, 2
    norms = 2 * (rank * h * (8 + b) + 4 * rank)
    qk_norm = 8 * rank * (nq + nkv) * d + 4 * rank * (nq + nkv)
    rope = 4 * rank * d * b
    core = rank * 2 * nq * d * b + 4 * rank * nq  # q and out of the rank's rows, fp32 LSE
    gathered = 2 * tokens * nkv * d * b  # issue 35: 2 · tokens · kv_heads/tp · head_dim · bytes (cp 1: k, v)
    out_proj = rank * nq * d * b
    mlp = 5 * rank * f // tp * b
    return norms + qk_norm + rope + core + gathered + out_proj + mlp


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_activations_per_rank_equal_the_hand_computation(cp):
    tokens = 2048 + 2 * 32768
    cfg = load_config(RECIPE, [f"parallel.cp={cp}", "model.megatron={}"])  # recompute none
    plan = build_plan(cfg, **LAYOUT)
    rank = tokens // cp
    stage = plan.worst
    # 36 layers; stage 0 = last stage: token ids (8 B), final norm (fp32 x, x·rstd, rstd); the head
    # runs on the scored rows only (trainer.logprob_chunk_tokens), so the norm output is not kept
    assert stage.activations == 36 * _hand_layer_bytes(tokens, rank, tp=2) + 8 * rank + rank * 4096 * 8 + 4 * rank
    assert stage.kv_gather == (36 * 2 * tokens * 4 * 128 * 2 if cp > 1 else 0)
    assert plan.settings.response_rows == min(2 * 32768, rank)
    # the distributed optimizer shards Adam over dp × cp = 4 ranks: bf16 -> fp32 master + 2 moments
    assert stage.optimizer == stage.params * 12 // 4


def test_recompute_keeps_no_gathered_kv_and_the_budget_is_per_rank():
    full = build_plan(load_config(RECIPE), **LAYOUT).worst  # full recompute: layer inputs only
    assert full.kv_gather == 0
    assert full.activations == 36 * (67584 // 4) * 4096 * 2 + 8 * 16896 + 16896 * 4096 * 8 + 4 * 16896


def test_recipe_fits_at_cp4_and_not_at_cp1_which_suggests_the_smallest_cp(capsys):
    assert main(["plan", RECIPE, *FLAGS]) == 0
    out = capsys.readouterr().out
    assert re.search(r"total .* GiB .*: fits", out) and "tp 2 × cp 4 × pp 1 × dp 1" in out
    assert main(["plan", RECIPE, "parallel.cp=1", *FLAGS]) == 1
    out = capsys.readouterr().out
    assert re.search(r"total .* GiB .*: DOES NOT FIT", out), out
    (suggested,) = re.findall(r"parallel\.cp=(\d+) fits", out)
    suggested = int(suggested)
    assert build_plan(load_config(RECIPE, [f"parallel.cp={suggested}"]), **LAYOUT).fits
    for smaller in range(2, suggested):  # every smaller CP the 8 ranks take does not fit
        if 8 % (2 * smaller) == 0:
            assert not build_plan(load_config(RECIPE, [f"parallel.cp={smaller}"]), **LAYOUT).fits


def test_suggested_cp_is_the_smallest_that_fits_when_several_do():
    # 4 answers of 32k per micro-batch at tp 2: cp 2 does not fit, cp 4 does (8 ranks: cp in {2, 4})
    over = ["parallel.cp=1", "pipeline.micro_batch_tokens=133120"]
    plan = build_plan(load_config(RECIPE, over), **LAYOUT)
    fits = {c: build_plan(load_config(RECIPE, [*over, f"parallel.cp={c}"]), **LAYOUT).fits for c in (2, 4)}
    smallest = min(c for c, ok in fits.items() if ok)
    assert [a for a in plan.advice if a.startswith("parallel.cp=")] == [
        a for a in plan.advice if a.startswith(f"parallel.cp={smallest} fits")
    ]
    assert any(a.startswith(f"parallel.cp={smallest} fits") for a in plan.advice), plan.advice


@pytest.mark.slow
def test_longest_answer_tool_prints_one_json_line_at_the_fit_boundary():
    out = subprocess.run(
        [sys.executable, "tools/longest_answer.py", RECIPE, *FLAGS, "--cp", "1,4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = out.strip().splitlines()
    found = {int(k): v for k, v in json.loads(line)["longest_answer_tokens"].items()}
    cfg = load_config(RECIPE)
    for cp, answer in found.items():
        assert build_plan(with_answer(cfg, cp=cp, answer=answer), **LAYOUT).fits
        assert not build_plan(with_answer(cfg, cp=cp, answer=answer + 1), **LAYOUT).fits
    assert found[4] > 3 * found[1] > 3 * 32768  # CP 4 holds a ~4x longer answer; CP 1 holds 32k
