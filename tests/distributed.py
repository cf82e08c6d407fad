"""Run a test body in N processes joined by a gloo process group, torchrun-style, from pytest.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forked from a server
that imported the heavy libraries once, ``PRELOAD``) with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set, calls ``fn(*args)`` in each (``fn`` must be a
module-level function so it can be pickled) and returns the list of per-rank return values.
An exception in any rank is re-raised in the test with that rank's traceback; a hung group
fails after ``timeout_s``.
"""

from __future__ import annotations

import io
import os
import queue as queue_lib
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the one helper for every test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every test world imports. In a fresh process that is ~10 s of CPU (megatron-core alone pulls
# in torch._dynamo and inductor), paid by each rank of each of ~190 process tests; ranks fork from a
# server that imported these once instead. Libraries, and of ours only what reads nothing at import.
PRELOAD = (
    "megatron_rl",  # first: its import silences megatron-core's import-time warnings
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "megatron_rl.rewards.pool",  # what RewardPool preloads when it starts the server itself
)


def start_forkserver() -> None:
    """Start this process's forkserver with ``PRELOAD`` imported (a no-op once it runs).

    The server is per process and keeps the preload it started with: call this before anything
    else (``RewardPool``) starts it. A forked rank inherits the server's environment and working
    directory, not the caller's, so ``run_distributed`` hands both over explicitly (and ``sys.path``)."""
    import multiprocessing.forkserver as forkserver

    mp.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    env: dict[str, str],
    cwd: str,
    path: list[str],
    output: str,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)  # the server's stdout is not pytest's capture
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        # Serialise here: torch's shared-memory tensor pickling breaks once this process exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, fresh: bool = False
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return results in rank order.

    ``fresh``: each rank is a new interpreter (spawned, ~10 s slower) instead of a fork of the
    preloaded server, for a body that measures its own process memory (a fork starts with the
    server's heap resident) or sets an environment variable a preloaded library reads at import
    (``TRITON_INTERPRET``)."""
    if not fresh:
        start_forkserver()
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    queue = ctx.Queue()
    port = free_port()
    env, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    outputs = tempfile.TemporaryDirectory(prefix="megatron_rl-ranks-")
    logs = [Path(outputs.name) / f"rank{r}.log" for r in range(world_size)]
    for log in logs:
        log.touch()
    # Not daemonic: a rank may start processes of its own (rollout engine workers).
    procs = [
        ctx.Process(
            target=_entry, args=(r, world_size, port, fn, args, queue, env, cwd, path, str(logs[r])), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout_s)
            except queue_lib.Empty:
                errors.append(f"timed out after {timeout_s}s waiting for {world_size - len(results)} rank(s)")
                break
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # the other ranks are likely blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
        for log in logs:  # into pytest's capture of this test
            sys.stdout.write(log.read_text(errors="replace"))
        outputs.cleanup()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def listening_addresses(pid: int) -> set[str]:
    """Local addresses ("ip:port", hex as in /proc/net) of the TCP sockets ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile (e.g. a listdir's own fd)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1])
    return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1, as /proc writes them
