"""Config loading, overrides and validation: every class of bad input names its key and place.

Expected values come from the spec (the issue) or from the YAML text written in each test,
never from the loader's own output.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
    validate_world,
)

REPO = Path(__file__).resolve().parents[1]

# SmolLM2-135M's config.json (the fields that matter), so tests need no checkpoint on disk.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "intermediate_size": 1536,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}

MINIMAL = """\
model:
  hf_path: /models/smollm2
data:
  source: reasoning_gym:basic_arithmetic
trainer:
  steps: 3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str = MINIMAL, overrides=(), hf=SMOLLM2) -> Config:
    return load_config(write(tmp_path, text), overrides, hf_config=hf)


def error(tmp_path: Path, text: str = MINIMAL, overrides=(), hf=SMOLLM2) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides, hf)
    return info.value


def line_of(text: str, fragment: str) -> int:
    """1-based line of the first line of `text` containing `fragment`."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


# ---- the shipped examples -------------------------------------------------------------------

# The SmolLM2 examples; the device recipes (examples/recipes/) are validated against their own
# models' config.json in tests/test_recipes.py.
EXAMPLES = sorted(p for p in REPO.glob("examples/**/*.yaml") if "recipes" not in p.parts)


def test_examples_exist():
    names = {p.parent.name for p in EXAMPLES}
    assert {"grpo_smollm2", "dapo_smollm2", "ppo_stale_smollm2"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_loads_and_validates(path):
    # an MoE example (routing replay) gets SmolLM2 upcycled to 4 experts, as prepare_model makes it
    moe = "routing_replay: rollout" in path.read_text()
    cfg = load_config(path, hf_config={**SMOLLM2, "num_local_experts": 4, "num_experts_per_tok": 2} if moe else SMOLLM2)
    assert isinstance(cfg, Config)
    for world in (1, 2):
        assert validate_world(cfg, world * cfg.parallel.tp * cfg.parallel.pp) == world


def test_example_recipes_say_what_they_are():
    stale = load_config(REPO / "examples/ppo_stale_smollm2/config.yaml", hf_config=SMOLLM2)
    assert (stale.pipeline.mode, stale.algorithm.proximal) == ("stale", "loglinear")
    assert stale.algorithm.loss == "ppo_decoupled"
    dapo = load_config(REPO / "examples/dapo_smollm2/config.yaml", hf_config=SMOLLM2)
    assert dapo.algorithm.loss == "dapo" and dapo.algorithm.clip.high > dapo.algorithm.clip.low
    grpo = load_config(REPO / "examples/grpo_smollm2/config.yaml", hf_config=SMOLLM2)
    assert (grpo.algorithm.loss, grpo.data.source) == ("grpo", "reasoning_gym:basic_arithmetic")
    assert grpo.model.hf_path == ".cache/models/smollm2-135m-instruct"


# ---- defaults, types, scientific notation ---------------------------------------------------


# Defaults as the issue specifies them (written out here, not read from the schema).
SPEC_DEFAULTS = {
    "model.dtype": "bfloat16", "model.make_vocab_size_divisible_by": 128, "model.megatron": {},
    "parallel.tp": 1, "parallel.pp": 1, "parallel.dp": None, "parallel.distributed_optimizer": False,
    "attention.backend": "auto",
    "algorithm.loss": "grpo", "algorithm.advantage.scale": "group", "algorithm.advantage.eps": 1e-6,
    "algorithm.clip.low": 0.2, "algorithm.clip.high": 0.2, "algorithm.overlong.enabled": False,
    "algorithm.proximal": "recompute", "algorithm.behav_weight_cap": None, "algorithm.kl.coef": 0.0,
    "algorithm.kl.estimator": "k3", "algorithm.temperature": 1.0,
    "rollout.engine": "hf", "rollout.num_engines": 1, "rollout.devices": [], "rollout.vllm": {},
    "rollout.sampling.top_p": 1.0, "rollout.sampling.max_new_tokens": 256, "rollout.sampling.stop": [],
    "pipeline.mode": "periodic", "pipeline.max_staleness": 0, "pipeline.queue_size": 64,
    "pipeline.micro_batch_tokens": 4096, "control.kind": "fixed", "control.group_size": 8,
    "control.sagc.candidates": [4, 8, 16], "control.sagc.tau": 3.0, "control.sagc.gamma": 0.99,
    "data.prompt_key": "question", "data.answer_key": "answer", "data.size": 1000,
    "data.chat_template": True, "reward.fn": "math_verify", "trainer.prompts_per_batch": 8,
    "trainer.mini_batches": 1, "trainer.lr": 1e-6, "trainer.adam_beta2": 0.999, "trainer.seed": 1234,
    "trainer.save_dir": None, "trainer.offload_reference": False,
}  # fmt: skip


def test_minimal_config_gets_the_documented_defaults(tmp_path):
    cfg = load(tmp_path)
    assert (cfg.model.hf_path, cfg.trainer.steps) == ("/models/smollm2", 3)
    got = {key: functools.reduce(getattr, key.split("."), cfg) for key in SPEC_DEFAULTS}
    assert got == SPEC_DEFAULTS


def test_scientific_notation_and_ints_are_floats(tmp_path):
    text = MINIMAL.replace("steps: 3", "steps: 3\n  lr: 3e-6\n  weight_decay: 1\n  grad_clip: 1.5E+1")
    text += "algorithm:\n  advantage: {eps: 1.0e8}\n"
    cfg = load(
        tmp_path, text, ["algorithm.kl.coef=2e-3", "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=5e-1"]
    )
    assert cfg.rollout.vllm == {"gpu_memory_utilization": 0.5}  # pass-through values are YAML 1.2 floats too
    values = (
        cfg.trainer.lr,
        cfg.trainer.weight_decay,
        cfg.trainer.grad_clip,
        cfg.algorithm.advantage.eps,
        cfg.algorithm.kl.coef,
    )
    assert values == (3e-6, 1.0, 15.0, 1e8, 0.002)
    assert all(type(v) is float for v in values)


def test_empty_section_means_defaults(tmp_path):
    cfg = load(tmp_path, MINIMAL + "algorithm:\nrollout:\n  vllm:\n")
    assert cfg.algorithm.loss == "grpo" and cfg.rollout.vllm == {}


@pytest.mark.parametrize(
    "snippet, key, words",
    [
        ("trainer:\n  steps: ten\n", "trainer.steps", ["int", "'ten'"]),
        ("trainer:\n  steps: true\n", "trainer.steps", ["int", "bool"]),
        ("trainer:\n  steps: 2.5\n", "trainer.steps", ["int", "2.5"]),
        ("trainer:\n  steps: 3\n  lr: fast\n", "trainer.lr", ["float", "'fast'"]),
        ("trainer:\n  steps: 3\n  save_dir: 7\n", "trainer.save_dir", ["str", "7"]),
        ("trainer:\n  steps: 3\nalgorithm:\n  dynamic_sampling: 1\n", "algorithm.dynamic_sampling", ["bool", "1"]),
        (
            "trainer:\n  steps: 3\nmodel:\n  hf_path: /m\n  dtype: bfloat61\n",
            "model.dtype",
            ["did you mean 'bfloat16'"],
        ),
        (
            "trainer:\n  steps: 3\ncontrol:\n  sagc:\n    candidates: [4, x]\n",
            "control.sagc.candidates[1]",
            ["int", "'x'"],
        ),
        ("trainer:\n  steps: 3\nrollout:\n  devices: cuda:0\n", "rollout.devices", ["list"]),
        ("trainer:\n  steps: 3\nrollout:\n  vllm: 0.9\n", "rollout.vllm", ["mapping"]),
        ("trainer:\n  steps: 3\nparallel: 4\n", "parallel", ["mapping"]),
    ],
)
def test_wrong_types_name_the_key_and_line(tmp_path, snippet, key, words):
    base = MINIMAL.split("trainer:")[0].replace("model:\n  hf_path: /models/smollm2\n", "")
    text = base + snippet
    if "hf_path" not in snippet:
        text = "model:\n  hf_path: /models/smollm2\n" + text
    err = error(tmp_path, text)
    assert err.keys == (key,)
    leaf = key.split(".")[-1].split("[")[0] + ":"
    line = line_of(text, leaf) if not key.endswith("]") else line_of(text, "candidates")
    assert f"config.yaml:{line}: {key}: " in str(err)
    for word in words:
        assert word in str(err)


# ---- unknown, missing and duplicate keys ----------------------------------------------------


def test_unknown_key_gives_line_and_suggestion(tmp_path):
    text = MINIMAL + "algorithm:\n  loss: dapo\n  clip:\n    low: 0.2\n    hihg: 0.28\n"
    err = error(tmp_path, text)
    assert err.keys == ("algorithm.clip.hihg",)
    where = f"{tmp_path / 'config.yaml'}:{line_of(text, 'hihg')}"
    assert str(err) == f"{where}: algorithm.clip.hihg: unknown key (did you mean 'high'?)"


def test_unknown_section_and_all_problems_reported_together(tmp_path):
    text = MINIMAL + "algorithmz:\n  loss: grpo\ntrainer_extra: 1\n"
    err = error(tmp_path, text)
    assert set(err.keys) == {"algorithmz", "trainer_extra"}
    assert "did you mean 'algorithm'" in str(err)


@pytest.mark.parametrize(
    "drop, key",
    [
        ("  hf_path: /models/smollm2\n", "model.hf_path"),
        ("  source: reasoning_gym:basic_arithmetic\n", "data.source"),
        ("  steps: 3\n", "trainer.steps"),
        ("trainer:\n  steps: 3\n", "trainer"),
    ],
)
def test_missing_required_key(tmp_path, drop, key):
    err = error(tmp_path, MINIMAL.replace(drop, ""))
    assert err.keys == (key,)
    assert "missing required" in str(err)


def test_duplicate_key_is_an_error(tmp_path):
    text = MINIMAL + "parallel:\n  tp: 1\n  tp: 3\n"
    err = error(tmp_path, text)
    assert err.keys == ("parallel.tp",)
    assert "duplicate" in str(err) and f"line {line_of(text, 'tp: 1')}" in str(err)


def test_yaml_syntax_error_gives_a_line(tmp_path):
    text = MINIMAL + "parallel:\n  tp: [1, 2\n"
    assert "config.yaml:" in str(error(tmp_path, text)) and "invalid YAML" in str(error(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


# ---- command-line overrides -----------------------------------------------------------------


def test_overrides_parse_yaml_scalars(tmp_path):
    cfg = load(
        tmp_path,
        overrides=[
            "parallel.tp=3",
            "control.kind=sagc",
            "control.sagc.candidates=[4,8]",
            "control.group_size=4",
            "trainer.save_dir=null",
            "rollout.engine=vllm",
            "rollout.vllm.gpu_memory_utilization=0.5",
            "trainer.lr=2e-5",
            "algorithm.clip={low: 0.1, high: 0.3}",
            "rollout.sampling.stop=['</answer>']",
        ],
    )
    assert cfg.parallel.tp == 3 and cfg.control.sagc.candidates == [4, 8] and cfg.trainer.save_dir is None
    assert cfg.rollout.vllm == {"gpu_memory_utilization": 0.5} and cfg.trainer.lr == 2e-5
    assert (cfg.algorithm.clip.low, cfg.algorithm.clip.high) == (0.1, 0.3)
    assert cfg.rollout.sampling.stop == ["</answer>"]


def test_override_wins_over_file_and_later_override_wins(tmp_path):
    text = MINIMAL.replace("steps: 3", "steps: 3\n  lr: 1e-6")
    assert load(tmp_path, text, ["trainer.lr=1e-4", "trainer.lr=5e-5"]).trainer.lr == 5e-5


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("algorithm.clip.hihg=0.3", "algorithm.clip.hihg", ["did you mean 'high'"]),
        ("trainr.steps=4", "trainr", ["did you mean 'trainer'"]),
        ("trainer.lr.x=1", "trainer.lr", ["not a section"]),
        ("trainer.steps", "trainer.steps", ["key=value"]),
        ("trainer.steps=four", "trainer.steps", ["int", "'four'"]),
        ("trainer.steps=[1", "trainer.steps", ["not valid YAML"]),
    ],
)
def test_bad_overrides_name_the_path_and_command_line(tmp_path, override, key, words):
    err = error(tmp_path, overrides=[override])
    assert err.keys == (key,)
    assert str(err).startswith(f"command line: {key}: ")
    for word in words:
        assert word in str(err)


def test_overriding_a_file_section_moves_its_errors_to_the_command_line(tmp_path):
    text = MINIMAL + "algorithm:\n  clip:\n    low: 0.2\n    high: 0.2\n"
    err = error(tmp_path, text, ["algorithm.clip={low: 0.3, high: 0.1}"])
    assert err.keys == ("algorithm.clip.high",) and str(err).startswith("command line: algorithm.clip.high:")


# ---- cross-field rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, keys, words",
    [
        (["parallel.tp=2"], {"parallel.tp"}, ["num_attention_heads (9)", "valid tp: [1, 3]"]),
        (["parallel.tp=9"], {"parallel.tp"}, ["num_key_value_heads (3)", "intermediate_size (1536)"]),
        (["parallel.pp=4"], {"parallel.pp"}, ["num_hidden_layers (30)"]),
        (["parallel.tp=0"], {"parallel.tp"}, ["> 0"]),
        (["pipeline.mode=stale"], {"pipeline.max_staleness", "algorithm.loss"}, ["ppo_decoupled"]),
        (["pipeline.max_staleness=2"], {"pipeline.max_staleness"}, ["'stale'", "'periodic'"]),
        (
            ["pipeline.mode=sync", "pipeline.max_staleness=1", "algorithm.loss=ppo_decoupled"],
            {"pipeline.max_staleness"},
            ["'sync'"],
        ),
        (["algorithm.clip.low=1.5", "algorithm.clip.high=2"], {"algorithm.clip.low"}, ["(0, 1)", "1.5"]),
        (["algorithm.clip.low=0"], {"algorithm.clip.low"}, ["(0, 1)"]),
        (["algorithm.clip.high=0.1"], {"algorithm.clip.high"}, ["algorithm.clip.low (0.2)"]),
        (["algorithm.overlong.enabled=true"], {"algorithm.overlong.buffer"}, ["max_new_tokens (256)"]),
        (["algorithm.overlong={enabled: true, buffer: 256}"], {"algorithm.overlong.buffer"}, ["got 256"]),
        (
            ["control.kind=sagc", "control.group_size=6"],
            {"control.group_size"},
            ["control.sagc.candidates [4, 8, 16]"],
        ),
        (["control.kind=sacg"], {"control.kind"}, ["did you mean 'sagc'"]),
        (["control.group_size=1"], {"control.group_size"}, ["< 2"]),
        (["algorithm.advantage.scale=batch"], {"algorithm.advantage.scale"}, ["defeats periodic"]),
        (
            ["pipeline.micro_batch_tokens=300"],
            {"pipeline.micro_batch_tokens"},
            ["data.max_prompt_tokens (512) + rollout.sampling.max_new_tokens (256) = 768"],
        ),
        (
            ["environment.kind=echo", "environment.max_total_tokens=8192"],
            {"pipeline.micro_batch_tokens"},
            ["environment.max_total_tokens (8192)", "a whole trajectory"],
        ),
        (["rollout.sync_bucket_mb=0"], {"rollout.sync_bucket_mb"}, ["> 0"]),
        (["rollout.generator=single-turn"], {"rollout.generator"}, ["did you mean 'single_turn'"]),
        (["rollout.generator=multi_turn"], {"rollout.generator"}, ["needs an environment"]),
        (["rollout.generator=single_turn", "environment.kind=echo"], {"rollout.generator"}, ["'echo'"]),
        (
            ["control.kind=sagc", "control.sagc.candidates=[1, 4]", "control.group_size=4"],
            {"control.sagc.candidates"},
            ["< 2"],
        ),
        (
            ["control.kind=sagc", "control.sagc.candidates=[8, 4]"],
            {"control.sagc.candidates"},
            ["increasing"],
        ),
        (["control.options={depth: 2}"], {"control.options"}, ["dotted-path"]),
        (
            ["trainer.prompts_per_batch=6", "trainer.mini_batches=4"],
            {"trainer.mini_batches"},
            ["4 does not divide trainer.prompts_per_batch (6)"],
        ),
        (
            ["rollout.sampling.temperature=0", "algorithm.temperature=0"],
            {"rollout.sampling.temperature", "algorithm.temperature"},
            ["> 0"],
        ),
        (["algorithm.temperature=0.7"], {"algorithm.temperature"}, ["rollout.sampling.temperature (1.0)"]),
        (["rollout.sampling.top_p=1.5"], {"rollout.sampling.top_p"}, ["(0, 1]"]),
        (["trainer.save_every=10"], {"trainer.save_every"}, ["trainer.save_dir"]),
        (["rollout.devices=[cuda:4, cuda:5, cuda:6]", "rollout.num_engines=1"], {"rollout.devices"}, ["= 1"]),
        (
            ["rollout.devices=[cuda:0, cuda:1]", "rollout.tensor_parallel_size=2", "rollout.engine=vllm"],
            {"rollout.devices"},
            ["one device string per engine", "'cuda:0,1'"],
        ),
        (
            ["rollout.devices=['cuda:0,1,2']", "rollout.tensor_parallel_size=2", "rollout.engine=vllm"],
            {"rollout.devices"},
            ["names 3 devices", "tensor_parallel_size = 2"],
        ),
        (["rollout.devices=[gpu:0]"], {"rollout.devices"}, ["must start with one of"]),
        (
            ["rollout.devices=[cpu:1]", "rollout.tensor_parallel_size=2", "rollout.engine=vllm"],
            {"rollout.tensor_parallel_size"},
            ["use 1 on CPU"],
        ),
        (["rollout.tensor_parallel_size=2"], {"rollout.tensor_parallel_size"}, ["hf engine runs one device"]),
        (
            ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"],
            {"rollout.tensor_parallel_size"},
            ["CPU engine 'cpu'", "use 1 on CPU"],
        ),
        (["rollout.vllm={max_model_len: 64}"], {"rollout.vllm"}, ["only for rollout.engine 'vllm'", "'hf'"]),
        (["rollout.max_batch_size=0"], {"rollout.max_batch_size"}, ["> 0"]),
        (["algorithm.behav_weight_cap=0.5"], {"algorithm.behav_weight_cap"}, ["> 1"]),
        (["data.source=prompts.csv"], {"data.source"}, ["reasoning_gym:<dataset>"]),
        (["data.source=prompts.jsonl", "data.options={min_terms: 2}"], {"data.options"}, ["reasoning_gym dataset"]),
        (["reward.fn=my pkg:fn"], {"reward.fn"}, ["pkg.mod:function"]),
        (["reward.kind=model"], {"reward.model.path"}, ["reward model", "checkpoint directory"]),
        (["reward.kind=judge"], {"reward.judge.model"}, ["LLM judge", "checkpoint directory"]),
        (
            ["reward.kind=judge", "reward.judge.model=/j", "reward.judge.parser=scores"],
            {"reward.judge.parser"},
            ["did you mean 'score'"],
        ),
        (
            ["reward.kind=judge", "reward.judge.model=/j", "reward.judge.template='grade {response} {answer}'"],
            {"reward.judge.template"},
            ["unknown placeholder {answer}", "no {question} placeholder", "no {rubric} placeholder"],
        ),
        (
            ["reward.kind=combined", "reward.weights={function: 1.0, judgee: 0.5}"],
            {"reward.weights"},
            ["'judgee'", "did you mean 'judge'"],
        ),
        (["reward.weights={function: 1.0}"], {"reward.weights"}, ["only for reward.kind 'combined'"]),
        (["reward.kind=combined"], {"reward.weights"}, ["needs a weight per component"]),
        (
            ["reward.kind=model", "reward.model.path=/rm", "reward.model.devices=['cuda:0,1']"],
            {"reward.model.devices"},
            ["one device"],
        ),
        (
            ["reward.kind=judge", "reward.judge.model=/j", "reward.judge.max_new_tokens=0"],
            {"reward.judge.max_new_tokens"},
            ["> 0"],
        ),
        (["control.sagc.delta=1.5"], {"control.sagc.delta"}, ["(0, 1)"]),
        (["lora.rank=-1"], {"lora.rank"}, [">= 0"]),
        (["lora.rank=8", "lora.alpha=0"], {"lora.alpha"}, ["> 0"]),
        (["lora.rank=8", "lora.dropout=1.0"], {"lora.dropout"}, ["[0, 1)"]),
        (["lora.rank=8", "lora.target_modules=[]"], {"lora.target_modules"}, ["is empty"]),
        (["lora.rank=8", "lora.target_modules=[q_proj]"], {"lora.target_modules"}, ["use 'linear_qkv'"]),
        (["lora.rank=8", "lora.target_modules=[linear_qvk]"], {"lora.target_modules"}, ["did you mean 'linear_qkv'"]),
        (["lora.target_modules=[linear_fc1, linear_fc1]"], {"lora.target_modules"}, ["twice"]),
        (["lora.rank=8", "trainer.offload_reference=true"], {"trainer.offload_reference"}, ["no copy to offload"]),
        (["lora.rank=8", "trainer.offload_old=true"], {"trainer.offload_old"}, ["no copy to offload"]),
        (["lora.rank=8", "algorithm.routing_replay=rollout"], {"algorithm.routing_replay"}, ["LoRA on an MoE"]),
    ],
)
def test_cross_field_rules_name_their_keys(tmp_path, overrides, keys, words):
    err = error(tmp_path, overrides=overrides)
    assert set(err.keys) == keys
    for key in keys:
        assert f"{key}: " in str(err)
    for word in words:
        assert word in str(err)


def test_valid_corner_cases_pass(tmp_path):
    ok = [
        ["parallel.tp=3", "parallel.pp=5"],
        ["pipeline.mode=stale", "pipeline.max_staleness=1", "algorithm.loss=ppo_decoupled"],
        ["algorithm.clip={low: 0.2, high: 0.28}"],
        [
            "control.kind=my_pkg.controllers:Greedy",
            "control.options={depth: 2}",
            "reward.fn=my_pkg.rewards:exact",
        ],
        ["control.kind=sagc", "control.sagc.candidates=[2, 4]", "control.group_size=2"],
        ["reward.kind=combined", "reward.weights={function: 1.0, model: 0.5}", "reward.model.path=/rm"],
        ["reward.kind=judge", "reward.judge.model=/j", "reward.judge.parser=my_pkg.parsers:grade"],
        ["lora.rank=8", "lora.target_modules=[linear_qkv, linear_proj]", "algorithm.kl.coef=0.1"],
        [
            "data.source=/data/train.parquet",
            "rollout.devices=['npu:0,1', 'npu:2-3']",
            "rollout.engine=vllm",
            "rollout.num_engines=2",
            "rollout.tensor_parallel_size=2",
        ],
    ]
    for overrides in ok:
        load(tmp_path, overrides=overrides)


def test_cross_field_error_points_at_the_file_line(tmp_path):
    text = MINIMAL + "pipeline:\n  mode: periodic\n  max_staleness: 3\n"
    err = error(tmp_path, text)
    assert str(err).startswith(f"{tmp_path / 'config.yaml'}:{line_of(text, 'max_staleness')}: pipeline.max_staleness:")


def test_megatron_passthrough_names_are_checked(tmp_path):
    good = load(tmp_path, overrides=["model.megatron.recompute_granularity=full"])
    assert good.model.megatron == {"recompute_granularity": "full"}
    err = error(
        tmp_path,
        overrides=["model.megatron.recompute_granularty=full", "model.megatron.tensor_model_parallel_size=2"],
    )
    assert set(err.keys) == {
        "model.megatron.recompute_granularty",
        "model.megatron.tensor_model_parallel_size",
    }
    assert "did you mean 'recompute_granularity'" in str(err) and "parallel.tp" in str(err)


def test_lora_on_an_moe_model_is_refused(tmp_path):
    moe = {**SMOLLM2, "num_local_experts": 4, "num_experts_per_tok": 2}
    err = error(tmp_path, overrides=["lora.rank=8"], hf=moe)
    assert "lora.rank" in err.keys and "MoE model" in str(err)
    assert load(tmp_path, overrides=["lora.rank=0"], hf=moe).lora.rank == 0


# ---- model.hf_path/config.json --------------------------------------------------------------


def test_model_shape_read_from_hf_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    text = MINIMAL.replace("/models/smollm2", str(model))
    assert load(tmp_path, text, ["parallel.tp=3"], hf=None).parallel.tp == 3
    err = error(tmp_path, text, ["parallel.pp=7"], hf=None)
    assert err.keys == ("parallel.pp",) and f"{model}/config.json" in str(err)


@pytest.mark.parametrize(
    "setup, words",
    [
        ("none", "not a directory"),
        ("empty", "no config.json"),
        ("garbage", "not valid JSON"),
        ("no_layers", "num_hidden_layers"),
    ],
)
def test_bad_hf_path_names_model_hf_path(tmp_path, setup, words):
    model = tmp_path / "model"
    if setup != "none":
        model.mkdir()
    if setup == "garbage":
        (model / "config.json").write_text("{not json")
    if setup == "no_layers":
        (model / "config.json").write_text(json.dumps({k: v for k, v in SMOLLM2.items() if k != "num_hidden_layers"}))
    text = MINIMAL.replace("/models/smollm2", str(model))
    err = error(tmp_path, text, hf=None)
    assert err.keys == ("model.hf_path",) and words in str(err)
    assert str(err).startswith(f"{tmp_path / 'config.yaml'}:{line_of(text, 'hf_path')}: model.hf_path:")


# ---- world size, round trip -----------------------------------------------------------------


def test_validate_world(tmp_path):
    cfg = load(tmp_path, overrides=["parallel.tp=3", "parallel.pp=2"])
    assert validate_world(cfg, 12) == 2
    with pytest.raises(ConfigError, match=r"parallel\.tp \(3\) × parallel\.pp \(2\) = 6 does not divide world size 9"):
        validate_world(cfg, 9)
    cfg = load(tmp_path, overrides=["parallel.tp=3", "parallel.dp=3"])
    assert validate_world(cfg, 9) == 3
    with pytest.raises(ConfigError) as info:
        validate_world(cfg, 12)
    assert info.value.keys == ("parallel.dp",) and "set parallel.dp to 4" in str(info.value)


def test_round_trip_dict_and_yaml(tmp_path):
    cfg = load_config(
        REPO / "examples/ppo_stale_smollm2/config.yaml",
        ["model.megatron.recompute_granularity=full"],
        hf_config=SMOLLM2,
    )
    plain = config_to_dict(cfg)
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # plain data only
    assert config_from_dict(plain, hf_config=SMOLLM2) == cfg
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml", hf_config=SMOLLM2) == cfg
    plain["trainer"]["lr"] = 0.5  # the dict is a copy
    assert cfg.trainer.lr != 0.5


def test_config_is_frozen_and_keyword_only(tmp_path):
    cfg = load(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.lr = 1.0
    with pytest.raises(TypeError):
        type(cfg.parallel)(2)


def test_config_from_dict_does_not_touch_its_input():
    data = yaml.safe_load(MINIMAL)
    cfg = config_from_dict(data, ["trainer.steps=9"], hf_config=SMOLLM2)
    assert cfg.trainer.steps == 9 and data["trainer"]["steps"] == 3


def test_sagc_config_defaults_match_the_controller_settings():
    import dataclasses

    from megatron_rl.config.schema import SAGCConfig
    from megatron_rl.control import SAGCSettings

    settings = SAGCSettings()
    for field in dataclasses.fields(SAGCConfig):
        expected = getattr(settings, field.name)
        got = getattr(SAGCConfig(), field.name)
        assert list(got) == list(expected) if field.name == "candidates" else got == expected, field.name
