"""The options of ``python -m megatron_rl bench`` (one typed object), their argparse flags, and
what every scope needs around a run: peak memory, the world layout, the FLOP peak."""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from megatron_rl.bench.flops import DEVICES, detect_device, peak_tflops
from megatron_rl.bench.lengths import LengthDist

if TYPE_CHECKING:
    import torch

Scope = Literal["e2e", "train", "rollout"]
SCOPES: tuple[Scope, ...] = ("e2e", "train", "rollout")


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What to measure and how; the config and its overrides travel separately."""

    scope: Scope = "e2e"
    steps: int = 3  # measured steps
    warmup: int = 1  # steps run first and not measured
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(kind="fixed", a=64))  # train scope
    response_len: LengthDist = field(default_factory=lambda: LengthDist(kind="heavy", a=128, b=1.0))  # train scope
    peak_tflops: float | None = None  # overrides the table / CPU microbench
    device: str | None = None  # peak-table key; None = detected
    platform: str = "auto"  # auto | cpu | cuda | npu | emulated | emulated-npu
    seed: int = 0  # synthetic groups (train scope)
    compare: tuple[str, ...] = ()  # override variants run side by side

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"--scope {self.scope!r}: expected one of {', '.join(SCOPES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"--steps ({self.steps}) must be >= 1 and --warmup ({self.warmup}) >= 0")
        if self.device is not None and self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops {self.peak_tflops} must be > 0")

    def to_argv(self) -> list[str]:
        """These options as flags (without ``--compare``): how a variant subprocess is launched."""
        argv = [
            "--scope",
            self.scope,
            "--steps",
            str(self.steps),
            "--warmup",
            str(self.warmup),
            "--prompt-len",
            str(self.prompt_len),
            "--response-len",
            str(self.response_len),
            "--platform",
            self.platform,
            "--seed",
            str(self.seed),
        ]
        if self.peak_tflops is not None:
            argv += ["--peak-tflops", str(self.peak_tflops)]
        if self.device is not None:
            argv += ["--device", self.device]
        return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags on ``parser`` (``config`` and ``overrides`` are the caller's)."""
    from megatron_rl.platform.device import PLATFORMS

    parser.add_argument(
        "--scope",
        default="e2e",
        choices=SCOPES,
        help="e2e: the training loop; train: the trainer alone on synthetic groups; rollout: the engines alone",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    parser.add_argument(
        "--prompt-len", default="fixed:64", help="train scope: fixed:N | uniform:A,B | heavy:MEDIAN[,SIGMA]"
    )
    parser.add_argument(
        "--response-len",
        default="heavy:128,1.0",
        help="train scope: as --prompt-len, clipped to rollout.sampling.max_new_tokens",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device for MFU")
    parser.add_argument("--device", default=None, choices=DEVICES, help="peak-table key (default: detected)")
    parser.add_argument("--platform", default="auto", choices=PLATFORMS)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic groups (train scope)")
    parser.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="A.B=X",
        help="run one variant per override (quote several overrides together) and print ratios; put it last",
    )


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        scope=args.scope,
        steps=args.steps,
        warmup=args.warmup,
        prompt_len=LengthDist.parse(args.prompt_len, flag="--prompt-len"),
        response_len=LengthDist.parse(args.response_len, flag="--response-len"),
        peak_tflops=args.peak_tflops,
        device=args.device,
        platform=args.platform,
        seed=args.seed,
        compare=tuple(args.compare),
    )


def peak_memory(device_type: str) -> tuple[float, str]:
    """(GB, kind): the device allocator's peak on CUDA / NPU, else this process's peak resident set."""
    import torch

    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9, "device"
    if device_type == "npu":
        return torch.npu.max_memory_allocated() / 1e9, "device"  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "host_rss"  # Linux: KiB


def resolve_peak(opts: BenchOptions, device_type: str, dtype: torch.dtype) -> tuple[float, str]:
    """Peak TFLOP/s per device and its source, for ``device_type`` (or ``--device``)."""
    if opts.peak_tflops is not None:
        return peak_tflops("cpu", override=opts.peak_tflops, dtype=dtype)
    return peak_tflops(opts.device or detect_device(device_type), override=None, dtype=dtype)
