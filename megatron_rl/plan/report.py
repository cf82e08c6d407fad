"""The text `python -m megatron_rl plan` prints: layout node by node, then memory per device."""

from __future__ import annotations

from megatron_rl.plan.build import Plan

GIB = 2**30


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def _ids(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def layout_lines(plan: Plan) -> list[str]:
    """Per node: each training rank with its TP / PP / DP coordinates, then the engines."""
    lay = plan.layout
    counts = [len(lay.engines_on(node)) for node in range(lay.nodes)]
    pinned = "" if lay.engine_devices else ", unpinned on CPUs"
    cp = f" × cp {lay.cp}" if lay.cp > 1 else ""
    lines = [
        f"layout: {lay.world_size} training ranks = tp {lay.tp}{cp} × pp {lay.pp} × dp {lay.dp}; "
        f"{len(lay.engine_nodes)} rollout engine(s){pinned}, per node {counts} (node 0's: global rank 0 "
        "starts them; node n's: its engine host, `megatron_rl serve --node-rank n`)"
    ]
    for node in range(lay.nodes):
        ranks = [r for r in lay.ranks if r.node == node]
        lines.append(
            f"  node {node}: NPROC_PER_NODE={lay.ranks_per_node[node]}, training devices "
            f"{_ids([r.local_rank for r in ranks])}, engines {len(lay.engines_on(node))}"
        )
        lines += [
            f"    device {r.local_rank}: rank {r.rank:>4}  tp {r.tp}"
            + (f"  cp {r.cp}" if lay.cp > 1 else "")
            + f"  pp {r.pp}  dp {r.dp}"
            for r in ranks
        ]
        lines += [
            f"    engine {e}: {lay.engine_devices[e] if lay.engine_devices else 'cpu'}" for e in lay.engines_on(node)
        ]
    lines += [f"  warning: {w}" for w in lay.warnings()]
    return lines


def _term_rows(plan: Plan) -> list[tuple[str, int, str]]:
    """(term, bytes, where it comes from) for each memory term of the largest stage."""
    s, w = plan.settings, plan.worst
    mb = s.micro_batch
    over = f"dp {s.dp}" + (f" × cp {s.cp}" if s.cp > 1 else "")
    sharded = f", sharded over {over}" + (f" (experts: expert-dp {s.expert_dp})" if w.expert_params else "")
    weights, trained = _weights_text(plan)
    return [
        ("weights", w.weights, weights),
        ("grads", w.grads, f"fp32 DDP gradient buffer ({trained})"),
        (
            "optimizer",
            w.optimizer,
            f"Adam moments ({trained})"
            + (" + fp32 master" if s.dtype_bytes < 4 else "")
            + (sharded if s.distributed_optimizer else ", not sharded"),
        ),
        (
            "activations",
            w.activations,
            f"1 micro-batch of {mb.tokens} tokens{_cp_text(plan)}, {plan.dims.layers // s.pp} layers, "
            f"attention {s.attention_backend}, recompute {s.recompute}",
        ),
        (
            "log-probs",
            w.logprobs,
            f"{s.response_rows} response rows: "
            + (
                "fp32 softmax × vocab/tp"
                if s.logprob_chunk_tokens is None or s.response_rows <= s.logprob_chunk_tokens
                else f"head inputs (chunks of {s.logprob_chunk_tokens} rows recomputed in backward)"
            ),
        ),
        ("transient", w.transient, "logits + fp32 copies during log-probs, or one layer's backward"),
    ]


def _cp_text(plan: Plan) -> str:
    """Under CP: the rank's share of the micro-batch and the all-gathered K / V its layers keep."""
    s = plan.settings
    if s.cp == 1:
        return ""
    kept = f"{plan.worst.kv_gather / GIB:.2f} GiB kept" if plan.worst.kv_gather else "rebuilt by recompute"
    return f" / cp {s.cp} = {s.tokens} per rank (+ K/V all-gather of all tokens per layer: {kept})"


def _weights_text(plan: Plan) -> tuple[str, str]:
    """What the weights term holds, and what is trained (the policy, or LoRA's adapters only)."""
    s, w = plan.settings, plan.worst
    experts = f" ({w.expert_params / 1e9:.3f} B of routed experts, 1/{s.ep} of them)" if w.expert_params else ""
    if s.lora is None:
        copies = " + ".join(plan.trimodel.active)
        return f"{copies}: {s.copies} × {w.params / 1e9:.3f} B params/rank{experts}, {s.dtype}", "policy"
    old = " + old snapshot" if s.lora.snapshots > 1 else ""
    return (
        f"frozen base once: {w.params / 1e9:.3f} B params/rank{experts}, {s.dtype} (ref = adapters off); "
        f"LoRA r {s.lora.rank}: {s.lora.snapshots} × {w.adapter_params / 1e6:.2f} M adapter params/rank "
        f"(policy{old})",
        "adapters only",
    )


def _total_lines(plan: Plan) -> list[str]:
    """The largest stage's total against the device's usable memory, then each stage's total under pp."""
    s, w, d = plan.settings, plan.worst, plan.device
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    shared = f" × {plan.sharers} ranks sharing the machine's RAM" if plan.sharers > 1 else ""
    lines = [
        f"  {'total':<12}{_gib(w.total)}{shared}   of {_gib(d.usable_bytes).strip()} usable "
        f"({d.usable_fraction:.0%} of {d.memory_bytes / GIB:.1f} GiB {d.name}): {verdict}"
    ]
    if s.pp > 1:
        lines.append("  per stage: " + ", ".join(f"{st.stage}: {st.total / GIB:.2f} GiB" for st in plan.stages))
    if plan.full_finetune:
        full = max(st.total for st in plan.full_finetune)
        fits = "fits" if full * plan.sharers <= d.usable_bytes else "DOES NOT FIT"
        lines.append(
            f"  {'without LoRA':<12}{_gib(full)}   lora.rank=0 (full fine-tune: {' + '.join(plan.trimodel.active)} "
            f"copies, fp32 grads and Adam state for every parameter): {fits}"
        )
    return lines


def memory_lines(plan: Plan, peak_tflops: float | None = None) -> list[str]:
    """The largest stage's memory, term by term, against the device; the verdict last."""
    lines = [
        "tri-model: " + "; ".join(plan.trimodel.reasons),
        f"memory per training device (stage {plan.worst.stage} of pp {plan.settings.pp}, the largest):",
    ]
    lines += [f"  {name:<12}{_gib(n)}   {why}" for name, n, why in _term_rows(plan)]
    lines += _total_lines(plan)
    lines += _compute_lines(plan, peak_tflops or plan.device.peak_tflops)
    return lines


def _compute_lines(plan: Plan, tflops: float | None) -> list[str]:
    """Matmul FLOPs of one micro-batch (2·params per token per forward, the active ones of a MoE;
    backward 2× forward, 1× with LoRA's frozen base: input gradients only; adapters neglected)."""
    if tflops is None:
        return ["  compute: pass --peak-tflops for a lower bound on micro-step time"]
    moe, ep = plan.dims.moe, plan.settings.ep  # a token goes through top_k of the E experts
    active = (lambda st: st.expert_params * ep * moe.top_k / moe.experts) if moe else (lambda st: 0)
    params = sum(st.params - st.expert_params + active(st) for st in plan.stages) * plan.settings.tp  # one copy
    tokens = plan.settings.micro_batch.tokens
    policy = 3 if plan.settings.lora is None else 2  # a frozen base computes no weight gradients
    flops = 2 * params * tokens * (policy + plan.settings.copies - 1)
    devices = plan.settings.tp * plan.settings.pp * plan.settings.cp
    seconds = flops / (tflops * 1e12 * devices)
    return [
        f"  compute: {flops / 1e12:.1f} TFLOP per micro-batch (policy fwd+bwd{' without base wgrad' * (policy == 2)}, "
        f"frozen fwd) -> >= "
        f"{seconds * 1e3:.0f} ms per micro-batch on tp × pp{' × cp' * (plan.settings.cp > 1)} devices at "
        f"{tflops:g} TFLOPS each"
    ]


def render(plan: Plan, *, source: str, peak_tflops: float | None = None) -> str:
    """The whole report."""
    dm, lay = plan.dims, plan.layout
    head = [
        f"plan: {source} on {lay.nodes} node(s) × {lay.devices_per_node} {plan.device.name}",
        f"model: {plan.model_type}, {dm.layers} layers, hidden {dm.hidden}, ffn {dm.ffn}, heads {dm.heads} "
        f"({dm.kv_heads} kv, head_dim {dm.head_dim}), vocab {dm.vocab}"
        + (", qk-norm" if dm.qk_norm else "")
        + (", tied embeddings" if dm.tied_embeddings else ""),
    ]
    text = head + layout_lines(plan) + memory_lines(plan, peak_tflops)
    if not plan.fits:
        text.append("refused: the largest stage does not fit; change one of:")
        text += [f"  {line}" for line in plan.advice]
    return "\n".join(text)
