"""Where weight files can go: ``rollout.weight_sync`` 'snapshot' and 'shared_memory' pass the
weights through a directory, by default a fresh one in global rank 0's ``/dev/shm``, which is
that machine's memory. Every pipeline stage's writer (TP rank 0 of DP replica 0) writes its
stage there and every engine reads it, so a writer or an engine on another node needs
``rollout.snapshot_dir`` (a filesystem every node mounts; 'snapshot' only) or 'broadcast'.

Two checks: ``check_weight_files`` from the config alone (``check-config``: engines placed on
other nodes by ``rollout.engine_nodes``; pipeline stages over the ``NNODES`` nodes of the
launch), and ``validate_writer_nodes`` at launch, from where the stage writers really run.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigError, Origins, Problem
from .fields import Found
from .schema import Config
from .sections import launch_nodes

FILE_TRANSPORTS = ("snapshot", "shared_memory")


def check_weight_files(cfg: Config) -> Found:
    """Refuse a file transport whose readers or writers are off rank 0's node (config alone)."""
    r = cfg.rollout
    remote = sorted({n for n in r.engine_nodes if n > 0})
    if r.weight_sync == "snapshot" and remote and not r.snapshot_dir:
        yield (
            "rollout.snapshot_dir",
            (
                f"unset, but rollout.weight_sync 'snapshot' has engines on node(s) {remote} "
                f"(rollout.engine_nodes), which cannot read node 0's /dev/shm: {_FIX}"
            ),
        )
    nodes = launch_nodes()
    if cfg.parallel.pp > 1 and nodes is not None and nodes > 1:
        yield from _problems(cfg, f"parallel.pp = {cfg.parallel.pp} stages over the launch's {nodes} nodes (NNODES)")


def validate_writer_nodes(cfg: Config, stages_elsewhere: Sequence[int], *, origins: Origins | None = None) -> None:
    """Launch time: raise ``ConfigError`` when the writers of pipeline stages ``stages_elsewhere``
    run on another node than global rank 0 and the transport's files cannot reach them."""
    if not stages_elsewhere:
        return
    where = f"the writers of pipeline stage(s) {sorted(stages_elsewhere)} run on another node than global rank 0"
    problems = [Problem(key=k, message=m, where=(origins or Origins()).where(k)) for k, m in _problems(cfg, where)]
    if problems:
        raise ConfigError(problems)


_FIX = (
    "set rollout.snapshot_dir to a directory every node mounts (NFS, Lustre, ...), "
    "or use rollout.weight_sync 'broadcast'"
)


def _problems(cfg: Config, where: str) -> Found:
    r = cfg.rollout
    if r.weight_sync == "snapshot" and not r.snapshot_dir:
        yield (
            "rollout.snapshot_dir",
            (
                f"unset, but {where}: 'snapshot' makes its directory in rank 0's /dev/shm, "
                f"which they cannot reach; {_FIX}"
            ),
        )
    elif r.weight_sync == "shared_memory":
        yield (
            "rollout.weight_sync",
            (
                f"'shared_memory' needs every stage's writer on the engines' machine, but "
                f"{where}: use 'broadcast' (or 'snapshot' with rollout.snapshot_dir)"
            ),
        )
