"""Chaos run: a short CPU training under random faults, stopped by SIGTERM and resumed.

    python tools/chaos.py [--steps 6] [--seed 0] [--out DIR] [--scenarios stop,rank-kill]

On a tiny random model with two hf engine workers: seeded per step, a worker is killed
(SIGKILL) or hung (SIGSTOP: alive but silent, found by ``rollout.request_timeout_s``) in the
middle of a batch, and the reward function raises for some samples (scored 0 and counted by
the reward guard). The same seeded faults hit two runs: one left alone, one sent SIGTERM after
its second step (it stops after the step in progress with a checkpoint) and then resumed from
that checkpoint. Prints one JSON line:

    {"steps", "samples_expected", "samples_trained", "duplicates", "lost", "resumed_equal", ...}

``duplicates`` / ``lost``: engine answers given twice / never, over every step of both runs;
``resumed_equal``: the stopped-and-resumed run ends with the uninterrupted run's weights, within
1e-5 relative (``resumed_max_rel_diff``): in periodic mode the gradient of a step is summed in
the groups' arrival order, which the faults change, so the two runs agree to float rounding.
Exit status 1 unless lost = duplicates = 0, every sample was trained and resumed_equal.

Scenario ``rank-kill`` (a trainer rank dies: OOM, a lost node): the same seeded run on two
ranks under ``torchrun --max-restarts 1`` with ``trainer.save_every=1`` and
``trainer.resume_from=auto``; once ``step_2`` is saved, rank 1 is SIGKILLed mid-run; torchrun
restarts the world, which continues from the last complete checkpoint. Its figures
(``rank_kill_*``) are checked the same way: no engine answer lost or duplicated in the steps
each attempt trained, every sample of every step trained once (the last attempt's row per
step), and its final weights equal the uninterrupted one-rank run's (DP = 2 sums the same
gradients: ``tests/test_data_parallel.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

from megatron_rl.rollout.engine_wrapper import EngineWrapper

REPO = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 3, 4
RESUME_RTOL = 1e-5


def flaky_reward(record, response_text: str) -> float:
    """Share of digits in the response; raises for ~15% of (prompt, response) pairs (deterministic)."""
    key = f"{getattr(record, 'prompt_id', '')}|{response_text}".encode()
    if hashlib.blake2b(key, digest_size=2).digest()[0] < 38:
        raise ValueError("chaos: this reward function failed")
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


class ChaosEngine(EngineWrapper):
    """A real engine pool; in steps picked by ``seed`` one worker is killed or hung mid-batch.
    Every answer's request id is appended to ``answers_file`` (one per line)."""

    def __init__(self, inner, seed: int, answers_file: Path) -> None:
        super().__init__(inner)
        self.seed, self.answers_file = seed, answers_file

    def generate(self, requests):
        step = int(requests[0].request_id.split("/")[0])
        fault = random.Random(f"{self.seed}:{step}").choice(["kill", "hang", None])
        with self.answers_file.open("a") as log:
            for n, result in enumerate(self.inner.generate(requests)):
                if n == 2 and fault is not None:
                    victim = self.inner.status()[step % len(self.inner.status())].pid
                    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                log.write(result.request_id + "\n")
                log.flush()
                yield result


def _train(config: str, overrides: list[str], seed: int, answers_file: str) -> None:
    """One training process (spawned): chaos engine, the tools dir importable for the reward."""
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron_rl.config import load_config
    from megatron_rl.rollout import build_engine
    from megatron_rl.trainer.loop import train

    train(
        load_config(config, overrides),
        platform="cpu",
        engine_factory=lambda s: ChaosEngine(build_engine(s), seed, Path(answers_file)),
    )


def _rank_worker(argv: list[str]) -> None:
    """A torchrun rank of the rank-kill scenario: records its pid, answers go to one file per attempt."""
    config, seed, out, *overrides = argv
    rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (Path(out) / f"pid_rank{rank}_attempt{attempt}").write_text(str(os.getpid()))
    _train(config, overrides, int(seed), str(Path(out) / f"answers_c{attempt}.txt"))


def _torchrun_command(config: str, seed: int, out: Path) -> list[str]:
    """A two-rank torchrun world (one restart allowed) of ``_rank_worker``, checkpointing every step into ``out``."""
    overrides = [
        f"trainer.save_dir={out}",
        f"trainer.log_dir={out}/logs",
        "trainer.save_every=1",
        "trainer.resume_from=auto",
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        str(Path(__file__)),
        "--rank-worker",
        config,
        str(seed),
        str(out),
        *overrides,
    ]


