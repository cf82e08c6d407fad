"""README's layout block and the package docstring are generated from the tree (``tools/layout.py``):
each sub-package's line is the first line of its ``__init__`` docstring, in its import tier, and
``megatron_rl/__init__.py`` states the tiers. A new or renamed sub-package, or a changed
summary line, fails here until ``python tools/layout.py --write`` and the docstring follow.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def layout():
    spec = importlib.util.spec_from_file_location("megatron_rl_layout", REPO / "tools" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_layout_is_generated_from_the_tree(layout):
    have = layout.readme_block((REPO / "README.md").read_text())
    assert have == layout.layout_block(), "README's layout block is out of date: run python tools/layout.py --write"


def test_every_sub_package_has_a_tier_and_a_summary_line(layout):
    tiered = [name for tier in layout.TIERS for name in tier]
    assert sorted(tiered) == layout.sub_packages(), "place each sub-package in tools/layout.py's TIERS, once"
    for name in layout.sub_packages():
        line = layout.summary(name)
        assert 20 <= len(line) <= 110, f"megatron_rl/{name}: its docstring's first line is its layout line: {line!r}"


def test_package_docstring_states_the_tiers(layout):
    doc = ast.get_docstring(ast.parse((REPO / "megatron_rl" / "__init__.py").read_text()))
    assert layout.tiers_line() in " ".join(doc.split()), (
        f"megatron_rl/__init__.py's docstring must list: {layout.tiers_line()}"
    )


def test_the_check_sees_a_new_package_and_a_changed_line(layout, tmp_path, monkeypatch):
    """The generated block can differ from README's: a changed summary line changes it, and a
    sub-package outside ``TIERS`` is refused by name."""
    pkg = tmp_path / "megatron_rl"
    for name in layout.sub_packages():
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text(f'"""{layout.summary(name)}."""\n')
    before = layout.layout_block()
    monkeypatch.setattr(layout, "PACKAGE", pkg)
    assert layout.layout_block() == before
    (pkg / "rewards" / "__init__.py").write_text('"""Reward functions and reward models."""\n')
    assert layout.layout_block() != before
    (pkg / "quant").mkdir()
    (pkg / "quant" / "__init__.py").write_text('"""Quantised rollouts: fp8 weights for the engines."""\n')
    with pytest.raises(ValueError, match="quant"):
        layout.layout_block()
