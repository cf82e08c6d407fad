"""check-config rules of the ``distill`` section (on-policy distillation), each naming its key:
``distill_section`` within the section (``sections.SECTION_RULES``), ``check_distill`` across
sections (``validate.CROSS_SECTION_CHECKS``)."""

from __future__ import annotations

from typing import Any

from .devices import parse_device
from .fields import Found
from .schema import Config


def distill_section(d: Any) -> Found:
    """Positive counts and weight; one device string per teacher engine naming TP devices; hf runs TP 1."""
    for name in ("coef", "num_engines", "tensor_parallel_size", "max_batch_size", "concurrency"):
        if not getattr(d, name) > 0:
            yield f"distill.{name}", f"must be > 0, got {getattr(d, name)!r}"
    if d.engine == "hf" and d.tensor_parallel_size != 1:
        yield "distill.tensor_parallel_size", f"{d.tensor_parallel_size}, but the hf engine runs one device: use 1"
    if d.vllm and d.engine != "vllm":
        yield "distill.vllm", f"is only for distill.engine 'vllm', got {d.engine!r}"
    if d.devices and len(d.devices) != d.num_engines:
        yield "distill.devices", f"lists {len(d.devices)} entries but distill.num_engines = {d.num_engines}"
        return
    for i, text in enumerate(d.devices):
        try:
            device = parse_device(text, f"distill.devices[{i}]")
        except ValueError as err:
            yield "distill.devices", str(err)
            continue
        if device.kind != "cpu" and len(device.ids) != d.tensor_parallel_size:
            yield "distill.devices", f"[{i}] = {text!r} names {len(device.ids)} devices, TP is {d.tensor_parallel_size}"


def check_distill(cfg: Config) -> Found:
    """A distill loss needs a teacher (its files: ``resources.py``); a vllm teacher scores at temperature 1; a
    loss without reward drops no group by reward; the teacher's, judge's and reward model's devices are their own."""
    d, a = cfg.distill, cfg.algorithm
    yield from check_model_engine_devices(cfg)
    if a.loss == "distill" and d.teacher is None:
        yield "distill.teacher", "algorithm.loss 'distill' needs a teacher: set distill.teacher to its HF checkpoint"
    if d.teacher is None:
        return
    if d.engine == "vllm" and a.temperature != 1.0:
        yield (
            "distill.engine",
            f"vllm scores prompt tokens at temperature 1 only; algorithm.temperature is {a.temperature}",
        )
    if a.loss == "distill" and a.dynamic_sampling:
        yield "algorithm.dynamic_sampling", "drops groups by reward, but algorithm.loss 'distill' uses no reward"


def _device_ids(devices: list[str]) -> set[str]:
    """``kind:id`` of every accelerator the device strings name (CPU engines share nothing)."""
    out = set()
    for text in devices:
        try:
            device = parse_device(text)
        except ValueError:
            continue  # the section rules name the bad string
        if device.kind != "cpu":
            out |= {f"{device.kind}:{i}" for i in device.ids}
    return out


def check_model_engine_devices(cfg: Config) -> Found:
    """The teacher's, judge's and reward model's accelerators (when the run uses them) are their own:
    none named by the rollout engines' node-0 devices or by another of these models."""
    from .reward_rules import used_components

    r, used = cfg.reward, used_components(cfg.reward)
    nodes = cfg.rollout.engine_nodes or [0] * len(cfg.rollout.devices)
    owners = {
        i: "rollout.devices"
        for t, n in zip(cfg.rollout.devices, nodes, strict=False)
        if n == 0
        for i in _device_ids([t])
    }
    for key, role, devices, on in (
        ("distill.devices", "teacher", cfg.distill.devices, cfg.distill.teacher is not None),
        ("reward.judge.devices", "judge", r.judge.devices, "judge" in used),
        ("reward.model.devices", "reward model", r.model.devices, "model" in used),
    ):
        ids = _device_ids(devices) if on else set()
        for other in sorted({owners[i] for i in ids if i in owners}):
            shared = sorted(i for i in ids if owners.get(i) == other)
            yield key, f"{shared} are also {other}: the {role} needs devices of its own"
        owners.update({i: key for i in ids if i not in owners})
