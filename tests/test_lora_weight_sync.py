"""LoRA weight sync (issue 32): each sync sends the adapted linears' merged weights
``W + scale * B A`` alone, and the engines keep every other weight from the base checkpoint.

The reference is ``peft``'s ``merge_and_unload()`` of the same adapters on the HF base model (an
independent implementation), at TP 1, TP 2 (merged ``linear_qkv`` shards gathered and split into
q / k / v) and PP 2 (each stage sends its own layers). A megatron policy with random adapters
syncs into a real ``hf`` engine through every transport (the adapters change before each sync, so
each transport must deliver): the engine's greedy tokens and log-probs equal transformers' on the
peft-merged model; the state dict an ``hf`` backend holds after a snapshot / shared-memory update
equals peft's merged state dict (frozen weights included: kept, not resent); the sender's export
holds the adapted tensors only, and the bytes a sync reports are theirs. The engine starts at a
resumed step's version from the base checkpoint, and ``Replica.prime_engines`` gives it the
resumed adapters before it generates. A full (non-partial) update must still cover every weight.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.lora import LoraSettings
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

RANK, ALPHA = 4, 8.0
PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]
MAX_NEW = 6
FIRST = 5  # the resumed step: the engines start from the base checkpoint at this version
# version -> transport of each sync; FIRST is prime_engines' (snapshot)
PLAN = ((FIRST, "snapshot"), (FIRST + 1, "broadcast"), (FIRST + 2, "shared_memory"), (FIRST + 3, "snapshot"))
PEFT_NAMES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
LOGPROB_ATOL = 1e-5
WEIGHT_ATOL = 1e-6

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _peft_targets(targets: tuple[str, ...]) -> list[str]:
    return [name for t in targets for name in PEFT_NAMES[t]]


def peft_versions(hf_dir, targets: tuple[str, ...], out_dir) -> dict[int, tuple[dict, str]]:
    """Per synced version: random PEFT adapter tensors (seeded by the version) and the directory of
    ``merge_and_unload()``'s HF checkpoint of them on the base model."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out = {}
    for version, _ in PLAN:
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=_peft_targets(targets), lora_dropout=0.0)
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(100 + version)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.2 * torch.randn(param.shape, generator=generator))
        tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        merged_dir = f"{out_dir}/merged_v{version}"
        model.merge_and_unload().save_pretrained(merged_dir)
        out[version] = (tensors, merged_dir)
    return out


def _greedy(engine, tag: str) -> list[tuple[tuple[int, ...], tuple[float, ...], int]]:
    from tests.rollout_reference import request, run_all

    got = run_all(engine, [request(f"{tag}{i}", p, temperature=0.0, max_new=MAX_NEW) for i, p in enumerate(PROMPTS)])
    return [
        (got[f"{tag}{i}"].response_ids, got[f"{tag}{i}"].logprobs, got[f"{tag}{i}"].weight_version) for i in range(3)
    ]


class RecordingEngine:
    """The leader's engine pool, keeping every update it was handed (to replay in-process)."""

    def __init__(self, inner) -> None:
        self.inner, self.updates = inner, {}

    def load_weights(self, update, version: int) -> None:
        self.updates[version] = update
        self.inner.load_weights(update, version)


def _engine(hf_dir: str):
    from megatron_rl.rollout import EngineSettings, build_engine

    settings = EngineSettings(
        dtype="float32",
        engine="hf",
        model_path=hf_dir,
        num_engines=1,
        max_batch_size=3,
        weight_sync="broadcast",
        request_timeout_s=120,
        initial_version=FIRST,
    )
    return RecordingEngine(build_engine(settings))


def _replicas(model, spec, hf_dir: str, engine, scratch: str) -> dict:
    from megatron_rl.trainer.replica import Replica, ReplicaChannel, SyncSettings

    channel, trainer = ReplicaChannel(), SimpleNamespace(begin_batch=lambda: None)
    common = dict(engine=engine, snapshot_root=scratch, source_dir=hf_dir, channel=channel)
    return {
        mode: Replica(trainer, model, spec, sync=SyncSettings(weight_sync=mode, bucket_mb=1), **common)
        for mode in ("snapshot", "broadcast", "shared_memory")
    }


