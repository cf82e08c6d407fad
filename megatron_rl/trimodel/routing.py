"""Routing replay (R3): the engine's expert choice forced on megatron-core's MoE routers.

An MoE router turns a tiny engine/trainer numerical difference (bf16 engine, fp32 trainer,
other kernels) into a different expert and a large log-prob gap. With
``algorithm.routing_replay: rollout`` every token of a packed micro-batch carries the experts
the engine routed it to (``PackedMicroBatch.routed_experts [T, layers, top_k]``: packed
order, one column per decoder layer of the whole model, vLLM's layout) and the routers of this rank's PP stage
take them instead of their own top-k (megatron-core 0.16's ``RouterReplay``: the routing
*weights* are still the trainer's scores gathered at those experts, so gradients reach the
router). Each router finds its column by its global layer number, so every PP stage, TP rank
and EP rank reads the same ``[T, L, K]`` tensor (sliced by TP rank under sequence parallelism).

Which copy replays (the rule, ``TriStage``): the **policy** and the **old** policy replay the
engine's routes; the **reference** routes itself.
- policy: its log-probs are the ones compared with the engine's (the ratio π_θ / π_behav of
  the rollout correction and of decoupled PPO) and differentiated: with replay the gradient
  flows through the experts that produced the sample.
- old: it defines the PPO ratio π_θ / π_old; routed differently from the policy, that ratio
  would move at θ = θ_old from routing alone (not 1 at the first step), so it replays the same
  routes (slime replays both: ``train_actor`` fills the replay for the actor and old actor).
- reference: a different model (frozen θ_ref); the engine's routes were chosen by θ_behav,
  and the KL penalty is to the reference's own distribution, which routes with its own
  router. slime switches the replay to ``fallthrough`` for the reference forward
  (``ROUTING_REPLAY_STAGE=fallthrough`` in ``MegatronTrainRayActor.train_actor``).

Activation recompute re-runs a layer's forward during backward: each target is also queued
on megatron's backward list, and after its forward a replaying copy is switched to
``REPLAY_BACKWARD``, so a recomputed router pops its micro-batch's routes in forward order
(1F1B runs backwards in forward order). ``clear`` empties the queues after each schedule.
Tested with full recompute (``test_routing_replay_trainer``: forward and recompute both take the
engine's routes); recompute sees the packed layout through ``platform/patches/recompute_context``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from megatron_rl.trimodel.stage import unwrap


def moe_layer_numbers(config) -> list[int]:
    """Global 1-based layer numbers of the MoE layers, in model order (``moe_layer_freq``)."""
    n, freq = config.num_layers, config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(n)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, p in enumerate(pattern) if p]


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This stage's megatron ``TopKRouter`` modules, in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def attach_replay(model: torch.nn.Module) -> int:
    """Give every router a ``RouterReplay`` (a model built without ``moe_enable_routing_replay``);
    kept off megatron's global instance list (three copies per rank: each is driven here).
    Returns how many routers the stage has."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = moe_routers(model)
    for router in routers:
        if router.router_replay is None:
            router.router_replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
    return len(routers)


def _stage_targets(model: torch.nn.Module, routes: torch.Tensor) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(router, its ``[tokens, top_k]`` int64 targets) for each router of the stage."""
    config = unwrap(model).config
    if routes.shape[1] != config.num_layers:
        raise ValueError(f"routing replay: routes for {routes.shape[1]} layers, the model has {config.num_layers}")
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        from megatron.core import parallel_state as ps

        routes = routes.chunk(config.tensor_model_parallel_size)[ps.get_tensor_model_parallel_rank()]
    out = []
    for router in moe_routers(model):
        target = routes[:, router.layer_number - 1].long()  # layer_number: global, 1-based
        if target.shape[1] != router.topk:
            raise ValueError(f"routing replay: routes carry top-{target.shape[1]}, the router takes top-{router.topk}")
        out.append((router, target))
    return out


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor, *, backward: bool) -> Iterator[None]:
    """Within: the stage's routers take ``routes [T, L, K]`` (on the model's device). After: with
    ``backward`` the targets stay queued for recompute (``REPLAY_BACKWARD``), else cleared."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    targets = _stage_targets(model, routes)
    for router, target in targets:
        router.router_replay.set_target_indices(target)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router, _ in targets:
            if backward:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()


def clear(model: torch.nn.Module) -> None:
    """Drop queued targets and actions: the routers choose again (after each schedule)."""
    for router in moe_routers(model):
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


class RouteCapture:
    """Records the experts the stage's routers actually dispatched to, per forward: forward hooks
    on each ``TopKRouter`` read its ``routing_map`` (``[tokens, experts]``, what the token
    dispatcher uses). ``routes()``: ``[T, L_stage, K]`` int64, expert ids ascending per token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._calls: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in moe_routers(model)]
        self.num_layers = len(self._handles)

    def _hook(self, module, args, output) -> None:
        routing_map = output[1]  # [tokens, experts] bool
        k = int(routing_map[0].sum())
        self._calls.append(routing_map.nonzero()[:, 1].reshape(-1, k).detach().cpu())

    def routes(self) -> torch.Tensor:
        """The routes of the last forward (``[T, L_stage, K]``) and reset."""
        calls, self._calls = self._calls[-self.num_layers :], []
        return torch.stack(calls, dim=1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def require_routes(samples: Iterable) -> None:
    """With replay on, every sample (``pipeline.records.Sample``) must carry the engine's routes:
    ``ValueError`` naming the first request without them."""
    for s in samples:
        if s.routed_experts is None:
            raise ValueError(
                f"algorithm.routing_replay is 'rollout' but request {s.request_id!r} has no routed experts: "
                "its engine did not return them (an engine without route output, or a recording made "
                "without routing replay)"
            )
