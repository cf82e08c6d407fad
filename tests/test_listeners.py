"""No listener of a training run binds to all interfaces: ranks launched with MASTER_ADDR /
MASTER_PORT listen on MASTER_ADDR only (here loopback); one process needs no TCP store."""

from __future__ import annotations

import os

import pytest

from tests.distributed import LOOPBACK, listening_addresses, run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM

pytestmark = [pytest.mark.multiproc]


def _init_and_list():
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=1, pp=1, platform=TRAIN_PLATFORM)
    return sorted(listening_addresses(os.getpid()))


def test_ranks_listen_on_master_addr_only():
    rank0, rank1 = run_distributed(_init_and_list, 2, timeout_s=120)
    assert rank0, "rank 0 should hold the store's listening socket"
    assert all(a.startswith(LOOPBACK) for a in rank0 + rank1), (rank0, rank1)


def test_one_process_listens_on_loopback_only():
    """World size 1: an in-memory store (no TCP store at all); gloo's own pair sockets stay local."""
    (addresses,) = run_distributed(_init_and_list, 1, timeout_s=120)
    assert all(a.startswith(LOOPBACK) for a in addresses), addresses