def _backend_state(hf_dir: str, update) -> dict[str, torch.Tensor]:
    """The state dict of an in-process ``hf`` backend started from the base checkpoint after
    ``update`` (a snapshot or shared-memory message) went through its transport's receiver."""
    from megatron_rl.config.devices import DeviceAssignment
    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.worker import WorkerSpec
    from megatron_rl.weight_sync import build_receiver

    backend = HFBackend(WorkerSpec(index=0, backend="hf", model_path=hf_dir, device=DeviceAssignment(kind="cpu")))
    build_receiver(update.transport).receive(update.payload(), backend)
    return {k: v.clone() for k, v in backend._model.state_dict().items()}


def lora_sync(tp: int, pp: int, hf_dir: str, targets: tuple[str, ...], versions: dict, scratch: str) -> dict:
    """Every rank: the LoRA policy at TP x PP; the leader owns a 1-worker hf engine started from the
    base at version FIRST. Before each sync of PLAN the adapters are set to that version's."""
    from megatron_rl.lora import apply_lora, load_peft_tensors
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=tp, pp=pp)
    model, spec = load_model_from_hf(hf_dir)
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, target_modules=targets), spec)
    leader = torch.distributed.get_rank() == 0
    engine = _engine(hf_dir) if leader else None
    replicas = _replicas(model, spec, hf_dir, engine, scratch)
    try:
        out = {"base": _greedy(engine.inner, "b") if leader else None, "greedy": {}, "seconds": {}}
        for version, mode in PLAN:
            load_peft_tensors(model, versions[version][0])
            if version == FIRST:
                replicas[mode].prime_engines(version)
                out["export"] = {n: t.clone() for n, t in replicas[mode].weights.export()}
            else:
                replicas[mode].sync_weights(version)
                out["seconds"][version] = replicas[mode].pop_results()[1]
            out["greedy"][version] = _greedy(engine.inner, f"v{version}") if leader else None
        if leader:  # snapshot (v FIRST+3) and shared memory (v FIRST+2) through an in-process backend
            out["state"] = {v: _backend_state(hf_dir, engine.updates[v]) for v in (FIRST + 2, FIRST + 3)}
        return out
    finally:
        if engine is not None:
            engine.inner.shutdown()


