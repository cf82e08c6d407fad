"""Rollout engine settings (device strings, validation) and the ``hf`` engine's sampling math,
each against values written out here."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import SamplingConfig
from megatron_rl.rollout import DeviceAssignment, EngineSettings, SamplingSettings, parse_device
from megatron_rl.rollout.build import worker_specs
from megatron_rl.rollout.sampling import sample_next, top_p_mask


@pytest.mark.parametrize(
    ("text", "kind", "ids"),
    [
        ("cpu", "cpu", ()),
        ("cpu:1", "cpu", (1,)),
        ("cpu:0-2", "cpu", (0, 1, 2)),
        ("cpu:0,3-4", "cpu", (0, 3, 4)),
        ("cuda:0", "cuda", (0,)),
        ("cuda:2,3", "cuda", (2, 3)),
        ("npu:7", "npu", (7,)),
    ],
)
def test_parse_device(text, kind, ids):
    assert parse_device(text) == DeviceAssignment(kind=kind, ids=ids)


@pytest.mark.parametrize("text", ["gpu:0", "cuda", "cpu:", "cpu:2-1", "cpu:1,1", "cpu:a"])
def test_parse_device_rejects(text):
    with pytest.raises(ValueError, match="rollout.devices"):
        parse_device(text)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"engine": "sglang"}, "rollout.engine"),
        ({"dtype": "int8"}, "rollout.dtype"),
        ({"num_engines": 0}, "rollout.num_engines"),
        ({"max_batch_size": 0}, "rollout.max_batch_size"),
        ({"max_restarts": -1}, "rollout.max_restarts"),
        ({"num_engines": 2, "devices": ("cpu:0",)}, "rollout.devices"),
        ({"engine": "vllm", "tensor_parallel_size": 2}, "rollout.tensor_parallel_size"),
        ({"engine": "vllm", "tensor_parallel_size": 2, "devices": ("cuda:0",)}, r"rollout.devices: \[0\] = 'cuda:0'"),
        ({"tensor_parallel_size": 2, "devices": ("cuda:0,1",)}, "rollout.tensor_parallel_size"),
        ({"model_path": "/nonexistent/model"}, "model.hf_path"),
        ({"vllm": {"max_model_len": 64}}, "rollout.vllm: is only for rollout.engine 'vllm'"),
        ({"dtype": "float16"}, "rollout.dtype"),  # the schema's DType: float16 is not a trainer or engine dtype
        ({"model_dtype": "float16"}, "model.dtype"),
    ],
)
def test_settings_errors_name_the_field(tmp_path, changes, field):
    # refused when built (the config's own rollout rules) or, for the weights, when the specs are made
    with pytest.raises(ValueError, match=field):
        worker_specs(EngineSettings(**{"model_path": str(tmp_path)} | changes))


def test_worker_specs_one_per_device(tmp_path):
    specs = worker_specs(
        EngineSettings(
            dtype="float32",
            engine="vllm",
            model_path=str(tmp_path),
            num_engines=2,
            devices=("cuda:0,1", "cuda:2,3"),
            tensor_parallel_size=2,
            sampling=SamplingConfig(seed=5),
        )
    )
    assert [(s.index, s.device.ids, s.seed) for s in specs] == [(0, (0, 1), 5), (1, (2, 3), 6)]


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0)]
)
def test_sampling_settings_reject(field, value):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingSettings(**{field: value})


def test_top_p_mask_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]])
    keep = top_p_mask(probs, torch.tensor([0.8, 0.5]))
    # row 0: mass before each token = 0, .5, .8, .95 -> keep the first two; row 1: only the top one
    assert keep.tolist() == [[True, True, False, False], [True, False, False, False]]


def test_greedy_rows_take_the_argmax_and_report_temperature_one_logprobs():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 1.0, 0.5]])
    tokens, lps = sample_next(logits, torch.zeros(2), torch.ones(2), torch.tensor([0.99, 0.0]))
    assert tokens.tolist() == [1, 0]  # first index on ties
    expected = [2.0 - torch.logsumexp(logits[0], 0).item(), 3.0 - torch.logsumexp(logits[1], 0).item()]
    torch.testing.assert_close(lps, torch.tensor(expected))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (2.0, 0.7)])
def test_inverse_cdf_sampling_frequencies(temperature, top_p):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # an even grid stands in for the uniforms
    tokens, lps = sample_next(logits.expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_p), u)
    # independent reference: tempered softmax, nucleus by hand, renormalised
    p = [float(torch.exp(torch.tensor(x / temperature))) for x in logits.tolist()]
    p = [x / sum(p) for x in p]
    order = sorted(range(5), key=lambda i: -p[i])
    kept, mass = [], 0.0
    for i in order:
        if mass < top_p:
            kept.append(i)
        mass += p[i]
    target = [p[i] / sum(p[j] for j in kept) if i in kept else 0.0 for i in range(5)]
    freq = torch.bincount(tokens, minlength=5).double() / n
    torch.testing.assert_close(freq, torch.tensor(target, dtype=torch.float64), rtol=0, atol=1e-3)
    # behaviour log-probs are those of the distribution sampled from (top-p renormalised)
    torch.testing.assert_close(lps, torch.log(torch.tensor(target, dtype=torch.float32))[tokens], rtol=0, atol=1e-5)
