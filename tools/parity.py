"""Check a local HF checkpoint against its megatron-core TP/PP build: logits and log-probs.

    python tools/parity.py --model <hf dir> --tp 2 --pp 1
    python tools/parity.py --model <hf MoE dir> --tp 2 --ep 2   # Qwen3-MoE, Qwen2-MoE, Mixtral

Starts the ``tp * pp * ep`` ranks it needs itself (torchrun; EP splits the routed experts
over ``ep`` data-parallel ranks), builds the sharded megatron model from the checkpoint, runs
the same token batch through it and through HF transformers (fp32), and prints one JSON line:
``{"max_abs_logit_diff": ..., "max_abs_logprob_diff": ..., "tp": ..., "pp": ..., "ep": ...}``
(the largest difference over every rank).
Exit status 1 when a difference exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory (safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-3, help="max abs logit diff allowed (fp32)")
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this script under torchrun with tp * pp * ep ranks; relay rank 0's JSON line."""
    nproc = args.tp * args.pp * args.ep
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__, *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, env=env).returncode


def worker(args: argparse.Namespace) -> int:
    """One rank: megatron logits vs HF logits on rank 0."""
    import torch
    import torch.distributed as dist

    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.inference import forward_logits, forward_logprobs
    from megatron_rl.parallel.state import host_world_group, initialize_parallel

    initialize_parallel(tp=args.tp, pp=args.pp, ep=args.ep, seed=args.seed)
    model, spec = load_model_from_hf(args.model, params_dtype=torch.float32)
    model.eval()
    ids = torch.randint(
        0, spec.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed)
    )
    logits = forward_logits(model, ids, vocab_size=spec.vocab_size)
    logprobs = forward_logprobs(model, ids, vocab_size=spec.vocab_size, temperature=args.temperature)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    ref_lp = torch.log_softmax(ref[:, :-1] / args.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    diffs = torch.tensor([(logits - ref).abs().max().item(), (logprobs - ref_lp).abs().max().item()])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=host_world_group())
    status = 0
    if dist.get_rank() == 0:
        result = {
            "max_abs_logit_diff": diffs[0].item(),
            "max_abs_logprob_diff": diffs[1].item(),
            "tp": args.tp,
            "pp": args.pp,
            "ep": args.ep,
        }
        print(json.dumps(result), flush=True)
        status = int(result["max_abs_logit_diff"] > args.tolerance)
    dist.barrier()
    return status


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
