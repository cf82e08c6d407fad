"""Rules of ``rollout.in_flight_updates`` (partial rollout: weight updates reach running requests).

In-flight updates exist only for ``pipeline.mode: stale``: sync and periodic modes promise that
every token of batch t comes from θ_t (their equivalence tests), which an update landing inside
a request would break. The engine must be able to pause between decode steps (``PAUSABLE_ENGINES``:
the ``hf`` engine between decode steps of its chunk, the ``vllm`` worker between engine steps),
the trajectory must be one engine request (``single_turn``: a multi-turn generator's turns would
need versions per turn, which nothing carries yet), and no MoE routes may be recorded (a request
recomputed after an update would mix the routes of two versions).
"""

from __future__ import annotations

from .fields import Found
from .schema import Config

PAUSABLE_ENGINES: tuple[str, ...] = ("hf", "vllm")  # engines whose workers load an update between steps
KEY = "rollout.in_flight_updates"


def check_in_flight(cfg: Config) -> Found:
    """Refuse ``rollout.in_flight_updates`` where it cannot work (module doc), naming the key."""
    r = cfg.rollout
    if not r.in_flight_updates:
        return
    if cfg.pipeline.mode != "stale":
        yield (
            KEY,
            f"needs pipeline.mode 'stale' (got {cfg.pipeline.mode!r}): sync and periodic modes sample every "
            "token of a batch with one version; set it to false or use pipeline.mode 'stale'",
        )
    if r.engine not in PAUSABLE_ENGINES:
        yield KEY, f"rollout.engine {r.engine!r} cannot pause between decode steps; use one of {PAUSABLE_ENGINES}"
    if r.generator not in ("auto", "single_turn") or (r.generator == "auto" and cfg.environment.kind != "none"):
        yield (
            KEY,
            f"needs the single_turn generator (rollout.generator {r.generator!r}, environment.kind "
            f"{cfg.environment.kind!r}): a multi-turn trajectory's turns carry no per-token versions",
        )
    if cfg.algorithm.routing_replay == "rollout":
        yield (
            KEY,
            "cannot be combined with algorithm.routing_replay 'rollout' (a recomputed request mixes versions' routes)",
        )
