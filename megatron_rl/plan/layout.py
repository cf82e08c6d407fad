"""Which device of which node does what: training ranks (TP/PP/DP coordinates) and engines.

Contract (what `examples/launch.sh` and `examples/launch_msrun.sh` launch):

- Engine e runs on node ``rollout.engine_nodes[e]`` (node 0 when the list is empty) on the
  device ids ``rollout.devices[e]`` of that node; engine processes set their own
  ``*_VISIBLE_DEVICES`` from them. Node 0's engines are global rank 0's own workers, every
  other node's run in that node's engine host (``python -m megatron_rl serve``), reached over
  the network by the one dispatcher on rank 0. CPU engines (``"cpu:0-3"``, pinned cores)
  take no device.
- Training ranks take every other device: local rank i uses device i (torch's
  ``set_device(LOCAL_RANK)``), so node n runs ``devices_per_node - (engine devices of node n)``
  ranks and its engine ids must lie at or above that count. Global ranks are numbered node
  by node (torchrun's cumulative assignment; the msrun launcher computes the same
  ``RANK_BASE``).
- The TP / CP / PP / DP coordinates of a global rank are megatron-core's (its ``RankGenerator``,
  order ``tp-cp-ep-dp-pp``: TP fastest, then CP). A TP group that spans two nodes works but pays the
  inter-node network on every layer: the plan warns.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import Config
from megatron_rl.rollout.settings import parse_device


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """One training rank: where it runs and its megatron coordinates."""

    rank: int
    node: int
    local_rank: int  # also its device id on the node
    tp: int
    pp: int
    dp: int
    cp: int = 0  # context-parallel index (parallel.cp)


@dataclass(frozen=True, kw_only=True)
class ClusterLayout:
    """The whole launch: training ranks and rollout engines, node by node."""

    nodes: int
    devices_per_node: int
    ranks_per_node: tuple[int, ...]  # training ranks (NPROC_PER_NODE) of each node
    tp: int
    pp: int
    dp: int
    ranks: tuple[RankPlace, ...]
    cp: int = 1  # parallel.cp: ranks splitting every micro-batch's tokens (world = tp × cp × dp × pp)
    engine_devices: tuple[str, ...]  # rollout.devices: one device string per engine
    engine_nodes: tuple[int, ...]  # the node of each engine (rollout.engine_nodes, or all 0)

    def engines_on(self, node: int) -> list[int]:
        """Indices of the engines that run on ``node``."""
        return [e for e, n in enumerate(self.engine_nodes) if n == node]

    @property
    def world_size(self) -> int:
        """Training ranks in all (the torch.distributed world)."""
        return len(self.ranks)

    def warnings(self) -> list[str]:
        """TP groups that span nodes (slow: every layer all-reduces over the network)."""
        out = []
        for tp_rank0 in (r for r in self.ranks if r.tp == 0):
            group = self.ranks[tp_rank0.rank : tp_rank0.rank + self.tp]
            if len({r.node for r in group}) > 1:
                out.append(
                    f"tp group of ranks {group[0].rank}-{group[-1].rank} spans nodes "
                    f"{sorted({r.node for r in group})}: choose parallel.tp dividing every node's ranks "
                    f"{list(self.ranks_per_node)}"
                )
        return out + self._cp_warnings()

    def _cp_warnings(self) -> list[str]:
        """CP groups that span nodes (every layer all-gathers K / V over the network)."""
        groups: dict[tuple[int, int, int], list[RankPlace]] = {}
        for r in self.ranks if self.cp > 1 else ():
            groups.setdefault((r.tp, r.dp, r.pp), []).append(r)
        return [
            f"cp group of ranks {[r.rank for r in g]} spans nodes {sorted({r.node for r in g})}: every layer "
            "all-gathers K / V over the network; choose parallel.tp × parallel.cp dividing every node's ranks "
            f"{list(self.ranks_per_node)}"
            for g in groups.values()
            if len({r.node for r in g}) > 1
        ]


class LayoutError(ValueError):
    """A launch layout that cannot work; the message names the key or flag to change."""


def engine_nodes(cfg: Config) -> tuple[int, ...]:
    """The node of each engine (``rollout.engine_nodes``; every engine on node 0 when empty)."""
    return tuple(cfg.rollout.engine_nodes) or (0,) * cfg.rollout.num_engines


def engine_device_ids(cfg: Config, node: int = 0) -> list[int]:
    """Device ids ``node``'s engines occupy (CPU engines occupy none; node 0 also runs the
    teacher / judge / reward model engines: ``model_engines``)."""
    from megatron_rl.plan.model_engines import model_engine_ids

    ids: list[int] = []
    nodes = engine_nodes(cfg)
    for i, text in enumerate(cfg.rollout.devices):
        device = parse_device(text, f"rollout.devices[{i}]")
        if device.kind != "cpu" and nodes[i] == node:
            ids += list(device.ids)
    return ids + (model_engine_ids(cfg) if node == 0 else [])  # a teacher's / judge's / reward model's


def _training_ranks(cfg: Config, node: int, devices_per_node: int) -> int:
    """Training ranks of ``node``: the devices its engines leave (they must take the top ids)."""
    engine_ids = engine_device_ids(cfg, node)
    where = f"rollout.devices of node {node} (rollout.engine_nodes)"
    if len(set(engine_ids)) != len(engine_ids):
        raise LayoutError(f"{where} {cfg.rollout.devices} name a device twice")
    ranks = devices_per_node - len(engine_ids)
    if ranks < 1:
        raise LayoutError(
            f"{where} take all {devices_per_node} devices of node {node}; "
            "leave some for training or raise --devices-per-node"
        )
    clash = [i for i in engine_ids if i < ranks or i >= devices_per_node]
    if clash:
        raise LayoutError(
            f"{where}: device(s) {clash} are training devices or absent; node {node}'s training "
            f"ranks use ids 0..{ranks - 1} (local rank = device), so name engine ids "
            f"{ranks}..{devices_per_node - 1}"
        )
    return ranks


def plan_layout(cfg: Config, *, nodes: int, devices_per_node: int) -> ClusterLayout:
    """Place training ranks and engines on `nodes` nodes of `devices_per_node` devices."""
    from megatron_rl.plan.model_engines import placement_problems

    if nodes < 1 or devices_per_node < 1:
        raise LayoutError(f"--nodes ({nodes}) and --devices-per-node ({devices_per_node}) must be >= 1")
    placed = engine_nodes(cfg)
    if problems := placement_problems(cfg, devices_per_node):
        raise LayoutError("; ".join(problems))
    if absent := sorted({n for n in placed if n >= nodes}):
        raise LayoutError(
            f"rollout.engine_nodes {list(placed)} names node(s) {absent}, but the launch has "
            f"{nodes} node(s); raise --nodes or move those engines"
        )
    per_node = tuple(_training_ranks(cfg, node, devices_per_node) for node in range(nodes))
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
    world = sum(per_node)
    dp = _data_parallel(cfg, world, per_node)
    coords = _coordinates(tp=tp, pp=pp, dp=dp, cp=cp)
    places = [(node, local) for node, n in enumerate(per_node) for local in range(n)]
    ranks = tuple(RankPlace(rank=r, node=node, local_rank=local, **coords[r]) for r, (node, local) in enumerate(places))
    return ClusterLayout(
        nodes=nodes,
        devices_per_node=devices_per_node,
        ranks_per_node=per_node,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ranks=ranks,
        engine_devices=tuple(cfg.rollout.devices),
        engine_nodes=placed,
    )


def _data_parallel(cfg: Config, world: int, per_node: tuple[int, ...]) -> int:
    """The DP size of `world` training ranks at the config's tp × pp × cp (checked against parallel.dp)."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
    if world % (tp * pp * cp):
        key, sizes = "parallel.tp", f"parallel.tp ({tp}) × parallel.pp ({pp})"
        if cp > 1:
            key = "parallel.cp" if world % (tp * pp) == 0 else key
            sizes += f" × parallel.cp ({cp})"
        raise LayoutError(
            f"{sizes} = {tp * pp * cp} does not divide the {world} training ranks (per node "
            f"{list(per_node)}); change {key} (parallel.tp / parallel.pp / parallel.cp) or the layout"
        )
    dp = world // (tp * pp * cp)
    if cfg.parallel.dp is not None and cfg.parallel.dp != dp:
        raise LayoutError(
            f"parallel.dp ({cfg.parallel.dp}) ≠ {dp} = {world} training ranks / (tp × pp × cp); "
            f"set parallel.dp to {dp} or leave it unset"
        )
    return dp


def _coordinates(*, tp: int, pp: int, dp: int, cp: int = 1) -> dict[int, dict[str, int]]:
    """Global rank -> {"tp", "cp", "pp", "dp"} index, as megatron-core's parallel state assigns them."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    out: dict[int, dict[str, int]] = {r: {} for r in range(tp * pp * dp * cp)}
    for name in ("tp", "cp", "pp", "dp"):
        for group in gen.get_ranks(name):
            for index, rank in enumerate(group):
                out[rank][name] = index
    return out