def _reference_greedy(merged_dir: str) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """transformers' greedy continuation of each prompt on the peft-merged model and its log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        response = ids[0, len(prompt) :]
        out.append((tuple(response.tolist()), torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]))
    return out


def _assert_greedy_equal(got, merged_dir: str, version: int) -> None:
    for (tokens, logprobs, got_version), (ref_tokens, ref_logprobs) in zip(
        got, _reference_greedy(merged_dir), strict=True
    ):
        assert tokens == ref_tokens, f"version {version}: engine {tokens} != peft-merged {ref_tokens}"
        assert got_version == version
        assert (torch.tensor(logprobs) - ref_logprobs).abs().max().item() <= LOGPROB_ATOL, version


def _merged_state(merged_dir: str) -> dict[str, torch.Tensor]:
    from tests.rollout_reference import load_snapshot_tensors

    return load_snapshot_tensors(merged_dir)


CASES = {
    "tp1": (1, 1, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
    "tp2": (2, 1, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
    "pp2": (1, 2, ("linear_qkv", "linear_fc2")),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def synced(request, tmp_path_factory):
    tp, pp, targets = CASES[request.param]
    tmp = tmp_path_factory.mktemp(f"lora_sync_{request.param}")
    hf_dir = str(make_tiny_hf(tmp / "qwen2", "qwen2", seed=3, layers=2))
    versions = peft_versions(hf_dir, targets, tmp)
    results = run_distributed(lora_sync, tp * pp, tp, pp, hf_dir, targets, versions, str(tmp / "snap"), timeout_s=400)
    return SimpleNamespace(results=results, versions=versions, hf_dir=hf_dir, targets=targets, tp=tp, pp=pp)


def test_engine_generates_as_the_peft_merged_model_after_every_transport(synced):
    leader = synced.results[0]
    assert leader["base"] != leader["greedy"][FIRST], "the adapters did not change the engine's output"
    for version, _ in PLAN:
        _assert_greedy_equal(leader["greedy"][version], synced.versions[version][1], version)


def test_engine_weights_equal_peft_merge_and_unload(synced):
    """Snapshot and shared memory: the hf backend's whole state dict (adapted layers merged, the
    frozen rest kept from the base checkpoint) equals peft's merged model's."""
    for version, state in synced.results[0]["state"].items():
        reference = _merged_state(synced.versions[version][1])
        assert sorted(state) == sorted(reference)
        for name, tensor in reference.items():
            assert (state[name] - tensor).abs().max().item() <= WEIGHT_ATOL, (version, name)


def test_export_holds_the_merged_adapted_weights_only(synced):
    """The senders' export (TP shards merged, gathered and split as the base weight) equals peft's
    merged tensors of the adapted projections, and nothing else is sent."""
    reference = _merged_state(synced.versions[FIRST][1])
    exported = {}
    for rank_out in synced.results:
        exported.update(rank_out["export"])
    adapted = {
        f"model.layers.{i}.{'self_attn' if p in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{p}.weight"
        for i in range(2)
        for p in _peft_targets(synced.targets)
    }
    assert sorted(exported) == sorted(adapted)
    for name, tensor in exported.items():
        assert (tensor - reference[name]).abs().max().item() <= WEIGHT_ATOL, name


def test_sync_bytes_are_the_adapted_tensors(synced):
    from tests.rollout_reference import load_snapshot_tensors

    model = load_snapshot_tensors(synced.hf_dir)
    # the adapted projections' weights (their biases are frozen: not resent)
    adapted = sum(
        t.nbytes for n, t in model.items() if any(n.endswith(f".{p}.weight") for p in _peft_targets(synced.targets))
    )
    full = sum(t.nbytes for t in model.values())
    leader = synced.results[0]
    print(f"\nLoRA sync {adapted / 1e6:.2f} MB of a {full / 1e6:.2f} MB model ({synced.targets})")
    assert adapted < full
    for version in (FIRST + 1, FIRST + 2):  # broadcast, shared memory: tensor bytes
        assert leader["seconds"][version]["weight_sync_bytes"] == adapted
    assert adapted <= leader["seconds"][FIRST + 3]["weight_sync_bytes"] < adapted + 100_000  # snapshot files


def test_a_full_update_must_still_cover_every_weight(tmp_path):
    """Without ``partial`` the hf backend refuses an update that lacks weights; with it, it keeps them."""
    from megatron_rl.config.devices import DeviceAssignment
    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.worker import WorkerSpec
    from megatron_rl.weight_sync import UpdateTensors
    from tests.rollout_reference import load_snapshot_tensors

    hf_dir = str(make_tiny_hf(tmp_path / "qwen2", "qwen2", seed=3, layers=1))
    backend = HFBackend(WorkerSpec(index=0, backend="hf", model_path=hf_dir, device=DeviceAssignment(kind="cpu")))
    name = "model.layers.0.self_attn.q_proj.weight"
    new = torch.full_like(load_snapshot_tensors(hf_dir)[name], 0.5)
    with pytest.raises(ValueError, match="weight sync lacks parameters"):
        backend.load_tensors(UpdateTensors([(name, new)], partial=False))
    before = {k: v.clone() for k, v in backend._model.state_dict().items()}
    backend.load_tensors(UpdateTensors([(name, new)], partial=True))
    after = backend._model.state_dict()
    assert torch.equal(after[name], new)
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != name)
