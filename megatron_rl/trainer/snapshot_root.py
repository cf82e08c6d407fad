"""The run's directory for weight snapshots and shared-memory weight files, the same path on
every rank and reachable by every rank that writes into it.

Writers are the pipeline stages' senders (TP rank 0 of DP replica 0: ``StagePlace.sends``); the
engines read what they wrote. By default the directory is fresh in global rank 0's ``/dev/shm``
(``snapshot_dir.make_snapshot_dir``), which only ranks on rank 0's machine can reach; with
``rollout.snapshot_dir`` it is made inside that directory, which every node must mount. Ranks
tell their machine by ``node_id``; a launch whose stage writers sit on other machines than rank 0
without such a directory is refused before the first sync (``config.weight_files``).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, ConfigError
from megatron_rl.config.errors import Problem
from megatron_rl.config.weight_files import validate_writer_nodes
from megatron_rl.parallel.gather import host_group
from megatron_rl.trainer.snapshot_dir import make_snapshot_dir

NODE_ID_VAR = "MEGATRON_RL_NODE_ID"  # overrides the host name (tests; machines sharing a host name)
VISIBLE_WAIT_S = 10.0  # a shared filesystem may show a new directory to other clients late


def node_id() -> str:
    """This machine, as far as sharing ``/dev/shm`` goes: ``$MEGATRON_RL_NODE_ID`` or the host name."""
    return os.environ.get(NODE_ID_VAR) or socket.gethostname()


def local_base() -> str | None:
    """Where a machine-local run directory goes: ``/dev/shm`` when the machine has it."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def shared_snapshot_root(cfg: Config, *, base: str | None = None) -> Path:
    """The run's weight directory (module doc); ``base``: the machine-local parent (default
    ``local_base()``). Raises ``ConfigError`` on every rank for a layout its files cannot reach.
    Collective over the world."""
    from megatron.core import parallel_state as ps

    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node_id(), writer, ps.get_pipeline_model_parallel_rank()), group=host_group())
    leader = places[0][0]
    validate_writer_nodes(cfg, sorted({stage for node, w, stage in places if w and node != leader}))
    shared = cfg.rollout.snapshot_dir
    if dist.get_rank() == 0 and shared:
        Path(shared).mkdir(parents=True, exist_ok=True)
    box = [str(make_snapshot_dir(shared or base or local_base())) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=host_group())
    path = Path(box[0])
    if shared:
        _require_visible(path, writer)
    return path


def _require_visible(path: Path, writer: bool) -> None:
    """Every writer sees ``path`` (rank 0 made it in ``rollout.snapshot_dir``), else ConfigError everywhere."""
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while writer and not path.is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (node_id(), not writer or path.is_dir()), group=host_group())
    blind = sorted({node for node, ok in seen if not ok})
    if blind:
        raise ConfigError(
            [
                Problem(
                    key="rollout.snapshot_dir",
                    message=(
                        f"{path.parent} is not the same directory on every node: {path.name}, "
                        "made there by global rank 0, "
                        f"is missing on {', '.join(blind)}; give a directory of a filesystem every node mounts"
                    ),
                )
            ]
        )
