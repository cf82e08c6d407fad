"""Rollout engines: vLLM / vllm-ascend or transformers workers, their hosting, dispatch and supervision.

Generation on workers of their own (vLLM / vllm-ascend, or the transformers fallback), weight
sync from the trainer, version bookkeeping, supervision of worker processes.

    engine = build_engine(EngineSettings(engine="vllm", model_path=..., num_engines=2,
                                         devices=["cpu:1", "cpu:2"]))
    for result in engine.generate(requests): ...          # completion order, once per request
    engine.load_weights(SnapshotUpdate(str(snap_dir)), version=step)   # or a weight_sync sender

Modules: `build` (`build_engine`: settings -> a running pool), `pool` (WorkerPool, the engine),
`dispatch` (one generate call: chunks, exactly-once results), `score_dispatch` (one score call),
`supervision` (processes: death, hang by rollout.request_timeout_s, restarts), `weight_delivery`
(a `megatron_rl.weight_sync` update into every worker; the transports live in that package),
`worker` (the worker process and its messages), `stream_worker` (the serve loop of a backend
stepped between commands: vLLM), `backends/` (the engines a worker runs: `hf`, `vllm` and its
`vllm_api` adaptors), `remote` (rank 0's hub for engines on other nodes), `engine_host` (a node's
engine host; its command is `megatron_rl.cli.serve`), `faults` (seeded fault injection for
chaos runs), `engine_wrapper` (the base of engines wrapping another), and the records:
`settings`, `types`, `scoring` (score requests and results), `sampling`, `feed` (requests
arriving during a call), and `text` (text in, text out over an engine: what an LLM judge runs on).
"""

from megatron_rl.rollout.build import build_engine
from megatron_rl.rollout.pool import WorkerPool
from megatron_rl.rollout.settings import DeviceAssignment, EngineSettings, parse_device
from megatron_rl.rollout.supervision import RolloutWorkerError, WorkerStatus
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RolloutEngine, SamplingSettings

__all__ = [
    "DeviceAssignment",
    "EngineSettings",
    "GenerationRequest",
    "GenerationResult",
    "RolloutEngine",
    "RolloutWorkerError",
    "SamplingSettings",
    "WorkerPool",
    "WorkerStatus",
    "build_engine",
    "parse_device",
]
