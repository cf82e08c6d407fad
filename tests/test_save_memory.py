"""A checkpoint save and a snapshot weight sync hold about one gathered tensor at a time (issue 17).

Subject: ``save_optimizer_state`` (Adam moments per HF parameter), ``save_hf_checkpoint``
(weights) and ``Replica.sync_weights`` with ``weight_sync: snapshot`` (which writes a HF
snapshot every step), each run on every rank of a 2-rank world. Measured as in
``test_memory_plan``: the rise of the kernel's resident high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) over the resident size before the call, glibc serving
every allocation above 64 KiB by mmap so freed tensors leave the RSS.

The model is shallow and wide (Qwen2, hidden 512, 2 layers, vocabulary 4096): its stage holds
~43 MB of fp32 weights and ~86 MB of Adam moments, its largest tensor (the embedding) 8.4 MB.
Streaming (gather one tensor to the writing rank, write it, free it) keeps the peak rise of
every rank near that tensor; holding the stage's tensors before writing (what the code did
before) costs the whole stage. Bound: 4 x the largest gathered tensor + 4 MiB: the writer
holds a tensor's shards (or, distributed optimizer, the DP-reduced buffer) and their HF
concatenation, gloo's reduce a scratch copy; the rest is interpreter noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_memory_plan import CLEAR_REFS, _status_bytes  # the RSS method of the plan check
from tests.test_policy_trainer import make_groups

SLACK = 4 << 20


def _peak_rise(call) -> int:
    """Bytes the resident high-water mark rose above the resident size during ``call()``."""
    before = _status_bytes("VmRSS")
    CLEAR_REFS.write_text("5")  # reset the high-water mark to the current RSS
    call()
    return _status_bytes("VmHWM") - before


def _wide_model(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _measure(path: str, out: str, tp: int, distributed: bool) -> dict[str, int]:
    from megatron.core import parallel_state as ps

    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, ParallelConfig, RolloutConfig, TrainerConfig
    from megatron_rl.models import save_hf_checkpoint
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import TrainerSettings, build_policy_trainer
    from megatron_rl.trainer.optimizer_state import save_optimizer_state
    from megatron_rl.trainer.replica import Replica, ReplicaChannel, SyncSettings

    initialize_parallel(tp=tp, pp=1)
    settings = TrainerSettings(
        hf_path=path,
        model=ModelConfig(hf_path=path, dtype="float32"),
        parallel=ParallelConfig(distributed_optimizer=distributed),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind="grpo"),
        trainer=TrainerConfig(steps=1, lr=1e-3),
    )
    trainer, policy, spec = build_policy_trainer(settings)
    trainer.train_micro_batch(make_micro_batch(make_groups(spec.vocab_size)[:1], policy_version=0))
    trainer.finish_mini_batch()  # the moments exist
    replica = Replica(
        trainer,
        policy,
        spec,
        engine=None,
        snapshot_root=Path(out) / "snapshots",
        source_dir=path,
        channel=ReplicaChannel(),
        sync=SyncSettings(weight_sync="snapshot", bucket_mb=RolloutConfig().sync_bucket_mb),
    )
    calls = {
        "optimizer_state": lambda d: save_optimizer_state(trainer.optimizer, policy, spec, Path(out) / d / "opt"),
        "hf_checkpoint": lambda d: save_hf_checkpoint(policy, spec, Path(out) / d / "model", source_dir=path),
        "snapshot_sync": lambda d: replica.sync_weights(int(d == "measured") + 1),
    }
    for call in calls.values():
        call("warm-up")  # first-call imports, caches and communication buffers are not the save's
    rises = {name: _peak_rise(lambda c=call: c("measured")) for name, call in calls.items()}
    full = [p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in policy.parameters()]
    return {
        **rises,
        "largest": max(full) * 4,
        "weights": sum(full) * 4,
        "moments": 2 * sum(full) * 4,
        "rank": ps.get_tensor_model_parallel_rank() + tp * ps.get_data_parallel_rank(),
    }


@pytest.mark.parametrize(("tp", "distributed"), [(2, False), (1, True)], ids=["tp2", "dp2_distributed_optimizer"])
def test_save_and_snapshot_peak_is_one_gathered_tensor(tmp_path, monkeypatch, tp, distributed):
    if not CLEAR_REFS.exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
    path = str(_wide_model(tmp_path / "wide"))
    ranks = run_distributed(_measure, 2, path, str(tmp_path), tp, distributed, fresh=True)  # process memory
    for m in ranks:
        print(
            f"rank {m['rank']}: largest tensor {m['largest'] / 2**20:.1f} MiB, stage weights "
            f"{m['weights'] / 2**20:.1f} MiB, moments {m['moments'] / 2**20:.1f} MiB; peak rise MiB: "
            + ", ".join(f"{k} {m[k] / 2**20:.1f}" for k in ("optimizer_state", "hf_checkpoint", "snapshot_sync"))
        )
    for m in ranks:
        bound = 4 * m["largest"] + SLACK
        for key in ("optimizer_state", "hf_checkpoint", "snapshot_sync"):
            assert m[key] <= bound, (
                f"rank {m['rank']}: {key} raised the peak by {m[key] / 2**20:.1f} MiB, more than "
                f"4 x the largest tensor + 4 MiB ({bound / 2**20:.1f} MiB)"
            )
