"""check-config rules of the ``distill`` section (``config/distill_rules.py``, the teacher's files in
``config/resources.py``): each bad value is refused naming its key; the shipped example validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError
from megatron_rl.trainer.from_config import loss_settings
from tests.test_config import SMOLLM2, error, load

REPO = Path(__file__).resolve().parents[1]
TEACHER = "distill.teacher=/models/teacher"


@pytest.mark.parametrize(
    ("overrides", "keys", "words"),
    [
        (["algorithm.loss=distill"], {"distill.teacher"}, ["needs a teacher"]),
        ([TEACHER, "distill.coef=0"], {"distill.coef"}, ["> 0"]),
        ([TEACHER, "distill.concurrency=0"], {"distill.concurrency"}, ["> 0"]),
        ([TEACHER, "distill.num_engines=0"], {"distill.num_engines"}, ["> 0"]),
        ([TEACHER, "distill.tensor_parallel_size=2"], {"distill.tensor_parallel_size"}, ["hf engine"]),
        ([TEACHER, "distill.vllm={enforce_eager: true}"], {"distill.vllm"}, ["only for distill.engine 'vllm'"]),
        ([TEACHER, "distill.num_engines=2", "distill.devices=[cuda:1]"], {"distill.devices"}, ["1 entries"]),
        (
            [TEACHER, "distill.engine=vllm", "distill.tensor_parallel_size=2", "distill.devices=[cuda:1]"],
            {"distill.devices"},
            ["names 1 devices, TP is 2"],
        ),
        (
            [TEACHER, "distill.engine=vllm", "algorithm.temperature=0.7", "rollout.sampling.temperature=0.7"],
            {"distill.engine"},
            ["temperature 1 only"],
        ),
        (
            [TEACHER, "algorithm.loss=distill", "algorithm.dynamic_sampling=true"],
            {"algorithm.dynamic_sampling"},
            ["uses no reward"],
        ),
        (
            [TEACHER, "rollout.devices=[cuda:0]", "distill.engine=vllm", "distill.devices=[cuda:0]"],
            {"distill.devices"},
            ["devices of its own", "cuda:0"],
        ),
    ],
)
def test_each_distill_rule_names_its_key(tmp_path, overrides, keys, words):
    err = error(tmp_path, overrides=overrides)
    assert set(err.keys) == keys, str(err)
    for word in words:
        assert word in str(err)


def test_a_valid_distill_config_gives_the_loss_its_weight(tmp_path):
    cfg = load(tmp_path, overrides=[TEACHER, "algorithm.loss=distill", "distill.coef=0.5"])
    assert (loss_settings(cfg).kind, loss_settings(cfg).distill_coef) == ("distill", 0.5)
    assert loss_settings(load(tmp_path, overrides=["distill.coef=0.5"])).distill_coef == 0.0  # no teacher: off
    grpo = load(tmp_path, overrides=[TEACHER, "distill.coef=0.1", "distill.engine=vllm", "distill.devices=[cuda:1]"])
    assert (loss_settings(grpo).kind, loss_settings(grpo).distill_coef) == ("grpo", 0.1)


def test_check_config_names_a_missing_teacher_checkpoint(tmp_path, capsys):
    from tests.rl_fixtures import make_tiny_rl_model

    model = make_tiny_rl_model(tmp_path / "model")  # the student must exist: a fresh clone has no .cache/models
    example = str(REPO / "examples/distill_smollm2/config.yaml")
    code = main(["check-config", example, f"model.hf_path={model}", "distill.teacher=/nope/teacher"])
    assert code == 2
    assert "distill.teacher: '/nope/teacher' is not a directory" in capsys.readouterr().err


def test_the_example_validates():
    from megatron_rl.config import load_config

    cfg = load_config(REPO / "examples/distill_smollm2/config.yaml", hf_config=SMOLLM2)
    assert cfg.algorithm.loss == "distill" and cfg.distill.teacher and cfg.distill.engine == "hf"
    with pytest.raises(ConfigError):
        load_config(REPO / "examples/distill_smollm2/config.yaml", ["distill.teacher=null"], hf_config=SMOLLM2)
