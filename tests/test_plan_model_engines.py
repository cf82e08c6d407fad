"""`plan` places the teacher's, judge's and reward model's engines and counts their memory.

Hand references: Qwen3-8B's published parameter count (8,190,735,360; untied LM head) and
Qwen2.5-7B-Instruct's (7,615,616,512) minus its LM head (152,064 × 3,584) plus a one-logit
score head (3,584) for a reward model; the KV cache written out from config.json's sizes
(layers, KV heads, head_dim) and the recipe's token caps. Placement refusals name the key, in
`plan` (exit 2) and in check-config; a device the engines do not fit is refused (exit 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_config
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema_reward_model import DEFAULT_JUDGE_TEMPLATE
from megatron_rl.plan import LayoutError, plan_layout
from megatron_rl.plan.devices import DEVICES
from megatron_rl.plan.model_engines import fit_problems, model_engines

REPO = Path(__file__).resolve().parents[1]
QWEN3 = "examples/recipes/qwen3-8b-dapo-h200/config.yaml"  # rollout on cuda:4,5 / 6,7 of node 0
QWEN3_DIR = "examples/recipes/configs/qwen3-8b"
QWEN25_DIR = "examples/recipes/configs/qwen2.5-7b-instruct"
TOKENS = 1024 + 4096  # the recipe's data.max_prompt_tokens + rollout.sampling.max_new_tokens
RUBRIC = "10 if the final answer equals the reference answer, else 0."  # reward.judge.rubric's default
TEACHER = [f"distill.teacher={QWEN3_DIR}", "distill.engine=vllm", "distill.tensor_parallel_size=2"]
JUDGE = [
    "reward.kind=combined",
    "reward.weights={function: 1.0, judge: 0.5, model: 0.5}",
    f"reward.judge.model={QWEN3_DIR}",
]
MODEL = [f"reward.model.path={QWEN25_DIR}", "reward.model.dtype=bfloat16"]
# 12 GPUs: rollout 4-7, reward model 8, judge 9, teacher 10-11: training keeps 0-3
PLACED = [*TEACHER, 'distill.devices=["cuda:10,11"]', *JUDGE, "reward.judge.devices=[cuda:9]", *MODEL]
PLACED += ["reward.model.devices=[cuda:8]"]
NODE = ["--nodes", "1", "--devices-per-node", "12", "--device", "h200"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def kv(batch, tokens, layers, kv_heads, head_dim, width):
    return batch * tokens * 2 * layers * kv_heads * head_dim * width


def test_engines_are_sized_by_hand():
    cfg = load_config(QWEN3, PLACED)
    teacher, judge, rm = model_engines(cfg)
    assert (teacher.role, teacher.ids, judge.ids, rm.ids) == ("teacher", (10, 11), (9,), (8,))
    assert teacher.params == judge.params == 8_190_735_360
    assert teacher.weights_bytes == 8_190_735_360 * 2 // 2  # bf16 over TP 2
    assert teacher.kv_bytes == kv(256, TOKENS, 36, 8 // 2, 128, 2)  # distill.max_batch_size 256
    judged = TOKENS + len(DEFAULT_JUDGE_TEMPLATE) + len(RUBRIC) + 64  # + reward.judge.max_new_tokens
    assert judge.weights_bytes == 8_190_735_360 * 2 and judge.kv_bytes == kv(64, judged, 36, 8, 128, 2)
    assert rm.params == 7_615_616_512 - 152_064 * 3_584 + 3_584
    assert rm.weights_bytes == rm.params * 2 and rm.kv_bytes == kv(16, TOKENS, 28, 4, 128, 2)


def test_plan_text_and_json_show_the_engines_and_take_their_devices(capsys):
    args = ["plan", QWEN3, *PLACED, *NODE]
    assert main(args) in (0, 1)
    text = capsys.readouterr().out
    assert "NPROC_PER_NODE=4, training devices 0-3" in text  # the model engines' GPUs are not training's
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("teacher 0"))
    assert "devices 10,11" in line and f"{8_190_735_360 * 2 // 2 / 2**30:.2f} GiB" in line
    main([*args, "--json"])
    out = json.loads(capsys.readouterr().out)
    engines = {(e["role"], tuple(e["ids"])): e for e in out["model_engines"]}
    assert set(engines) == {("teacher", (10, 11)), ("judge", (9,)), ("reward model", (8,))}
    assert engines[("judge", (9,))]["total_bytes"] == 8_190_735_360 * 2 + engines[("judge", (9,))]["kv_bytes"]
    assert out["layout"]["ranks_per_node"] == [4]


ON_8 = [*MODEL, "reward.model.devices=[cuda:8]"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([*TEACHER, 'distill.devices=["cuda:4,5"]'], "distill.devices"),  # a rollout engine's GPUs
        ([*TEACHER, 'distill.devices=["cuda:10,11"]', *JUDGE, "reward.judge.devices=[cuda:11]", *ON_8], "judge"),
        ([*JUDGE, "reward.judge.devices=[cuda:8]", *ON_8], "reward.model.devices"),  # the judge's GPU
    ],
)
def test_check_config_refuses_shared_devices_naming_the_key(overrides, key, capsys):
    key = "reward.judge.devices" if key == "judge" else key
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*devices of its own"):
        load_config(QWEN3, overrides)
    assert main(["check-config", "--no-files", QWEN3, *overrides]) != 0
    out = capsys.readouterr()
    assert key in out.out + out.err


@pytest.mark.parametrize(
    "device",
    ["cuda:12", "cuda:0"],  # absent (a node has 12), a training GPU (0-3 stay training's)
)
def test_plan_refuses_engines_off_the_node_or_on_training_devices(device, capsys):
    overrides = [*JUDGE, "reward.judge.devices=[cuda:9]", *MODEL, f"reward.model.devices=[{device}]"]
    cfg = load_config(QWEN3, overrides)
    with pytest.raises(LayoutError, match=r"reward\.model\.devices"):
        plan_layout(cfg, nodes=1, devices_per_node=12)
    assert main(["plan", QWEN3, *overrides, *NODE]) == 2
    assert "reward.model.devices" in capsys.readouterr().err


def test_engines_that_do_not_fit_their_device_are_refused(capsys):
    big = [*PLACED, "reward.model.batch=4096"]
    engines = model_engines(load_config(QWEN3, big))
    rm = next(e for e in engines if e.role == "reward model")
    assert rm.kv_bytes == kv(4096, TOKENS, 28, 4, 128, 2) > DEVICES["h200"].usable_bytes  # ~1.2 TB of KV
    assert [p.split(":")[0] for p in fit_problems(engines, DEVICES["h200"])] == ["reward.model.devices"]
    assert main(["plan", QWEN3, *big, *NODE]) == 1
    assert "refused: reward.model.devices" in capsys.readouterr().out
