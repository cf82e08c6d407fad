"""Weight sync of MoE checkpoints into the ``hf`` engine (transformers 5 models), every family.

transformers 5 loads an MoE checkpoint through its ``conversion_mapping``: per-expert matrices
fused into ``experts.gate_up_proj`` / ``experts.down_proj``, and for Mixtral the module renamed
(``block_sparse_moe`` -> ``mlp``, router included). A weight sync sends the checkpoint's names
(the trainer's export writes the same names). After syncing checkpoint B into an engine started
on checkpoint A, the engine's model must equal transformers' own load of B, every parameter
bit for bit, and give B's logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_moe_models import MOE_FAMILIES, make_tiny_moe
from tests.rollout_reference import load_snapshot_tensors


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hf_engine_loads_every_moe_familys_checkpoint_names(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rl.config.devices import DeviceAssignment
    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.worker import WorkerSpec

    start = make_tiny_moe(tmp_path / "a", family, seed=0, layers=2)
    update = make_tiny_moe(tmp_path / "b", family, seed=1, layers=2)
    backend = HFBackend(WorkerSpec(index=0, backend="hf", model_path=str(start), device=DeviceAssignment(kind="cpu")))
    backend.load_tensors(sorted(load_snapshot_tensors(update).items()))
    engine = backend._model
    reference = AutoModelForCausalLM.from_pretrained(update, dtype=torch.float32)
    got, want = engine.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    ids = torch.tensor([[5, 17, 42, 100, 3]])
    with torch.no_grad():
        assert torch.equal(engine(ids).logits, reference(ids).logits)
