"""Initialise torch.distributed and megatron-core's TP x PP x CP x DP groups for this process.

A model replica is TP x PP x CP ranks (CP ranks hold slices of the same micro-batches: see
``attention.context_parallel``); megatron's model-parallel group is TP x PP only, so the host
group of a replica (``host_model_parallel_group``) is built here to include the CP ranks.
"""

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
    cp: int = 1  # context-parallel size: CP ranks of a replica hold slices of every micro-batch
    cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_world(world_size: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> int:
    """Return DP size, or raise naming the sizes when TP x PP x CP does not divide the world or EP
    does not divide DP x CP (megatron carves the expert-parallel groups out of the DP x CP ranks)."""
    if tp < 1 or pp < 1 or ep < 1 or cp < 1:
        raise ValueError(f"parallel.tp ({tp}), parallel.pp ({pp}), parallel.ep ({ep}), parallel.cp ({cp}) must be >= 1")
    if world_size % (tp * pp * cp):
        key = "parallel.cp" if cp > 1 else "parallel.tp"
        raise ValueError(
            f"{key}: tp ({tp}) x pp ({pp}) x cp ({cp}) = {tp * pp * cp} does not divide world size {world_size}"
        )
    dp = world_size // (tp * pp * cp)
    if (dp * cp) % ep:
        raise ValueError(
            f"parallel.ep ({ep}) does not divide dp x cp = {dp * cp} (world {world_size} / (tp {tp} x pp {pp}))"
        )
    return dp


def initialize_parallel(
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    cp: int = 1,
    seed: int = 1234,
    platform: str = "auto",
    timeout_s: float = 600.0,
) -> tuple[Platform, ParallelLayout]:
    """Set up the platform, the default process group (from torchrun env vars) and megatron's groups
    (``ep``: expert-parallel size, the expert tensor-parallel size is TP; ``cp``: context-parallel size).

    Idempotent for the same sizes. Seeds the default generator with ``seed`` and megatron's
    model-parallel RNG tracker (``seed + 2718 + tp_rank`` for TP regions).
    """
    from megatron.core import parallel_state, tensor_parallel

    plat = setup_platform(platform)
    set_timeout(timeout_s)  # parallel.timeout_s: every group below waits this (+ grace) at most
    if not dist.is_initialized():
        _init_default_group(plat.dist_backend, group_timeout(timeout_s))
    world = dist.get_world_size()
    dp = check_world(world, tp, pp, ep, cp)
    _init_model_parallel(tp, pp, ep, cp, timeout_s)
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
        cp=cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
    )
    return plat, layout


def _init_model_parallel(tp: int, pp: int, ep: int, cp: int, timeout_s: float) -> None:
    """megatron's model-parallel groups of these sizes (a no-op when they exist with the same sizes)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        ) != (tp, pp, ep, cp):
            raise RuntimeError("model parallel already initialised with different sizes; call destroy_parallel() first")
    else:
        parallel_state.initialize_model_parallel(
            distributed_timeout_minutes=group_timeout_minutes(timeout_s),
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
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
    """A gloo group of this rank's model replica (TP x PP x CP ranks), megatron's TP x PP group
    itself on gloo at CP 1."""
    return _HOST_GROUPS["model_parallel"]


def replica_src_rank() -> int:
    """The global rank that leads this rank's model replica (TP x PP x CP): megatron's
    model-parallel source rank at CP 1, else the replica's lowest rank."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return parallel_state.get_model_parallel_src_rank()
    return min(dist.get_process_group_ranks(host_model_parallel_group()))


def _build_host_groups(plat: Platform) -> None:
    """Create the host groups once per initialisation (collective over the world, same order everywhere)."""
    from megatron.core import parallel_state

    if "model_parallel" in _HOST_GROUPS:
        return
    mp_group = parallel_state.get_model_parallel_group()
    world = host_world_group()
    cp = parallel_state.get_context_parallel_world_size()
    if plat.dist_backend == "gloo" and cp == 1:
        _HOST_GROUPS["model_parallel"] = mp_group
        return
    mine = tuple(dist.get_process_group_ranks(mp_group))
    if cp > 1:  # a replica: the TP x PP groups of this rank's CP peers together
        peers: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(peers, mine, group=world)
        cp_ranks = set(dist.get_process_group_ranks(parallel_state.get_context_parallel_group()))
        mine = tuple(sorted({r for i, group in enumerate(peers) if i in cp_ranks for r in group}))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=world)
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
