"""Reference computations shared by the rollout engine tests (independent of the engines).

``trainer_update(hf_dir, snap_dir, prompts, max_new)`` plays the trainer: it builds the
megatron model from ``hf_dir`` (TP=1, PP=1, fp32), perturbs every parameter (the "optimizer
step"), writes the weight snapshot with ``save_hf_checkpoint`` and returns, per prompt, the
megatron model's own greedy continuation and its log-probs at temperature 1. Run it in a
process of its own (``tests.distributed.run_distributed``).
"""

from __future__ import annotations

import os

import torch

from megatron_rl.rollout import EngineSettings, GenerationRequest, SamplingSettings


def trainer_update(hf_dir: str, snap_dir: str, prompts: list[tuple[int, ...]], max_new: int):
    from megatron_rl.models import load_model_from_hf, save_hf_checkpoint
    from megatron_rl.parallel.inference import forward_logits, forward_logprobs
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=1, pp=1)
    model, spec = load_model_from_hf(hf_dir)
    model.eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=gen))
    save_hf_checkpoint(model, spec, snap_dir, source_dir=hf_dir)
    out = []
    for prompt in prompts:
        ids = torch.tensor(prompt)
        for _ in range(max_new):
            logits = forward_logits(model, ids[None], vocab_size=spec.vocab_size)[0, -1]
            ids = torch.cat([ids, logits.argmax()[None]])
        lps = forward_logprobs(model, ids[None], vocab_size=spec.vocab_size, temperature=1.0)[0, len(prompt) - 1 :]
        out.append((tuple(ids[len(prompt) :].tolist()), lps.tolist()))
    return out


def hf_teacher_forced_logprobs(hf_dir, prompt: tuple[int, ...], response: tuple[int, ...], temperature: float):
    """Under transformers: ``log_softmax(logits / T)`` of each response token and the argmax token
    at each response position (both ``[len(response)]``; T = 1 for greedy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / t, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
    return logprobs, logits.argmax(-1)


def engine_settings(backend: str, hf_dir, **extra) -> EngineSettings:
    """The test engine of ``backend``: hf, two workers pinned to the first and last core (the
    pool's routing and restarts); vllm, one worker on the last core with a small KV cache."""
    if backend == "hf":
        cores = sorted(os.sched_getaffinity(0))
        return EngineSettings(
            dtype="float32",
            engine="hf",
            model_path=str(hf_dir),
            num_engines=2,
            devices=(f"cpu:{cores[0]}", f"cpu:{cores[-1]}"),
            max_batch_size=3,
            **extra,
        )
    return EngineSettings(
        engine="vllm",
        dtype="float32",
        model_path=str(hf_dir),
        num_engines=1,
        devices=(f"cpu:{max(os.sched_getaffinity(0))}",),
        max_batch_size=4,
        worker_env={"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "1"},
        vllm={"max_model_len": 128},
        **extra,
    )


def request(rid: str, prompt: tuple[int, ...], *, temperature=1.0, top_p=1.0, max_new=8, stop=(), seed=None):
    """A ``GenerationRequest`` with the given sampling settings."""
    return GenerationRequest(
        request_id=rid,
        prompt_ids=prompt,
        sampling=SamplingSettings(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new, stop_token_ids=tuple(stop), seed=seed
        ),
    )


def run_all(engine, requests) -> dict:
    """Generate ``requests``; check each is answered exactly once; results by request id."""
    results = list(engine.generate(requests))
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in requests)
    return {r.request_id: r for r in results}


def greedy_gap(engine, prompts, reference, *, version: int, max_new: int = 6) -> float:
    """Greedy-decode ``prompts`` on ``engine``; assert every continuation equals ``reference``
    (``trainer_update``'s output) and carries ``version``; return the max |log-prob| gap."""
    got = run_all(engine, [request(f"g{i}", p, temperature=0.0, max_new=max_new) for i, p in enumerate(prompts)])
    gaps = []
    for i, (tokens, logprobs) in enumerate(reference):
        assert got[f"g{i}"].response_ids == tokens and got[f"g{i}"].weight_version == version
        gaps.append((torch.tensor(got[f"g{i}"].logprobs) - torch.tensor(logprobs)).abs().max().item())
    return max(gaps)


def load_snapshot_tensors(snapshot_dir) -> dict:
    """Every tensor of the safetensors files in ``snapshot_dir``, by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(snapshot_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def make_sender(engine, transport: str, named_tensors, scratch, *, bucket_mb: int = 256):
    """``transport``'s sender of fixed HF-named tensors into ``engine``, as the trainer's is
    built (a one-rank replica); its groups and files live as long as it does."""
    from pathlib import Path

    from megatron_rl.weight_sync import SenderSetup, TensorSource, build_sender

    setup = SenderSetup(
        source=TensorSource(named_tensors), engine=engine, scratch=Path(scratch), bucket_bytes=bucket_mb << 20
    )
    return build_sender(transport, setup)


def sync(engine, transport: str, named_tensors, version: int, scratch, *, bucket_mb: int = 256) -> None:
    """One sync of fixed HF-named tensors into ``engine`` by a new ``transport`` sender."""
    make_sender(engine, transport, named_tensors, scratch, bucket_mb=bucket_mb).sync(version)
