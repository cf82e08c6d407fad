"""Run untrusted Python in a subprocess with hard limits: the Python tool's sandbox.

Contract: `run_python(code, limits)` never raises for anything the code does and never hangs
past ``limits.wall_s`` (plus process start-up): it returns a `SandboxResult` whose `error` says
what went wrong (a non-zero exit, a signal, the CPU / wall-clock / output limit). The code runs
- with rlimits set by a tiny launcher before it execs (no ``preexec_fn``: the caller is
  multi-threaded): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), processes (RLIMIT_NPROC),
  file size (RLIMIT_FSIZE: stdout / stderr go to files, so huge output is cut there), open
  files, no core dumps;
- as a uid of its own when the caller is root (a pool from `UID_BASE`: RLIMIT_NPROC counts per
  uid, and root ignores it); otherwise as the caller, its NPROC limit being the caller's
  current task count + ``limits.processes``;
- in new user, network and PID namespaces (``unshare --user --map-root-user --net --pid --fork
  --kill-child``) when the kernel allows it: no network at all (not even the host's loopback),
  and every process it starts dies with it. Where they are unavailable the code runs WITHOUT
  network isolation (a warning logged once, `SandboxResult.network_isolated` False).
  `setup()` probes this once and picks the interpreter: this one, or the system's
  ``/usr/bin/python3`` when this one is not executable by the sandbox uid (a virtualenv under
  a private home directory);
- in its own temporary directory (cwd, HOME and TMPDIR; deleted afterwards), in a new session
  (the whole process group is killed at the end), with a minimal environment and ``python -I -S``
  (the standard library only: no site-packages).
It can still read world-readable files of the machine; it is a guard against runaway and
careless code from a policy model, not a jail for a determined attacker.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

# uids the sandboxes run as when the caller is root: far above regular users (<= 60000), systemd's
# dynamic users (61184-65519) and its container ranges (up to 1879048191), below the signed-int edge
UID_BASE, UID_COUNT = 2_000_000_000, 1024
UID_BLOCKS = (2**31 - 1 - UID_BASE) // UID_COUNT  # one block per process, chosen by pid
UNSHARE = (
    shutil.which("unshare") or "/usr/bin/unshare",
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
)
Isolation = Literal["userns", "none"]
# What util-linux's unshare prints (exit 1) when its child died by SIGKILL: it re-raises the child's
# signal on itself, and SIGKILL's handler cannot be reset.
_UNSHARE_SIGKILL = "unshare: sigprocmask unblock failed"
# Sets the limits (as root: lowers the uid first), then execs the sandboxed command (an absolute
# path: after setuid this interpreter may not read its own standard library, so nothing is imported late).
_LAUNCHER = """import json, os, resource, sys
spec = json.loads(sys.argv[1])
if spec["uid"] is not None:
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
for name, value in spec["limits"].items():
    # RLIMIT_CPU: hard one second above soft, so the code gets SIGXCPU (at soft == hard the kernel
    # sends SIGKILL, which unshare cannot re-raise: it then exits 1 with "sigprocmask unblock failed")
    resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))
os.execv(spec["argv"][0], spec["argv"])
"""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one run may use."""

    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU), every thread of the main process
    wall_s: float = 10.0  # wall-clock seconds before the whole process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    processes: int = 16  # processes / threads it may start (RLIMIT_NPROC)
    output_bytes: int = 8192  # stdout and stderr kept (each); the rest is cut and flagged
    file_mb: int = 16  # largest file it may write, stdout included (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not isinstance(v, int | float) or isinstance(v, bool) or v <= 0}
        if bad:
            raise ValueError(f"sandbox limits must be positive numbers, got {bad}")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """The outcome of one run."""

    stdout: str
    stderr: str
    returncode: int | None  # None when killed at the wall clock
    error: str | None  # None: exit code 0; else a short reason
    truncated: bool  # output longer than output_bytes was cut
    seconds: float
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text a model reads: stdout, then stderr and the error, if any."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(f"stderr:\n{self.stderr.rstrip()}")
        if self.truncated:
            parts.append("[output truncated]")
        if self.error:
            parts.append(f"[error: {self.error}]")
        return "\n".join(parts) or "(no output)"