def _run_killing_rank1(command: list[str], out: Path) -> tuple[int, bool]:
    """Run ``command``; SIGKILL rank 1's first attempt once step 2's checkpoint exists. (exit code, killed)."""
    with (out / "torchrun.log").open("w") as log:  # both attempts' output, for a post-mortem
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    victim = out / "pid_rank1_attempt0"
    while proc.poll() is None and not ((out / "step_2").is_dir() and victim.is_file()):
        time.sleep(0.2)
    killed = proc.poll() is None
    if killed:
        os.kill(int(victim.read_text()), signal.SIGKILL)
    return proc.wait(), killed


def _rows_by_step(metrics: Path) -> dict[int, dict]:
    """step -> metrics row; a step logged before the kill and again after the restart: the last counts."""
    rows = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return rows


def _kill_a_rank(config: str, seed: int, out: Path, steps: int) -> dict:
    """Run the rank-kill scenario (module doc) into ``out``; its figures."""
    out.mkdir(parents=True, exist_ok=True)
    code, killed = _run_killing_rank1(_torchrun_command(config, seed, out), out)
    firsts = [min(int(r.split("/")[0]) for r in f.read_text().split()) for f in sorted(out.glob("answers_c1.txt"))]
    resumed_at = firsts[0] if firsts else steps
    counts = [
        _answer_counts(out / "answers_c0.txt", range(resumed_at)),
        _answer_counts(out / "answers_c1.txt", range(resumed_at, steps)),
    ]
    rows = _rows_by_step(out / "logs" / "metrics.jsonl")
    return {
        "rank_kill_exit": code,
        "rank_kill_killed": killed,
        "rank_kill_resumed_at": resumed_at,
        "rank_kill_duplicates": sum(d for d, _ in counts),
        "rank_kill_lost": sum(n for _, n in counts),
        "rank_kill_samples_trained": int(sum(r["train/responses"] for r in rows.values())),
        "rank_kill_steps_logged": len(rows),
    }


def _spawn(
    config: str,
    overrides: list[str],
    seed: int,
    answers: Path,
    *,
    sigterm_after_steps: int | None = None,
    log_dir: Path | None = None,
) -> int:
    """One training process; SIGTERMed once ``log_dir`` has ``sigterm_after_steps`` metrics rows. Its exit code."""
    proc = mp.get_context("spawn").Process(target=_train, args=(config, overrides, seed, str(answers)))
    proc.start()
    if sigterm_after_steps is not None:
        metrics = Path(log_dir) / "metrics.jsonl"
        while proc.is_alive() and (not metrics.exists() or metrics.read_text().count("\n") < sigterm_after_steps):
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
    proc.join()
    return proc.exitcode


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for file in sorted(path.glob("*.safetensors")) for k, v in load_file(file).items()}


