"""``torch.emulated``: the device module torch consults for the emulated backend (as ``torch.cuda``).

Random ops on the device run CPU kernels, so the device generator *is* the CPU generator:
seeding or saving "the device RNG" acts on ``torch.default_generator``. (``manual_seed_all``
must not call ``torch.manual_seed``, which calls back into it.)
"""

from __future__ import annotations

import torch

from megatron_rl.platform.emulated.build import load_extension

_C = load_extension()


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "emulated":
        raise ValueError(f"expected an emulated device, got {device}")
    return _C.current_device() if device.index is None else device.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    return None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device: torch.device | str | int) -> None:
    _C.set_device(_index(device))


class device:  # noqa: N801  (torch's device-module protocol: torch.<backend>.device)
    """Within the block, ``device`` (an emulated device or index; None: unchanged) is the current device."""

    def __init__(self, device: torch.device | str | int | None) -> None:
        self.index = None if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = _C.current_device()
        if self.index is not None:
            _C.set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        _C.set_device(self.previous)


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Every op has finished when it returns: nothing to wait for."""


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: torch.device | str | int | None = None) -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(state: torch.Tensor, device: torch.device | str | int | None = None) -> None:
    torch.default_generator.set_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    set_rng_state(states[0])


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    return _C.memory_allocated(_index(device))


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    return _C.max_memory_allocated(_index(device))


def mem_get_info(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """(free, total) bytes of the device, as ``torch.cuda.mem_get_info``: total is the active
    profile's capacity (the host's memory when unlimited)."""
    return tuple(_C.mem_get_info(_index(device)))


def reset_peak_memory_stats(device: torch.device | str | int | None = None) -> None:
    _C.reset_peak_memory(_index(device))


def is_bf16_supported() -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16, torch.float32]