class _UidPool:
    """Distinct uids for concurrent runs (RLIMIT_NPROC is a per-uid count): a block of
    ``UID_COUNT`` per process, chosen by pid, so two processes (DP ranks, test workers, a forked
    child) running sandboxes at once do not count each other's processes."""

    def __init__(self) -> None:
        self._lock, self._pid, self._free = threading.Lock(), -1, []

    def _base(self) -> int:
        return UID_BASE + (self._pid % UID_BLOCKS) * UID_COUNT

    def _refill_if_forked(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._free = list(range(self._base() + UID_COUNT - 1, self._base() - 1, -1))

    def take(self) -> int:
        with self._lock:
            self._refill_if_forked()
            return self._free.pop() if self._free else self._base()  # 1024 at once: they share one

    def give(self, uid: int) -> None:
        with self._lock:
            self._refill_if_forked()
            if self._base() <= uid < self._base() + UID_COUNT and uid not in self._free:
                # Least recently returned first: a killed run's processes (a fork bomb's, dying in
                # their PID namespace) may still count against its uid's RLIMIT_NPROC for a while.
                self._free.insert(0, uid)


_UIDS = _UidPool()


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in the sandbox (see module doc)."""
    how = setup()
    uid = _UIDS.take() if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="megatron-rl-sandbox-"))
    try:
        work = _workdir(root, uid)
        (root / "main.py").write_text(code)  # read from stdin: tracebacks say "<stdin>", not a temp path
        argv = [*(UNSHARE if how.isolation == "userns" else ()), how.python, "-I", "-S", "-B", "-"]
        start = time.perf_counter()
        returncode = _run(argv, root, work, uid, limits)
        seconds = time.perf_counter() - start
        return _result(root, returncode, limits, seconds, network_isolated=how.isolation == "userns")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if uid is not None:
            _UIDS.give(uid)


def _workdir(root: Path, uid: int | None) -> Path:
    work = root / "work"
    work.mkdir()
    if uid is not None:
        root.chmod(0o711)  # the sandbox uid may enter root to reach work, not list or read it
        os.chown(work, uid, uid)
    return work


def _run(argv: list[str], root: Path, work: Path, uid: int | None, limits: SandboxLimits) -> int | None:
    """Start the launcher, wait up to wall_s, kill the session; the exit status (None: killed)."""
    nproc = int(limits.processes) + (0 if uid is not None else _own_task_count())
    rlimits = {
        "RLIMIT_CPU": math.ceil(limits.cpu_s),
        "RLIMIT_AS": int(limits.memory_mb * 2**20),
        "RLIMIT_NPROC": nproc,
        "RLIMIT_FSIZE": int(limits.file_mb * 2**20),
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": 256,
    }
    spec = json.dumps({"uid": uid, "limits": rlimits, "argv": argv})
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    with (
        (root / "main.py").open("rb") as code,
        (root / "stdout").open("wb") as out,
        (root / "stderr").open("wb") as err,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, spec],
            cwd=work,
            env=env,
            stdin=code,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            returncode = None
        _kill_session(proc)
    return returncode


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process left in the run's session (background children too), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass
    proc.wait()


def _own_task_count() -> int:
    """Tasks (processes and threads) of this uid: what RLIMIT_NPROC counts for a non-root caller."""
    uid, count = str(os.getuid()), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            count += int(fields.get("Threads", "1"))
    return count


def _result(
    root: Path, returncode: int | None, limits: SandboxLimits, seconds: float, *, network_isolated: bool
) -> SandboxResult:
    (stdout, cut_out), (stderr, cut_err) = (
        _read_capped(root / name, limits.output_bytes) for name in ("stdout", "stderr")
    )
    if returncode == 1 and stderr.startswith(_UNSHARE_SIGKILL):
        returncode = 128 + signal.SIGKILL  # the code was SIGKILLed (a limit); unshare's own report of it
    error = _error(returncode, limits)
    if error and (root / "stdout").stat().st_size >= int(limits.file_mb * 2**20):  # Python ignores SIGXFSZ: EFBIG
        error = f"output size limit ({limits.file_mb} MB) reached; {error}"
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=returncode,
        error=error,
        truncated=cut_out or cut_err,
        seconds=seconds,
        network_isolated=network_isolated,
    )


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with path.open("rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _error(returncode: int | None, limits: SandboxLimits) -> str | None:
    if returncode is None:
        return f"wall-clock limit ({limits.wall_s:g} s) reached; the run was killed"
    if returncode == 0:
        return None
    if returncode < 0 or returncode > 128:  # a signal (unshare reports its child's as 128 + n)
        number = -returncode if returncode < 0 else returncode - 128
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
        why = {
            "SIGXCPU": f"CPU time limit ({limits.cpu_s} s)",
            "SIGXFSZ": f"file / output size limit ({limits.file_mb} MB)",
            "SIGKILL": "killed (CPU time or memory limit)",
        }.get(name, "crashed")
        return f"{why}: terminated by {name}"
    return f"exit code {returncode}"


@dataclass(frozen=True, kw_only=True)
class SandboxSetup:
    """How runs start on this machine (probed once)."""

    isolation: Isolation  # "userns": own user, network and PID namespaces; "none": the machine's network
    python: str  # the interpreter the code runs with


class SandboxUnavailable(RuntimeError):
    """No interpreter can be started as the sandbox uid."""


@functools.cache
def setup() -> SandboxSetup:
    """The first interpreter (this one, else the system's) that starts in the sandbox, with user
    namespaces if the kernel allows them; the fallback to "none" is logged once."""
    candidates = list(dict.fromkeys([sys.executable, "/usr/bin/python3"]))
    for isolation in ("userns", "none"):
        for python in candidates:
            if _starts(python, isolation):
                if isolation == "none":
                    logger.warning(
                        "user namespaces are unavailable (`unshare --user --net` failed): the Python "
                        "sandbox runs WITHOUT network isolation; rlimits, the wall clock and the "
                        "temporary directory still apply"
                    )
                if python != sys.executable:
                    logger.info(
                        "sandboxed Python runs %s (%s is not executable by the sandbox uid)", python, sys.executable
                    )
                return SandboxSetup(isolation=isolation, python=python)
    raise SandboxUnavailable(
        f"none of {candidates} starts as uid {UID_BASE} (the sandbox's): install a Python every user may execute"
    )


def _starts(python: str, isolation: Isolation) -> bool:
    argv = [*(UNSHARE if isolation == "userns" else ()), python, "-I", "-S", "-c", "pass"]
    spec = json.dumps({"uid": UID_BASE if os.geteuid() == 0 else None, "limits": {}, "argv": argv})
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, spec], capture_output=True, timeout=30, check=False, cwd="/"
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


PYTHON_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program (standard library only, no network, a few seconds of CPU) and "
        "return what it prints. Use print() to see results.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program, e.g. print(123456 * 789)"}},
            "required": ["code"],
        },
    },
}


def call_python(arguments: dict, limits: SandboxLimits = SandboxLimits()) -> tuple[str, bool]:
    """The python tool call: (what the run printed, with its error if any; whether it succeeded)."""
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return 'Error: the python tool needs {"code": "<program>"}', False
    result = run_python(code, limits)
    return result.observation(), result.ok