def _write_config(tmp: Path, steps: int) -> Path:
    from megatron_rl.models.synthetic import write_char_llama

    model = write_char_llama(tmp / "model", hidden=64, layers=2, heads=2, kv_heads=2, seed=0)
    cfg = {
        "model": {"hf_path": str(model), "dtype": "float32"},
        "attention": {"backend": "split"},
        "rollout": {
            "engine": "hf",
            "num_engines": 2,
            "max_batch_size": 4,
            "request_timeout_s": 5.0,
            "max_restarts": 4,
            "sampling": {"max_new_tokens": 8, "seed": 3},
        },
        "pipeline": {"mode": "periodic", "micro_batch_tokens": 256},
        "control": {"kind": "fixed", "group_size": GROUP},
        "data": {
            "source": "reasoning_gym:basic_arithmetic",
            "size": 32,
            "seed": 1,
            "chat_template": False,
            "max_prompt_tokens": 200,
        },
        "reward": {"fn": "chaos:flaky_reward"},
        "trainer": {"steps": steps, "prompts_per_batch": PROMPTS, "lr": 1e-2, "adam_eps": 1e-3, "seed": 5},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trained(log_dir: Path) -> tuple[int, int]:
    """(steps logged, samples trained) from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return len(rows), int(sum(r["train/responses"] for r in rows))


def _answer_counts(path: Path, steps: range) -> tuple[int, int]:
    """(duplicates, lost) among one process's engine answers for the steps it trained."""
    ids = Counter(path.read_text().split()) if path.exists() else Counter()
    duplicates = sum(n - 1 for n in ids.values() if n > 1)
    per_step = Counter(rid.split("/")[0] for rid in ids)
    lost = sum(max(0, PROMPTS * GROUP - per_step[str(t)]) for t in steps)
    return duplicates, lost


def run(steps: int, seed: int, tmp: Path, scenarios: tuple[str, ...] = ("stop", "rank-kill")) -> dict:
    config = str(_write_config(tmp, steps))
    a = tmp / "uninterrupted"
    _spawn(config, [f"trainer.save_dir={a}", f"trainer.log_dir={a}/logs"], seed, tmp / "answers_a.txt")
    report: dict = {"steps": steps, "scenarios": list(scenarios)}
    if "stop" in scenarios:
        report |= _stop_and_resume(config, seed, tmp, steps, a)
    if "rank-kill" in scenarios:
        report |= _kill_a_rank(config, seed, tmp / "rank_kill", steps)
        wa, wc = _weights(a / f"step_{steps}" / "model"), _weights(tmp / "rank_kill" / f"step_{steps}" / "model")
        gap = max(((wa[k] - wc[k]).abs().max() / wa[k].abs().max()).item() for k in wa)
        report |= {"rank_kill_resumed_equal": gap <= RESUME_RTOL, "rank_kill_max_rel_diff": gap}
    return report


def _stop_and_resume(config: str, seed: int, tmp: Path, steps: int, a: Path) -> dict:
    """The SIGTERM-and-resume scenario against the uninterrupted run ``a``; its figures."""
    b = tmp / "stopped"
    _spawn(
        config,
        [f"trainer.save_dir={b}", f"trainer.log_dir={b}/logs"],
        seed,
        tmp / "answers_b1.txt",
        sigterm_after_steps=2,
        log_dir=b / "logs",
    )
    stopped_at = max(int(p.name.split("_")[1]) for p in b.glob("step_*"))
    _spawn(
        config,
        [f"trainer.save_dir={b}", f"trainer.log_dir={b}/logs", f"trainer.resume_from={b}/step_{stopped_at}"],
        seed,
        tmp / "answers_b2.txt",
    )
    segments = {
        "answers_a.txt": range(steps),
        "answers_b1.txt": range(stopped_at),
        "answers_b2.txt": range(stopped_at, steps),
    }
    counts = [_answer_counts(tmp / name, rng) for name, rng in segments.items()]
    logged = [_trained(a / "logs"), _trained(b / "logs")]
    wa, wb = _weights(a / f"step_{steps}" / "model"), _weights(b / f"step_{steps}" / "model")
    gap = max(((wa[k] - wb[k]).abs().max() / wa[k].abs().max()).item() for k in wa)
    return {
        "samples_expected": 2 * steps * PROMPTS * GROUP,
        "samples_trained": sum(n for _, n in logged),
        "duplicates": sum(d for d, _ in counts),
        "lost": sum(n for _, n in counts),
        "resumed_equal": gap <= RESUME_RTOL,
        "resumed_max_rel_diff": gap,
        "stopped_at_step": stopped_at,
        "steps_logged": [n for n, _ in logged],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--scenarios", default="stop,rank-kill", help="stop (SIGTERM + resume), rank-kill")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-worker"]:
        _rank_worker(argv[1:])
        return 0
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (SIGTERM comes after step 2)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="megatron_rl-chaos-") as scratch:
        tmp = args.out or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        report = run(args.steps, args.seed, tmp, tuple(args.scenarios.split(",")))
    print(json.dumps(report))
    return 0 if _passed(report) else 1


def _passed(report: dict) -> bool:
    """Nothing lost or duplicated, every sample trained, resumed weights equal, per scenario run."""
    ok = True
    if "stop" in report["scenarios"]:
        ok &= (
            report["lost"] == 0
            and report["duplicates"] == 0
            and report["resumed_equal"]
            and report["samples_trained"] == report["samples_expected"]
        )
    if "rank-kill" in report["scenarios"]:
        ok &= (
            report["rank_kill_killed"]
            and report["rank_kill_exit"] == 0
            and report["rank_kill_lost"] == 0
            and report["rank_kill_duplicates"] == 0
            and report["rank_kill_resumed_equal"]
            and report["rank_kill_samples_trained"] == report["steps"] * PROMPTS * GROUP
        )
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
