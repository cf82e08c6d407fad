"""`python -m megatron_rl plan`: layout rules, parameter counts, sharding arithmetic, exit codes.

References are independent of the code under test: the published parameter counts of
Qwen2.5-7B-Instruct (7,615,616,512; its safetensors hold 15,231,233,024 bf16 bytes) and Qwen3-8B
(8,190,735,360), megatron-core's documented rank order ``tp-cp-ep-dp-pp`` (TP fastest, PP
slowest), and hand arithmetic for the optimizer / PP splits. The ±20 % check against measured
memory is `test_memory_plan.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_config
from megatron_rl.plan import LayoutError, build_plan, plan_layout

REPO = Path(__file__).resolve().parents[1]
QWEN25 = "examples/recipes/qwen2.5-7b-grpo-910b/config.yaml"
QWEN3 = "examples/recipes/qwen3-8b-dapo-h200/config.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize(
    ("path", "device", "published"), [(QWEN25, "910b", 7_615_616_512), (QWEN3, "h200", 8_190_735_360)]
)
def test_parameter_count_equals_the_published_one(path, device, published):
    cfg = load_config(path, ["parallel.tp=1"])
    plan = build_plan(cfg, nodes=2, devices_per_node=8, device=device)
    assert plan.stages[0].params == published
    # PP = 4 splits the layers; the embedding and the output layer sit on the first / last stage
    split = build_plan(
        load_config(path, ["parallel.tp=1", "parallel.pp=4"]), nodes=2, devices_per_node=8, device=device
    )
    assert sum(s.params for s in split.stages) == published
    assert split.stages[0].params > split.stages[1].params == split.stages[2].params < split.stages[3].params


def test_ranks_follow_megatron_order_tp_fastest_then_dp_then_pp():
    cfg = load_config(QWEN25, ["parallel.tp=2", "parallel.pp=2"])
    layout = plan_layout(cfg, nodes=2, devices_per_node=8)  # node 0: 4 ranks + 4 engine NPUs; node 1: 8 ranks
    assert (layout.ranks_per_node, layout.world_size, layout.dp) == ((4, 8), 12, 3)
    for r in layout.ranks:
        assert r.rank == r.tp + 2 * r.dp + 6 * r.pp
        assert (r.node, r.local_rank) == ((0, r.rank) if r.rank < 4 else (1, r.rank - 4))
    assert layout.warnings() == []
    spans = plan_layout(
        load_config(QWEN25, ['rollout.devices=["npu:4,5"]', "rollout.num_engines=1"]), nodes=3, devices_per_node=6
    )  # 4 + 6 + 6 ranks at tp 4: ranks 8-11 sit on nodes 1 and 2
    assert spans.ranks_per_node == (4, 6, 6)
    assert [w.split(":")[0] for w in spans.warnings()] == ["tp group of ranks 8-11 spans nodes [1, 2]"]


def test_distributed_optimizer_divides_the_optimizer_state_by_dp():
    def stage(*overrides):
        return build_plan(load_config(QWEN25, list(overrides)), nodes=2, devices_per_node=8, device="910b").stages[0]

    sharded, whole = stage(), stage("parallel.distributed_optimizer=false")
    assert whole.optimizer == whole.params * 12  # bf16: fp32 master + two fp32 moments
    assert sharded.optimizer == whole.optimizer // 3  # dp = 3
    assert sharded.grads == sharded.params * 4 and sharded.weights == sharded.params * 2 * 2  # policy + ref


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (['rollout.devices=["npu:2,3","npu:6,7"]'], "rollout.devices"),  # 2,3 are training devices (ids 0-3)
        (["parallel.dp=4"], "parallel.dp"),  # 12 ranks / tp 4 = dp 3
        (["parallel.pp=2"], "parallel.tp"),  # tp 4 × pp 2 = 8 does not divide 12 ranks
    ],
)
def test_impossible_layouts_name_the_key(overrides, key, capsys):
    cfg = load_config(QWEN25, overrides)
    with pytest.raises(LayoutError, match=key.replace(".", r"\.")):
        plan_layout(cfg, nodes=2, devices_per_node=8)
    assert main(["plan", QWEN25, *overrides, "--nodes", "2", "--devices-per-node", "8", "--device", "910b"]) == 2
    assert key in capsys.readouterr().err


def test_refusal_lists_only_knobs_that_fit(capsys):
    code = main(["plan", QWEN25, "pipeline.micro_batch_tokens=32768", "--nodes", "2", "--device", "910b"])
    out = capsys.readouterr().out
    assert code == 1
    knobs = [line.strip() for line in out.split("change one of:")[1].strip().splitlines()]
    assert any(k.startswith("pipeline.micro_batch_tokens=") for k in knobs)
    for knob in knobs:  # every suggestion, applied, fits
        key, value = knob.split(" fits")[0].split("=")
        if key == "model.megatron.recompute_granularity":
            extra = ["model.megatron.recompute_method=uniform", "model.megatron.recompute_num_layers=1"]
        else:
            extra = []
        fixed = load_config(QWEN25, ["pipeline.micro_batch_tokens=32768", f"{key}={value}", *extra])
        assert build_plan(fixed, nodes=2, devices_per_node=8, device="910b").fits, knob


def test_cpu_ranks_of_a_node_share_its_ram():
    from megatron_rl.plan import DeviceSpec

    cfg = load_config(QWEN25, ["attention.backend=auto"])  # split attention on the CPU

    def plan_with(ram: int):
        return build_plan(
            cfg,
            nodes=1,
            devices_per_node=8,
            device=DeviceSpec(name="cpu", kind="cpu", memory_bytes=ram, peak_tflops=None, usable_fraction=1.0),
        )

    per_rank = plan_with(1).worst.total  # 4 training ranks on the node (4 "devices" go to the engines)
    assert plan_with(4 * per_rank).fits and not plan_with(4 * per_rank - 1).fits
    assert plan_with(4 * per_rank - 1).sharers == 4
