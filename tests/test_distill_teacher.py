"""On-policy distillation's teacher side (``pipeline/teacher.py``): the teacher's per-token
log-probs equal a transformers teacher-forced forward of the teacher checkpoint (independent of
the engine), ride on ``Sample`` into the packed micro-batch, the shipped copy and the recording,
a teacher with another tokenizer is refused naming ``distill.teacher``, and a distillation run on
a tiny model on the emulated NPU trains with a finite loss and ``distill/*`` metrics, replayed alike."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from megatron_rl.pipeline.recording import item_from_json, item_to_json, read_recording
from megatron_rl.pipeline.records import Sample, ScoredGroup, make_micro_batch
from megatron_rl.pipeline.teacher import TeacherSettings, TeacherStage, check_same_tokenizer
from megatron_rl.trainer.replica import shipped
from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config, train_run

PAIRS = [((5, 9, 11, 4), (7, 7, 20, 3, 9)), ((5, 9, 11, 4), (12,)), ((5, 9, 11, 4), (30, 2, 8))]


def _group(pairs=PAIRS, teacher=None, kept=True) -> ScoredGroup:
    samples = tuple(
        Sample(
            prompt_id="p0",
            request_id=f"0/p0/{k}",
            index=k,
            prompt_ids=prompt,
            response_ids=response,
            behav_logprobs=tuple(-0.5 - 0.1 * i for i in range(len(response))),
            weight_version=0,
            finish_reason="stop",
            reward=float(k),
            teacher_logprobs=None if teacher is None else teacher[k],
        )
        for k, (prompt, response) in enumerate(pairs)
    )
    g = len(samples)
    return ScoredGroup(
        step=0,
        prompt_index=0,
        prompt_id="p0",
        samples=samples,
        rewards=torch.arange(g, dtype=torch.float32),
        advantages=torch.linspace(-1, 1, g),
        kept=kept,
    )


def _transformers_logprobs(model_dir, pairs, temperature: float) -> list[list[float]]:
    """log_softmax(logits / T) of each response token, teacher-forced, by transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for prompt, response in pairs:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist())
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    return tmp, make_tiny_rl_model(tmp / "student", seed=0), make_tiny_rl_model(tmp / "teacher", seed=7)


def test_teacher_logprobs_equal_a_transformers_forward_of_the_teacher(models):
    from megatron_rl.rollout import EngineSettings, build_engine

    _, _, teacher_dir = models
    engine = build_engine(EngineSettings(engine="hf", model_path=str(teacher_dir), model_dtype="float32"))
    try:
        for temperature in (1.0, 0.7):
            stage = TeacherStage(engine, TeacherSettings(temperature=temperature, concurrency=2))
            stage.submit(_group())
            stage.submit(_group(kept=False))  # never trained: passes through unscored
            out = stage.drain(threading.Event(), 0.05)  # in completion order: the dropped one first
            metrics = stage.batch_metrics()
            (scored,), (dropped,) = [g for g in out if g.kept], [g for g in out if not g.kept]
            expected = _transformers_logprobs(teacher_dir, PAIRS, temperature)
            for sample, want in zip(scored.samples, expected, strict=True):
                got, want = torch.tensor(sample.teacher_logprobs), torch.tensor(want, dtype=torch.float32)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert all(s.teacher_logprobs is None for s in dropped.samples)
            assert metrics["distill/teacher_s"] > 0 and metrics["distill/teacher_wall_s"] > 0
            assert set(metrics) == {f"distill/teacher_{k}" for k in ("s", "wall_s", "wait_s", "overlap")}
    finally:
        engine.shutdown()


def test_a_teacher_with_another_tokenizer_is_refused(models):
    from transformers import AutoTokenizer

    _, student_dir, teacher_dir = models
    student = AutoTokenizer.from_pretrained(student_dir)
    check_same_tokenizer(student, AutoTokenizer.from_pretrained(teacher_dir), str(teacher_dir))  # same: passes
    other = AutoTokenizer.from_pretrained(teacher_dir)
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    with pytest.raises(ValueError, match=r"distill\.teacher: .* does not share the student's tokenizer"):
        check_same_tokenizer(student, other, "other")


def test_teacher_logprobs_are_packed_shipped_and_recorded():
    teacher = [tuple(-1.0 - 0.01 * (10 * k + i) for i in range(len(r))) for k, (_, r) in enumerate(PAIRS)]
    group = _group(teacher=teacher)
    mb = make_micro_batch([group], policy_version=0)
    flat = torch.tensor([v for t in teacher for v in t], dtype=torch.float32)
    assert torch.equal(mb.teacher_logprobs, flat)  # packed order: sample by sample
    assert torch.equal(shipped(mb).teacher_logprobs, flat)  # what a DP replica gets
    back = item_from_json(json.loads(json.dumps(item_to_json(group))))
    assert [s.teacher_logprobs for s in back.samples] == teacher
    assert make_micro_batch([_group()], policy_version=0).teacher_logprobs is None
    mixed = ScoredGroup(**{**group.__dict__, "samples": (*group.samples[:2], _group().samples[2])})
    with pytest.raises(ValueError, match="has no teacher log-probs, others have"):
        make_micro_batch([mixed], policy_version=0)
    with pytest.raises(ValueError, match="teacher log-probs for"):
        Sample(**{**group.samples[0].__dict__, "teacher_logprobs": (0.0,)})


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_distillation_run_trains_with_distill_metrics_and_replays(models):
    tmp, student_dir, teacher_dir = models
    loss = "distill"
    (tmp / loss).mkdir()
    config = tiny_rl_config(tmp / loss, student_dir, trainer={"steps": 2, "prompts_per_batch": 2})
    rec = tmp / loss / "live.jsonl"
    overrides = [f"algorithm.loss={loss}", f"distill.teacher={teacher_dir}", "distill.coef=0.5"]
    (live,) = run_distributed(train_run, 1, str(config), [*overrides, f"rollout.record={rec}"], timeout_s=600)
    for h in live:
        assert math.isfinite(h["loss/value"]) and h["distill/tokens"] > 0, h
        assert math.isfinite(h["distill/kl"]) and h["distill/kl"] != 0.0
        assert h["distill/teacher_s"] > 0 and 0.0 <= h["distill/teacher_overlap"] <= 1.0
    groups = [g for g in read_recording(rec) if isinstance(g, ScoredGroup) and g.kept]
    assert groups and all(s.teacher_logprobs is not None for g in groups for s in g.samples)
    (replayed,) = run_distributed(train_run, 1, str(config), overrides, str(rec), timeout_s=600)
    for a, b in zip(live, replayed, strict=True):
        assert a["distill/kl"] == pytest.approx(b["distill/kl"], rel=1e-6)
        assert a["loss/value"] == pytest.approx(b["loss/value"], rel=1e-5)
