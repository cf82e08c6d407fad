"""Check a local HF checkpoint against its megatron-core TP/PP build: logits and log-probs.

    python tools/parity.py --model <hf dir> --tp 2 --pp 1
    python tools/parity.py --model <hf MoE dir> --tp 2 --ep 2   # Qwen3-MoE, Qwen2-MoE, Mixtral
    python tools/parity.py --model <hf dir> --tp 2 --lora-rank 8  # LoRA vs peft on the HF model
    python tools/parity.py --model <hf dir> --tp 2 --cp 2     # context parallelism, shared-prompt packing

Starts the ``tp * pp * ep`` ranks it needs itself (torchrun; EP splits the routed experts
over ``ep`` data-parallel ranks), builds the sharded megatron model from the checkpoint, runs
the same token batch through it and through HF transformers (fp32), and prints one JSON line:
``{"max_abs_logit_diff": ..., "max_abs_logprob_diff": ..., "tp": ..., "pp": ..., "ep": ...}``
(the largest difference over every rank).

With ``--cp N`` (N > 1; ``tp * pp * ep * cp`` ranks) the batch is packed the way the trainer packs
it: row b becomes a group whose prompt is its first half and whose responses are the second half
cut in two (shared-prompt layout, several groups), the model runs shared-prompt attention with
each CP rank holding its slice (``attention.cp_split``), and the logits of every packed position
are compared with transformers' forward of each ``[prompt, r_i]`` on its own; log-probs are
those of the response tokens. The line adds ``"cp"``.

With ``--lora-rank R`` (dense models) both sides carry the same LoRA adapters on every linear
(rank R, alpha ``--lora-alpha``): ``peft`` on the HF model, ``megatron_rl.lora.apply_lora`` on
ours, with A and B set to the same seeded random tensors (B != 0, so the adapters change the
logits) loaded into ours by PEFT's names. The logits are then those of the adapted models, and
the line adds ``lora_rank``, ``max_rel_logit_err`` and ``max_rel_adapter_grad_err`` (the
gradients of the mean next-token log-prob with respect to every adapter tensor, max |ours -
peft| / max |peft| per tensor).
Exit status 1 when a difference exceeds ``--tolerance`` (or, with LoRA, a relative error
``--rel-tolerance``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all megatron targets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory (safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (shared-prompt packed batch)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-3, help="max abs logit diff allowed (fp32)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every linear, vs peft (0: no LoRA)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (scale = alpha / rank)")
    p.add_argument("--rel-tolerance", type=float, default=1e-4, help="max relative LoRA logit / grad error")
    args = p.parse_args(argv)
    if args.cp < 1 or (args.cp > 1 and (args.lora_rank or args.seq_len < 4)):
        p.error(f"--cp {args.cp}: a size >= 1; with --cp > 1 no --lora-rank and --seq-len >= 4")
    if args.lora_rank < 0 or (args.lora_rank and args.ep > 1):
        p.error(f"--lora-rank {args.lora_rank}: a rank >= 0, on a dense model (--ep 1); LoRA skips routed experts")
    return args


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this script under torchrun with tp * pp * ep ranks; relay rank 0's JSON line."""
    nproc = args.tp * args.pp * args.ep * args.cp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__, *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, env=env).returncode


