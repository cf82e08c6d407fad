"""`plan` with LoRA: the frozen base once, adapters with their state, no reference copy.

References are independent of the plan's arithmetic: a real tiny model with ``lora.apply_lora``
wrapped by megatron's DDP and optimizer (``trainer.optim.wrap_for_training``), stepped once and
measured tensor by tensor at TP 1 and TP 2 (bf16: the fp32 masters show); and PEFT's own count of
Qwen2.5-7B's trainable parameters at r = 16 on every linear (``print_trainable_parameters``:
40,370,176, i.e. r·(in + out) per HF projection, written out by hand below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import load_config
from megatron_rl.plan import build_plan
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

REPO = Path(__file__).resolve().parents[1]
QWEN25 = "examples/recipes/qwen2.5-7b-grpo-910b/config.yaml"
RANK = 4


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def _qwen25_peft_count(r: int) -> int:
    """r·(in + out) over q, k, v, o, gate, up, down of Qwen2.5-7B's 28 layers (h 3584, kv 512, f 18944)."""
    h, kv, f = 3584, 4 * 128, 18944
    per_layer = (h + h) + (h + kv) + (h + kv) + (h + h) + (h + f) + (h + f) + (f + h)
    return 28 * r * per_layer


def test_adapter_count_equals_peft_and_tp_shards_it():
    cfg = load_config(QWEN25, ["parallel.tp=1", "lora.rank=16"])
    plan = build_plan(cfg, nodes=2, devices_per_node=8, device="910b")
    assert plan.worst.adapter_params == _qwen25_peft_count(16) == 40_370_176
    # tp 4: column B rows and row A columns split, the other tensor replicated (hand arithmetic)
    tp4 = build_plan(load_config(QWEN25, ["lora.rank=16"]), nodes=2, devices_per_node=8, device="910b")
    h, f, q, kv = 3584, 18944, 28 * 128, 4 * 128
    per_layer = 3 * 16 * h + 16 * (q + 2 * kv) // 4 + 2 * 16 * h + 2 * 16 * f // 4
    per_layer += 16 * q // 4 + 16 * h + 16 * f // 4 + 16 * h
    assert tp4.worst.adapter_params == 28 * per_layer


def test_lora_memory_terms_by_hand():
    """bf16 base once (kl > 0: the reference is no copy), adapters in bf16 with fp32 grads, moments
    and masters (sharded over dp 3 by the recipe's distributed optimizer); an old snapshot when
    two mini-batches make the old policy run."""
    full = build_plan(load_config(QWEN25), nodes=2, devices_per_node=8, device="910b").worst
    for extra, snapshots in (([], 1), (["trainer.mini_batches=2"], 2)):
        cfg = load_config(QWEN25, ["lora.rank=16", *extra])
        plan = build_plan(cfg, nodes=2, devices_per_node=8, device="910b")
        w, a = plan.worst, plan.worst.adapter_params
        assert plan.settings.copies == 2 + len(extra)  # policy + ref (+ old): three forwards still run
        assert w.params == full.params
        assert w.weights == 2 * w.params + snapshots * 2 * a
        assert w.grads == 4 * a
        assert w.optimizer == int(a * 12 / 3)
        if not extra:  # the "without LoRA" column is the full fine-tune's own plan
            assert max(s.total for s in plan.full_finetune) == full.total
    assert full.weights == 2 * 2 * full.params and full.grads == 4 * full.params


def test_report_shows_both_and_refusal_offers_lora(capsys):
    args = ["--nodes", "2", "--devices-per-node", "8", "--device", "910b"]
    assert main(["plan", QWEN25, "lora.rank=16", *args]) == 0
    out = capsys.readouterr().out
    assert "LoRA r 16" in out and "ref = adapters off" in out and "(adapters only)" in out
    assert "without LoRA" in out and "lora.rank=0" in out
    # a full fine-tune that does not fit: the refusal names lora.rank among the knobs
    assert main(["plan", QWEN25, "parallel.tp=1", "pipeline.micro_batch_tokens=3072", *args]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "lora.rank=64 fits" in out


def _measure(tp: int, path: str, targets: tuple[str, ...]) -> dict[str, int]:
    """One rank of a bf16 LoRA model under megatron DDP + optimizer after one step: bytes of
    the parameters, the DDP gradient buffers and the optimizer's state + fp32 masters."""
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.lora import LoraSettings, apply_lora
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.optim import wrap_for_training

    initialize_parallel(tp=tp, pp=1, platform="cpu")
    model, spec = load_model_from_hf(path, params_dtype=torch.bfloat16)
    apply_lora(model, LoraSettings(rank=RANK, alpha=8.0, target_modules=targets), spec)
    ddp, optimizer = wrap_for_training(model, TrainerConfig(steps=1))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    ddp(ids, torch.arange(16)[None], attention_mask=None).float().sum().backward()
    ddp.finish_grad_sync()
    optimizer.step()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inner = optimizer.optimizer
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    masters = [p for group in inner.param_groups for p in group["params"]]
    opt = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state + masters}
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers),
        "optimizer": sum(n for ptr, n in opt.items() if ptr not in param_ptrs),
    }


def _planned(path: Path, tp: int, targets: tuple[str, ...]):
    from megatron_rl.models.hf_config import decoder_spec_from_hf, read_hf_config
    from megatron_rl.plan import MemorySettings, MicroBatchShape, ModelDims, estimate_memory
    from megatron_rl.plan.lora_memory import LoraMemory

    dims = ModelDims.from_spec(decoder_spec_from_hf(read_hf_config(path)))
    settings = MemorySettings(
        tp=tp,
        pp=1,
        dp=1,
        dtype="bfloat16",
        copies=2,  # policy + ref (kl > 0): with LoRA the ref is the same module, adapters off
        distributed_optimizer=False,
        attention_backend="split",
        micro_batch=MicroBatchShape(tokens=16, prompt_len=8, response_len=8, responses=1, parts=1),
        lora=LoraMemory(rank=RANK, targets=targets),
    )
    (stage,) = estimate_memory(dims, settings)
    return stage


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("tp", "targets"),
    [(1, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")), (2, ("linear_qkv", "linear_fc2"))],
)
def test_lora_state_equals_a_real_model(tmp_path, tp, targets):
    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    planned = _planned(path, tp, targets)
    for measured in run_distributed(_measure, tp, tp, str(path), targets):
        assert measured["frozen"] == planned.params
        assert measured["weights"] == planned.weights  # base once + adapters, no reference copy
        assert measured["grads"] == planned.grads  # fp32, adapters only
        assert measured["optimizer"] == planned.optimizer  # Adam moments + fp32 masters, adapters only
