"""Test tiers (markers registered in pytest.ini; ``make test`` runs every tier on two xdist
workers, ``make test-fast`` the edit-test loop without ``slow``, ``multiproc`` and ``vllm``).

Files mark what they are (``pytestmark`` or ``@pytest.mark.slow``). As a safety net for tests
that forget, a test is also marked ``multiproc`` when it, or a fixture it uses, calls one of
the helpers below that start processes: a gloo world (``run_distributed``, ``mp.spawn``) or a
rollout engine pool (``build_engine``, ``WorkerPool``), or calls a module-level helper that
does (one level down). Only names in the code are seen (``__code__.co_names``), so deeper
indirections must be marked by hand.
"""

from __future__ import annotations

import pytest

PROCESS_STARTERS = frozenset({"run_distributed", "build_engine", "WorkerPool", "spawn"})


def _names(func: object) -> set[str]:
    return set(getattr(getattr(func, "__code__", None), "co_names", ()))


def _calls_a_process_starter(item: pytest.Item) -> bool:
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        funcs += [d.func for d in defs]
    # one level down: module-level helpers the test or its fixtures call (e.g. a `_pool` or `_run`)
    module = vars(getattr(item, "module", None) or object)
    funcs += [module[n] for f in list(funcs) for n in _names(f) if callable(module.get(n))]
    return any(PROCESS_STARTERS & _names(f) for f in funcs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add ``multiproc`` to every test that starts processes through the helpers above."""
    for item in items:
        if "multiproc" not in item.keywords and _calls_a_process_starter(item):
            item.add_marker(pytest.mark.multiproc)


def pytest_configure(config: pytest.Config) -> None:
    """Load the emulated accelerator before any test runs a backward, as a training process does
    at set-up: PyTorch's autograd engine sizes its per-device queues once, at the first backward
    of a process, from the devices registered then (a later emulated backward would hit its
    internal assert ``device_ready_queues_``)."""
    from megatron_rl.platform import emulated

    emulated.load()
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):  # not xdist's controller
        from tests.distributed import start_forkserver

        start_forkserver()  # in the background, before a RewardPool could start it with less


@pytest.fixture(scope="session")
def device():
    """``emulated:0``, the emulated accelerator's first device (for single-process device tests)."""
    import torch

    from megatron_rl.platform import emulated

    try:
        emulated.load()
    except (OSError, RuntimeError, ImportError) as err:  # no compiler for the extension
        pytest.skip(f"emulated device unavailable: {err}")
    return torch.device("emulated:0")
