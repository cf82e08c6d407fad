"""The code's shape (STYLE 12, DESIGN) in ``megatron_rl/`` and ``tools/``, and the tree's format.

What is counted:

- a function's length is its body's lines, from the first statement after the docstring
  (its first decorator, if that statement is a decorated nested function or class) to the
  function's last line, blank and comment lines inside included; the signature and the
  docstring are not counted. At most 40. A nested function counts on its own and inside
  its parent;
- a module's length is every line of its file. At most 400;
- a function's positional parameters are its positional-only and ordinary ones (``*args``
  and keyword-only parameters are free), not counting a first ``self`` or ``cls``. At most 5;
- nothing under ``megatron_rl/config`` imports another ``megatron_rl`` package (the config is
  the bottom layer: every component may read it, it reads none of them);
- ``ruff format --check`` and ``ruff check`` (the venv's ruff, the repo's ``ruff.toml``) pass
  over megatron_rl, tools, tests, kernels and examples (``make lint``; ``make format`` fixes
  the format).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("megatron_rl", "tools")
LINT_ROOTS = ("megatron_rl", "tools", "tests", "kernels", "examples")
MAX_FUNCTION, MAX_MODULE, MAX_POSITIONAL = 40, 400, 5
RUFF = Path(sys.executable).parent / "ruff"


def _sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body after its docstring (0 for a docstring-only function)."""
    body = node.body[1:] if _is_docstring(node.body[0]) else node.body
    if not body:
        return 0
    first = body[0]
    start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])])
    return node.end_lineno - start + 1


def positional_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional-only plus ordinary parameters, a first ``self`` / ``cls`` not counted."""
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def function_lengths(source: str) -> dict[str, int]:
    """Qualified name -> body lines, for every function in ``source``."""
    return {name: body_lines(node) for name, node in _functions(ast.parse(source))}


def function_widths(source: str) -> dict[str, int]:
    """Qualified name -> positional parameters, for every function in ``source``."""
    return {name: positional_parameters(node) for name, node in _functions(ast.parse(source))}


def over_limit(figures: dict[str, int], limit: int) -> dict[str, int]:
    """The entries of ``figures`` above ``limit``."""
    return {name: figure for name, figure in figures.items() if figure > limit}


def _over(measure, limit: int) -> dict[str, int]:
    """``path::name`` -> figure, for every function in the tree whose ``measure`` exceeds ``limit``."""
    out = {}
    for path in _sources():
        for name, figure in over_limit(measure(path.read_text()), limit).items():
            out[f"{path.relative_to(REPO)}::{name}"] = figure
    return out


def long_functions() -> dict[str, int]:
    """``path::name`` -> body lines, for every function longer than ``MAX_FUNCTION``."""
    return _over(function_lengths, MAX_FUNCTION)


def wide_functions() -> dict[str, int]:
    """``path::name`` -> positional parameters, for every function with more than ``MAX_POSITIONAL``."""
    return _over(function_widths, MAX_POSITIONAL)


def _listing(found: dict[str, int]) -> str:
    return "\n".join(f"  {k}: {v}" for k, v in sorted(found.items()))


def test_functions_are_at_most_40_lines():
    over = long_functions()
    assert not over, "function bodies over 40 lines (docstring not counted):\n" + _listing(over)


def test_functions_take_at_most_5_positional_parameters():
    over = wide_functions()
    assert not over, "functions over 5 positional parameters (make the rest keyword-only):\n" + _listing(over)


def test_modules_are_at_most_400_lines():
    over = {str(p.relative_to(REPO)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE}
    assert not over, "modules over 400 lines:\n" + _listing(over)


def _function_source(body: int, *, docstring: int = 0, params: str = "") -> str:
    """A function of ``params`` with a ``docstring``-line docstring and ``body`` one-line statements."""
    lines = [f"def f({params}):"]
    if docstring:
        lines += ['    """'] + ["    doc"] * (docstring - 2) + ['    """']
    lines += [f"    x{i} = {i}" for i in range(body)]
    return "\n".join(lines) + "\n"


def test_a_long_docstring_is_not_counted():
    lengths = function_lengths(_function_source(3, docstring=45))
    assert lengths == {"f": 3}
    assert not over_limit(lengths, MAX_FUNCTION)


def test_a_41_statement_body_is_over():
    assert over_limit(function_lengths(_function_source(41, docstring=3)), MAX_FUNCTION) == {"f": 41}
    assert not over_limit(function_lengths(_function_source(40, docstring=3)), MAX_FUNCTION)


def test_a_decorated_nested_function_counts_from_its_decorator():
    source = 'def f():\n    """Doc."""\n    @staticmethod\n    def g():\n        pass\n    return g\n'
    assert function_lengths(source) == {"f": 4, "f.g": 1}


def test_six_positional_parameters_are_over():
    assert over_limit(function_widths(_function_source(1, params="a, b, c, d, e, f")), MAX_POSITIONAL) == {"f": 6}
    assert over_limit(function_widths(_function_source(1, params="a, b, /, c, d, e, f")), MAX_POSITIONAL) == {"f": 6}


def test_keyword_only_parameters_and_self_are_free():
    for params in ("a, b, c, d, e, *, f, g, h", "a, b, c, d, e, *args, f, **kw"):
        widths = function_widths(_function_source(1, params=params))
        assert widths == {"f": 5}
        assert not over_limit(widths, MAX_POSITIONAL)
    assert function_widths("class C:\n    def m(self, a, b, c, d, e):\n        pass\n") == {"C.m": 5}


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.skip(f"ruff is not installed next to {sys.executable} (pip install -e '.[test]')")
    return subprocess.run([str(RUFF), *args, *LINT_ROOTS], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_tree_is_formatted():
    done = _ruff("format", "--check", "--diff")
    files = sorted({line[4:].strip() for line in done.stdout.splitlines() if line.startswith("--- ")})
    assert done.returncode == 0, f"not formatted (run `make format`): {files}\n{done.stderr[-2000:]}"


def test_the_tree_passes_ruff_check():
    done = _ruff("check", "--output-format", "concise")
    assert done.returncode == 0, f"ruff check:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every absolute module a file imports, at any depth (``from pkg import mod`` counts pkg.mod)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [f"{node.module}.{a.name}" if node.module == "megatron_rl" else node.module for a in node.names]
    return out


def test_config_imports_no_higher_package():
    arrows = set()
    for path in sorted((REPO / "megatron_rl" / "config").rglob("*.py")):
        for module in _imported_modules(ast.parse(path.read_text())):
            if module.startswith("megatron_rl.") and not module.startswith("megatron_rl.config"):
                arrows.add(f"{path.relative_to(REPO)} -> {module}")
    assert not arrows, "megatron_rl/config imports higher packages:\n" + "\n".join(sorted(arrows))
