"""Build and load the emulated device's C++ extension (``csrc/``), once per source version.

The extension is compiled with ``torch.utils.cpp_extension`` into a folder inside the virtual
environment (``<sys.prefix>/var/megatron_rl_emulated/<torch>-<source hash>``, or
``$MEGATRON_RL_EMULATED_BUILD_DIR``), so an edit of the sources builds a fresh copy and ``make
clean`` removes it. ``make install`` builds it (``python -m megatron_rl.platform.emulated
--build``); a process that finds it missing builds it under a file lock, so ranks started
together compile it once. Later loads import the built library directly (no compiler check).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

NAME = "megatron_rl_emulated"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("device.cpp", "ops.cpp", "rules.cpp", "backend.cpp")


def source_hash() -> str:
    """A digest of the C++ sources, the header and the torch / Python versions they build against."""
    digest = hashlib.sha256(f"{torch.__version__} {sys.version_info[:2]}".encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where this source version is (or will be) built."""
    base = os.environ.get("MEGATRON_RL_EMULATED_BUILD_DIR") or Path(sys.prefix) / "var" / "megatron_rl_emulated"
    return Path(base) / f"torch{torch.__version__}-{source_hash()}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` that the kernel releases if its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(directory: Path, verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    # ninja from the virtual environment (a declared requirement) when it is not on PATH.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory.mkdir(parents=True, exist_ok=True)
    return load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        build_directory=str(directory),
        extra_cflags=["-O2", "-Wno-unused-parameter"],
        verbose=verbose,
    )


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension(*, verbose: bool = False) -> ModuleType:
    """The compiled extension module, built first if this source version has not been."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    directory = build_dir()
    library = directory / f"{NAME}.so"
    if library.exists():
        module = _import(library)
    else:
        with _locked(directory.parent / f"{directory.name}.lock"):
            module = _import(library) if library.exists() else _compile(directory, verbose)
    sys.modules[NAME] = module
    return module
