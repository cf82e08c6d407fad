"""Engines on other nodes (issue 19), without a model: placement rules (``check-config``,
``plan``), group routing by outstanding tokens, and a ``WorkerPool`` whose worker 1 lives in an
engine host (``rollout.engine_host``) reached over TCP (``rollout.remote``), supervised like a local
one: a crash is found, the worker restarted by its host, its requests re-issued, every
request answered once; the host ends when the pool shuts down."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, deque
from types import SimpleNamespace

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan import LayoutError, plan_layout
from megatron_rl.rollout import WorkerPool
from megatron_rl.rollout.dispatch import _dispatch, group_of
from megatron_rl.rollout.engine_host import serve
from megatron_rl.rollout.remote import EngineHub
from tests.distributed import free_port
from tests.rollout_faults import echo_response, echo_specs
from tests.rollout_reference import request

RECIPE = "examples/recipes/qwen2.5-7b-grpo-910b-2node/config.yaml"
SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4}


def _load(overrides):
    return load_config(RECIPE, overrides, hf_config=SHAPE)


@pytest.mark.parametrize(
    ("overrides", "nodes", "key"),
    [
        (["rollout.engine_nodes=[0,1]"], None, "rollout.engine_nodes"),  # 2 entries, 4 engines
        (["rollout.engine_nodes=[0,0,1,2]"], "2", "rollout.engine_nodes"),  # node 2 of a 2-node launch
        (["rollout.engine_nodes=[0,0,-1,1]"], None, "rollout.engine_nodes"),
        (["rollout.weight_sync=shared_memory"], None, "rollout.weight_sync"),  # node 0's /dev/shm
    ],
)
def test_check_config_refuses_bad_engine_placement_naming_the_key(monkeypatch, overrides, nodes, key):
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    if nodes is None:
        monkeypatch.delenv("NNODES", raising=False)
    else:
        monkeypatch.setenv("NNODES", nodes)
    with pytest.raises(ConfigError, match=key):
        _load(overrides)


def test_plan_places_each_nodes_engines_on_its_top_devices():
    layout = plan_layout(_load([]), nodes=2, devices_per_node=8)
    assert layout.ranks_per_node == (4, 4) and [len(layout.engines_on(n)) for n in (0, 1)] == [2, 2]
    uneven = plan_layout(
        _load(
            [
                "rollout.num_engines=3",
                "rollout.engine_nodes=[0,1,1]",
                "parallel.tp=2",
                'rollout.devices=["npu:6,7","npu:4,5","npu:6,7"]',
            ]
        ),
        nodes=2,
        devices_per_node=8,
    )
    assert uneven.ranks_per_node == (6, 4) and uneven.dp == 5 and uneven.engines_on(1) == [1, 2]
    with pytest.raises(LayoutError, match="node 1"):  # node 1's engines on NPUs 0-3: its training ids
        plan_layout(_load(['rollout.devices=["npu:4,5","npu:6,7","npu:0,1","npu:2,3"]']), nodes=2, devices_per_node=8)
    with pytest.raises(LayoutError, match=r"node\(s\) \[1\]"):
        plan_layout(_load([]), nodes=1, devices_per_node=8)


class _FakeWorker:
    """The parts of a ``WorkerHandle`` that ``_dispatch`` reads and writes."""

    def __init__(self, index):
        self.spec = SimpleNamespace(index=index)
        self.outstanding, self.in_flight, self.chunks, self.sent = 0, {}, deque(), []
        self.streaming = False  # a chunked worker: at most PREFETCH commands

    def send(self, command):
        self.outstanding += 1
        self.sent.append(command.requests)


def test_dispatch_keeps_groups_whole_and_balances_outstanding_tokens():
    long, short = (1,) * 40, (1,) * 4
    reqs = [request(f"0/p{j}/{k}", long if j == 0 else short, max_new=8) for j in range(4) for k in range(3)]
    workers = [_FakeWorker(0), _FakeWorker(1)]
    _dispatch(workers, deque(reqs), chunk=3)
    for w in workers:
        for batch in w.sent:
            assert len({group_of(r) for r in batch}) == 1 and len(batch) == 3  # one whole group per command
    # p0 (long prompts) went to worker 0; the three short groups fill worker 1 before worker 0's 2nd slot
    assert [group_of(b[0]) for b in workers[0].sent] == ["0/p0", "0/p3"]
    assert [group_of(b[0]) for b in workers[1].sent] == ["0/p1", "0/p2"]


@pytest.mark.multiproc
def test_remote_worker_crash_is_restarted_by_its_host_and_reissued_once(tmp_path):
    once = tmp_path / "once"
    (once / "crash-0" / "p1").mkdir(parents=True)  # the marker of request "0/p1/1" is the file crash-0/p1/1
    local, remote = echo_specs(tmp_path, 2)
    remote = dataclasses.replace(remote, node=1, env={"FAULT_CRASH_ON": "0/p1/1", "FAULT_ONCE_DIR": str(once)})
    port = free_port()
    host = threading.Thread(target=serve, args=([remote], ("127.0.0.1", port)), kwargs={"timeout_s": 120})
    host.start()
    pool = WorkerPool(
        [local, remote],
        max_batch_size=3,
        request_timeout_s=120,
        start_timeout_s=120,
        remote=EngineHub("127.0.0.1", port),
    )
    try:
        reqs = [request(f"0/p{j}/{k}", (j + 1, k + 2), max_new=4, seed=k) for j in range(4) for k in range(3)]
        results = list(pool.generate(reqs))
        assert Counter(r.request_id for r in results) == Counter(r.request_id for r in reqs)
        by_id = {q.request_id: q for q in reqs}
        for r in results:
            q = by_id[r.request_id]
            assert r.response_ids == echo_response(q.prompt_ids, 4, q.sampling.seed)
        status = pool.status()
        # the crashed chunk (group p1) and whatever of its prefetched chunk was unanswered
        assert status[1].restarts == 1 and status[1].reissued >= 3 and status[0].restarts == 0
        assert all(s.alive and not s.in_flight for s in status)
    finally:
        pool.shutdown()
        host.join(30)
    assert not host.is_alive(), "the engine host did not end with the pool"
