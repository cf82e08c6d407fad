"""Weight files every stage's writer can reach (issue 29, defect 6): ``snapshot`` made its
directory in global rank 0's /dev/shm only, so a pipeline stage on another node failed at its
first sync (FileNotFoundError; the qwen3-30b-a3b-910b recipe: PP 3 over 2 nodes). check-config
refuses such a layout naming ``rollout.snapshot_dir`` (or 'broadcast'); at launch the stage
writers' real nodes are checked; with ``rollout.snapshot_dir`` every rank gets one directory
there. Two nodes are simulated in a 2-rank world at PP 2: a node id and a /dev/shm of their own."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.weight_files import validate_writer_nodes
from tests.distributed import run_distributed

RECIPE = "examples/recipes/qwen3-30b-a3b-910b/config.yaml"  # snapshot, pp 3, 2 nodes


def _load(monkeypatch, nodes: str | None, *overrides: str):
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    if nodes is None:
        monkeypatch.delenv("NNODES", raising=False)
    else:
        monkeypatch.setenv("NNODES", nodes)
    return load_config(RECIPE, list(overrides))


def test_check_config_refuses_snapshot_stages_over_nodes_without_a_shared_dir(monkeypatch):
    with pytest.raises(ConfigError, match=r"rollout\.snapshot_dir: unset, but parallel.pp = 3 stages over .* 2 nodes"):
        _load(monkeypatch, "2")
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync: 'shared_memory' needs every stage's writer"):
        _load(monkeypatch, "2", "rollout.weight_sync=shared_memory")
    assert _load(monkeypatch, "2", "rollout.snapshot_dir=/mnt/shared/weights").rollout.snapshot_dir
    _load(monkeypatch, "2", "rollout.weight_sync=broadcast")
    _load(monkeypatch, "1")
    _load(monkeypatch, "2", "parallel.pp=1", "parallel.ep=4")  # rank 0 writes the only stage


def test_check_config_refuses_snapshot_engines_on_other_nodes(monkeypatch):
    two = ["rollout.engine_nodes=[0,1]", 'rollout.devices=["npu:4,5","npu:6,7"]', "parallel.pp=1"]
    with pytest.raises(ConfigError, match=r"rollout\.snapshot_dir: .*engines on node\(s\) \[1\]"):
        _load(monkeypatch, None, *two)
    _load(monkeypatch, None, *two, "rollout.snapshot_dir=/mnt/shared/weights")


def test_launch_check_names_the_stages_and_the_fix(monkeypatch):
    cfg = _load(monkeypatch, None)
    validate_writer_nodes(cfg, [])
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1, 2\] run on another node.*rollout\.snapshot_dir to a"):
        validate_writer_nodes(cfg, [2, 1])
    validate_writer_nodes(_load(monkeypatch, None, "rollout.snapshot_dir=/mnt/x"), [1, 2])


def _roots(tmp: str) -> dict:
    """Rank r of a PP-2 world on node r (own node id, own /dev/shm): the run directory for each layout."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.snapshot_root import NODE_ID_VAR, shared_snapshot_root

    initialize_parallel(tp=1, pp=2)
    rank, cfg = dist.get_rank(), load_config(RECIPE, ["parallel.pp=2", "parallel.ep=1"])
    shm = str(Path(tmp, f"node{rank}-shm"))
    Path(shm).mkdir()
    out = {"one_node": str(shared_snapshot_root(cfg, base=shm))}  # both ranks on one machine: rank 0's /dev/shm
    os.environ[NODE_ID_VAR] = f"node{rank}"
    try:
        shared_snapshot_root(cfg, base=shm)
    except ConfigError as err:
        out["refused"] = str(err)
    out["broadcast"] = str(
        shared_snapshot_root(
            load_config(RECIPE, ["parallel.pp=2", "parallel.ep=1", "rollout.weight_sync=broadcast"]), base=shm
        )
    )
    shared = load_config(RECIPE, ["parallel.pp=2", "parallel.ep=1", f"rollout.snapshot_dir={tmp}/shared"])
    root = shared_snapshot_root(shared, base=shm)
    (root / f"stage{rank}").write_text("written")  # each stage's writer writes into it
    dist.barrier()
    out["shared"], out["stages"] = str(root), sorted(p.name for p in root.glob("stage*"))
    return out


@pytest.mark.multiproc
def test_two_nodes_refused_without_and_one_directory_with_snapshot_dir(tmp_path):
    node0, node1 = run_distributed(_roots, 2, str(tmp_path), timeout_s=240)
    assert node0["one_node"] == node1["one_node"] and node0["one_node"].startswith(f"{tmp_path}/node0-shm/")
    for out in (node0, node1):  # the same refusal on both ranks: neither waits for the other
        assert "rollout.snapshot_dir" in out["refused"] and "stage(s) [1]" in out["refused"], out["refused"]
    assert node0["broadcast"] == node1["broadcast"]  # no files to reach: rank 0's /dev/shm as before
    assert node0["shared"] == node1["shared"] and node0["shared"].startswith(f"{tmp_path}/shared/")
    assert node0["stages"] == node1["stages"] == ["stage0", "stage1"]
