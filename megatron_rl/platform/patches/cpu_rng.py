"""Model-parallel RNG tracker backed by the CPU generator.

Why: megatron-core's ``CudaRNGStatesTracker`` keeps one CUDA generator state per name
(data-parallel, tensor-parallel, expert) and swaps them in ``fork()``. On CPU the CPU
generator plays the device generator's role; the stock tracker's ``fork()`` additionally
warns whenever the CPU state changes inside it, which on CPU is always.

How: ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` (the class that
``initialize_rng_tracker`` instantiates) is replaced by a subclass whose states are CPU
generator states. Seeds stay megatron's (data-parallel seed, seed + 2718 + tp_rank, ...).

Versions: megatron-core 0.16.x. Delete with the CPU adaptor.
"""

from __future__ import annotations

import contextlib

import torch

_PATCHED_NAME = "_megatron_rl_cpu_tracker"


def apply() -> None:
    """Install the CPU tracker class (idempotent)."""
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.CudaRNGStatesTracker, _PATCHED_NAME, False):
        return

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named CPU generator states, swapped in and out by ``fork``."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    setattr(CPURNGStatesTracker, _PATCHED_NAME, True)
    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