def worker(args: argparse.Namespace) -> int:
    """One rank: megatron logits vs HF logits on rank 0 (and LoRA's errors vs peft)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import host_world_group, initialize_parallel

    initialize_parallel(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, seed=args.seed)
    backend = "split" if args.cp > 1 else None  # CP runs the shared-prompt attention
    model, spec = load_model_from_hf(args.model, params_dtype=torch.float32, attention_backend=backend)
    model.eval()
    ids = torch.randint(
        0, spec.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed)
    )
    hf = _hf_model(args)
    lora = _LoraCheck(args, model, spec, hf, ids) if args.lora_rank else None
    errors = (_packed_errors if args.cp > 1 else _batch_errors)(args, model, spec, hf, ids)
    errors = [*errors[:2], *([errors[2], lora.grad_error()] if lora is not None else [])]  # LoRA: + rel errors
    diffs = torch.tensor(errors)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=host_world_group())
    status = 0
    if dist.get_rank() == 0:
        result = {"max_abs_logit_diff": diffs[0].item(), "max_abs_logprob_diff": diffs[1].item()}
        result |= {"tp": args.tp, "pp": args.pp, "ep": args.ep, "cp": args.cp}
        if lora is not None:
            result |= {"lora_rank": args.lora_rank, "max_rel_logit_err": diffs[2].item()}
            result["max_rel_adapter_grad_err"] = diffs[3].item()
        print(json.dumps(result), flush=True)
        status = int(result["max_abs_logit_diff"] > args.tolerance)
        status |= int(lora is not None and max(diffs[2:]).item() > args.rel_tolerance)
    dist.barrier()
    return status


def _batch_errors(args: argparse.Namespace, model, spec, hf, ids) -> list[float]:
    """[max |logit diff|, max |log-prob diff|, max relative logit error] of the ``[b, s]`` batch
    against transformers."""
    import torch

    from megatron_rl.parallel.inference import forward_logits, forward_logprobs

    logits = forward_logits(model, ids, vocab_size=spec.vocab_size)
    logprobs = forward_logprobs(model, ids, vocab_size=spec.vocab_size, temperature=args.temperature)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    ref_lp = torch.log_softmax(ref[:, :-1] / args.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return [(logits - ref).abs().max().item(), (logprobs - ref_lp).abs().max().item(), _relative(logits, ref)]


def _packed_errors(args: argparse.Namespace, model, spec, hf, ids) -> list[float]:
    """[max |logit diff|, max |log-prob diff|] of the shared-prompt packing of ``ids`` under CP
    against transformers on every ``[prompt, r_i]`` separately (see the module doc)."""
    import torch

    from megatron_rl.attention.packing import TokenGroup, pack_groups
    from megatron_rl.parallel.inference import forward_packed_logits

    half, groups = args.seq_len // 2, []
    for row in ids:
        cut = half + (args.seq_len - half) // 2
        groups.append(TokenGroup(prompt_ids=row[:half], response_ids=(row[half:cut], row[cut:])))
    (mb,) = pack_groups(groups, token_budget=ids.numel())
    logits = forward_packed_logits(model, mb, vocab_size=spec.vocab_size).cpu()
    ref = torch.empty_like(logits)
    start = 0
    with torch.no_grad():
        for g in groups:
            lp = g.prompt_ids.numel()
            r_start = start + lp
            for r in g.response_ids:
                copy = hf(torch.cat([g.prompt_ids, r])[None]).logits[0].float()
                ref[start : start + lp] = copy[:lp]  # every copy's prompt logits are the same
                ref[r_start : r_start + r.numel()] = copy[lp:]
                r_start += r.numel()
            start = r_start
    index, targets = mb.logit_index, mb.target_ids
    t = args.temperature
    lp_ours = torch.log_softmax(logits[index] / t, -1).gather(-1, targets[:, None])
    lp_ref = torch.log_softmax(ref[index] / t, -1).gather(-1, targets[:, None])
    return [(logits - ref).abs().max().item(), (lp_ours - lp_ref).abs().max().item()]


def _hf_model(args: argparse.Namespace):
    """The HF model in fp32; with --lora-rank, wrapped by peft with seeded random adapters."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    if not args.lora_rank:
        return hf
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=PEFT_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return peft_model


def _relative(ours, ref) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


class _LoraCheck:
    """Our LoRA model with peft's adapters loaded; the adapter gradients of both."""

    def __init__(self, args: argparse.Namespace, model, spec, peft_model, ids):
        from peft import get_peft_model_state_dict

        from megatron_rl.lora import LoraSettings, apply_lora, load_peft_tensors

        apply_lora(model, LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha), spec)
        load_peft_tensors(model, get_peft_model_state_dict(peft_model))
        self.model, self.spec, self.peft, self.ids = model, spec, peft_model, ids

    def grad_error(self) -> float:
        """Max relative error of this PP stage's adapter gradients (gathered over TP) vs peft's."""
        import torch

        from megatron_rl.lora import iter_peft_tensors
        from megatron_rl.parallel.gather import gather_tp
        from megatron_rl.parallel.schedule import run_schedule
        from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

        ids, vocab = self.ids, self.spec.vocab_size
        logits = self.peft(ids).logits.float()
        (-torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()).backward()
        ref = {n.replace(".default", ""): p.grad for n, p in self.peft.named_parameters() if "lora_" in n}

        def loss(output, batch):
            return -vocab_parallel_logprobs(output[:, :-1], batch[:, 1:], vocab_size=vocab).mean(), None

        positions = torch.arange(ids.shape[1]).expand_as(ids)
        forward = lambda m, batch: m(batch, positions, attention_mask=None)  # noqa: E731
        run_schedule(
            self.model, [ids], forward_step=forward, loss=loss, seq_length=lambda b: b.shape[1], forward_only=False
        )
        ours = dict(iter_peft_tensors(self.model, gather_tp, grad=True))
        return max(_relative(grad, ref[key]) for key, grad in ours.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        from megatron_rl.models.hf_config import check_parallel_fit, decoder_spec_from_hf, read_hf_config

        try:
            check_parallel_fit(decoder_spec_from_hf(read_hf_config(args.model)), args.tp, args.pp, args.ep)
        except (ValueError, FileNotFoundError) as err:
            print(f"parity.py: --model {args.model}: {err}", file=sys.stderr)
            return 2
        return launch(args, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
