"""Initialise torch.distributed and megatron-core's TP x PP x DP groups for this process."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.parallel.world_timeout import current_group_timeout, group_timeout, group_timeout_minutes, set_timeout
from megatron_rl.platform import Platform, setup_platform


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """This rank's place in the TP x PP x DP grid."""

    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1  # expert-parallel size: EP ranks split the routed experts within the DP ranks

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_world(world_size: int, tp: int, pp: int, ep: int = 1) -> int:
    """Return DP size, or raise naming the sizes when TP x PP does not divide the world or EP
    does not divide the DP size (megatron carves the expert-parallel groups out of DP)."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"parallel.tp ({tp}), parallel.pp ({pp}) and parallel.ep ({ep}) must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(f"parallel.tp ({tp}) x parallel.pp ({pp}) = {tp * pp} does not divide world size {world_size}")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(
            f"parallel.ep ({ep}) does not divide the data-parallel size {dp} (world {world_size} / (tp {tp} x pp {pp}))"
        )
    return dp


def initialize_parallel(
    *, tp: int, pp: int, ep: int = 1, seed: int = 1234, platform: str = "auto", timeout_s: float = 600.0
) -> tuple[Platform, ParallelLayout]:
    """Set up the platform, the default process group (from torchrun env vars) and megatron's groups
    (``ep``: expert-parallel size; the expert tensor-parallel size is TP).

    Idempotent for the same sizes. Seeds the default generator with ``seed`` and megatron's
    model-parallel RNG tracker (``seed + 2718 + tp_rank`` for TP regions).
    """
    from megatron.core import parallel_state, tensor_parallel

    plat = setup_platform(platform)
    set_timeout(timeout_s)  # parallel.timeout_s: every group below waits this (+ grace) at most
    if not dist.is_initialized():
        _init_default_group(plat.dist_backend, group_timeout(timeout_s))
    world = dist.get_world_size()
    dp = check_world(world, tp, pp, ep)
    _init_model_parallel(tp, pp, ep, timeout_s)
    _build_host_groups(plat)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    layout = ParallelLayout(
        world_size=world,
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep=ep,
    )
    return plat, layout


def _init_model_parallel(tp: int, pp: int, ep: int, timeout_s: float) -> None:
    """megatron's model-parallel groups of these sizes (a no-op when they exist with the same sizes)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        ) != (tp, pp, ep):
            raise RuntimeError("model parallel already initialised with different sizes; call destroy_parallel() first")
    else:
        parallel_state.initialize_model_parallel(
            distributed_timeout_minutes=group_timeout_minutes(timeout_s),
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )


# Host-side twins of the world and of this rank's model-parallel group, on gloo whatever the
# training backend: flags the host owns (a stop request) and pickled control messages (replica
# calls) go there, so nothing on the host crosses NCCL / HCCL, which take device tensors only.
_HOST_GROUPS: dict[object, object] = {}


def host_world_group():
    """A gloo group of the whole world: the default group itself when that is gloo, else the one
    ``initialize_parallel`` made, or (outside it) one made on first use, so every rank must then
    make its first call at the same point of the program (every caller is collective)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = ("world", id(dist.group.WORLD))  # a new default group (tests re-initialise) gets its own
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo", timeout=current_group_timeout())
    return _HOST_GROUPS[key]


def host_model_parallel_group():
    """A gloo group of this rank's model-parallel (TP x PP) ranks, megatron's group itself on gloo."""
    return _HOST_GROUPS["model_parallel"]


def _build_host_groups(plat: Platform) -> None:
    """Create the host groups once per initialisation (collective over the world, same order everywhere)."""
    from megatron.core import parallel_state

    if "model_parallel" in _HOST_GROUPS:
        return
    mp_group = parallel_state.get_model_parallel_group()
    world = host_world_group()
    if plat.dist_backend == "gloo":
        _HOST_GROUPS["model_parallel"] = mp_group
        return
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(dist.get_process_group_ranks(mp_group)), group=world)
    _HOST_GROUPS["model_parallel"], _ = dist.new_subgroups_by_enumeration(
        sorted(set(everyone)), backend="gloo", timeout=current_group_timeout()
    )


def destroy_parallel(*, keep_world: bool = False) -> None:
    """Tear down megatron's groups, the host groups and (unless ``keep_world``: the next
    ``initialize_parallel`` sets up another layout of the same world) the default process group."""
    from megatron.core import parallel_state

    _HOST_GROUPS.clear()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()


def _init_default_group(backend: str, timeout: timedelta) -> None:
    """The default process group, opening no listener on all interfaces: one process uses an
    in-memory store; under torchrun / msrun the launcher's agent store; otherwise (a launcher
    that only sets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE) rank 0 binds the store's
    socket to MASTER_ADDR itself (a plain TCPStore would listen on every interface)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt == "0":
            dist.init_process_group(backend, timeout=timeout)
            return
        # torchrun --max-restarts: the agent's store outlives a failed attempt, and the keys the
        # dead world left there (its groups' peer addresses) would send this world to dead peers
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"megatron_rl/attempt_{attempt}", client),
            rank=int(os.environ["RANK"]),
            world_size=world,
            timeout=timeout,
        )
        return
    rank, host, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
    store = dist.TCPStore(
        host,
        port,
        world,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=listener.detach() if listener is not None else None,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
