"""Imports run one way: no module of ``megatron_rl`` imports a package ranked above its own.

``TIERS`` (declared in ``tools/layout.py``) ranks the sub-packages bottom to top; a package may
import its own tier and the ones below it, never one above. Every import counts: module level,
inside functions (lazy), and the dotted paths handed to ``importlib`` (``"megatron_rl.rollout.backends.hf:HFBackend"``).

    python tests/test_import_direction.py [ROOT]    # print every arrow running back up
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_layout():
    """``tools/layout.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("megatron_rl_layout", REPO / "tools" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIERS = _load_layout().TIERS  # one declaration, tools/layout.py (README's layout block prints them)
# Top-level modules: the package's own __init__ (it silences library noise: platform) and
# ``python -m megatron_rl`` (the command line).
TOP_LEVEL = {"__init__": "platform", "__main__": "cli"}
RANK = {name: i for i, tier in enumerate(TIERS) for name in tier}
DOTTED = re.compile(r"megatron_rl(\.\w+)+(:\w+)?")  # a module path importlib is handed


@dataclass(frozen=True)
class Arrow:
    """One import of ``target`` (a dotted module path) by the file ``source``, at ``line``."""

    source: Path
    line: int
    target: str


def package_of(path: Path, root: Path) -> str:
    """The sub-package (or top-level module, by its tier's package) ``path`` belongs to."""
    parts = path.relative_to(root / "megatron_rl").with_suffix("").parts
    return parts[0] if len(parts) > 1 else TOP_LEVEL.get(parts[0], parts[0])


def imports(path: Path, root: Path) -> Iterator[Arrow]:
    """Every ``megatron_rl`` module ``path`` imports, wherever the import sits."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, path, root)
            targets = [f"{base}.{a.name}" if base == "megatron_rl" else base for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            targets = [node.value.partition(":")[0]]
        else:
            continue
        for target in targets:
            if target.startswith("megatron_rl."):
                yield Arrow(path.relative_to(root), node.lineno, target)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The module a ``from ... import`` reads, a relative one resolved against ``path``'s package."""
    if not node.level:
        return node.module or ""
    package = path.relative_to(root).parent.parts
    base = package[: len(package) - (node.level - 1)]
    return ".".join((*base, node.module) if node.module else base)


def arrows_up(root: Path = REPO) -> list[Arrow]:
    """The imports under ``root/megatron_rl`` that reach a package ranked above their own."""
    found = []
    for path in sorted((root / "megatron_rl").rglob("*.py")):
        rank = RANK[package_of(path, root)]
        found += [a for a in imports(path, root) if RANK.get(a.target.split(".")[1], -1) > rank]
    return found


def test_every_package_has_a_tier():
    packages = {p.parent.name for p in (REPO / "megatron_rl").glob("*/__init__.py")}
    modules = {p.stem for p in (REPO / "megatron_rl").glob("*.py")}
    assert packages - RANK.keys() == set(), "place each new sub-package in TIERS"
    assert modules - TOP_LEVEL.keys() - RANK.keys() == set(), "place each new top-level module in TOP_LEVEL"


def test_no_import_runs_back_up():
    up = [f"{a.source}:{a.line} imports {a.target}" for a in arrows_up()]
    assert up == [], "imports running back up the tiers (TIERS, module doc):\n" + "\n".join(up)


def test_lazy_and_dotted_imports_count(tmp_path):
    """The checker sees an import inside a function and a path handed to importlib."""
    pkg = tmp_path / "megatron_rl" / "rollout"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lazy.py").write_text("def f():\n    from megatron_rl.trainer import from_config\n")
    (pkg / "dotted.py").write_text('BACKEND = "megatron_rl.pipeline.consumer:Pipeline"\n')
    (pkg / "down.py").write_text("import megatron_rl.config.schema\nfrom megatron_rl import weight_sync\n")
    assert sorted((str(a.source.name), a.target) for a in arrows_up(tmp_path)) == [
        ("dotted.py", "megatron_rl.pipeline.consumer"),
        ("lazy.py", "megatron_rl.trainer"),
    ]


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO
    up = arrows_up(root)
    for a in up:
        print(f"{a.source}:{a.line} -> {a.target}")
    print(f"{len(up)} import(s) running back up")
