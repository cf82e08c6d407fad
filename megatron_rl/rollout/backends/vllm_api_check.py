"""Whether the vLLM symbols of ``vllm_api.API_CALLS`` exist in a release.

Two readers of the same table: ``check_installed`` imports the installed package and uses
``inspect`` (signatures, dataclass / struct fields); ``check_source`` parses a release's
unpacked source with ``ast`` (no import: it reads wheels and sdists built for other devices),
following base classes across the given source roots. Both answer ``{call name: found}``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Iterable
from pathlib import Path

from megatron_rl.rollout.backends.vllm_api import ApiCall


def call_name(call: ApiCall) -> str:
    """``module:Class.member(params)``: how reports name a call."""
    member = f".{call.member}" if call.member and call.kind != "base" else ""
    base = f"({call.member})" if call.kind == "base" else ""
    params = f"({', '.join(call.params)})" if call.params else ""
    return f"{call.owner}{member}{base}{params}"


def check_installed(calls: Iterable[ApiCall]) -> dict[str, bool]:
    """Each call against the importable package, by ``inspect``."""
    return {call_name(c): _installed(c) for c in calls}


def _installed(call: ApiCall) -> bool:
    module_name, qualname = call.owner.split(":")
    try:
        owner = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError):
        return False
    if call.kind == "function":
        return _has_params(owner, call.params)
    if call.kind == "base":
        return call.member in {k.__name__ for k in inspect.getmro(owner)[1:]}
    if call.kind == "field":
        return _has_field(owner, call.member)
    member = inspect.getattr_static(owner, call.member, None)
    return (
        callable(getattr(owner, call.member, None))
        and member is not None
        and _has_params(getattr(owner, call.member), call.params)
    )


def _has_params(fn, params: tuple[str, ...]) -> bool:
    names = inspect.signature(fn).parameters
    return all(p in names for p in params)


def _has_field(cls, name: str) -> bool:
    """Whether instances of ``cls`` carry ``name``: a dataclass / struct field, an ``__init__``
    parameter, or (read from the source) a ``self.<name>`` assignment."""
    names = set(getattr(cls, "__struct_fields__", ()))  # msgspec structs (SamplingParams)
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    try:
        names |= set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):  # no signature (some builtins)
        pass
    if name in names:
        return True
    return any(name in _source_attributes(klass) for klass in inspect.getmro(cls))


@functools.cache
def _source_attributes(klass: type) -> frozenset[str]:
    try:
        return frozenset(_self_attributes(ast.parse(inspect.getsource(klass).strip())))
    except (OSError, TypeError, SyntaxError):  # no source (builtins, C extensions)
        return frozenset()


def check_source(calls: Iterable[ApiCall], roots: Iterable[Path]) -> dict[str, bool]:
    """Each call against source trees (e.g. an unpacked vLLM wheel and a vllm-ascend sdist)."""
    index = SourceIndex(list(roots))
    return {call_name(c): index.has(c) for c in calls}


class SourceIndex:
    """Classes and functions of modules under some source roots, found by ``ast``."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self._trees: dict[str, ast.Module | None] = {}

    def has(self, call: ApiCall) -> bool:
        """Whether ``call`` is in the source (a member may come from a base class)."""
        module, name = call.owner.split(":")
        if call.kind == "function":
            fn = self._find(module, name, ast.FunctionDef)
            return fn is not None and all(p in _arg_names(fn[0]) for p in call.params)
        found = self._class(module, name)
        if found is None:
            return False
        if call.kind == "base":
            return call.member in self._base_names(*found)
        return any(self._member_in(cls, call) for cls, _ in self._mro(*found))

    def _member_in(self, cls: ast.ClassDef, call: ApiCall) -> bool:
        if call.kind == "field":
            return call.member in _class_fields(cls)
        fn = next(
            (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == call.member),
            None,
        )
        return fn is not None and all(p in _arg_names(fn) for p in call.params)

    def _mro(self, cls: ast.ClassDef, module: str, depth: int = 0) -> list[tuple[ast.ClassDef, str]]:
        chain = [(cls, module)]
        for base in cls.bases if depth < 8 else ():
            found = self._class(module, _base_name(base))
            if found is not None:
                chain += self._mro(*found, depth + 1)
        return chain

    def _base_names(self, cls: ast.ClassDef, module: str) -> set[str]:
        return {_base_name(b) for c, _ in self._mro(cls, module) for b in c.bases}

    def _class(self, module: str, name: str) -> tuple[ast.ClassDef, str] | None:
        return self._find(module, name, ast.ClassDef)

    def _find(self, module: str, name: str, kind: type, depth: int = 0) -> tuple[ast.AST, str] | None:
        """``name`` defined at the top of ``module``, or where ``module`` imports it from."""
        tree = self._tree(module)
        if tree is None:
            return None
        node = next((n for n in tree.body if isinstance(n, kind) and n.name == name), None)
        if node is not None:
            return node, module
        for imp in ast.walk(tree) if depth < 4 else ():
            if isinstance(imp, ast.ImportFrom) and any(a.name == name and not a.asname for a in imp.names):
                return self._find(_absolute(module, imp, self._is_package(module)), name, kind, depth + 1)
        return None

    def _is_package(self, module: str) -> bool:
        return any((root / Path(*module.split(".")) / "__init__.py").is_file() for root in self.roots)

    def _tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            self._trees[module] = None
            rel = Path(*module.split("."))
            for root in self.roots:
                for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                    if path.is_file():
                        self._trees[module] = ast.parse(path.read_text(encoding="utf-8"))
                        break
                if self._trees[module] is not None:
                    break
        return self._trees[module]


def _absolute(module: str, imp: ast.ImportFrom, is_package: bool) -> str:
    """The module an ``ImportFrom`` in ``module`` reads (relative imports resolved)."""
    if not imp.level:
        return imp.module or ""
    parts = module.split(".")
    base = parts[: len(parts) - imp.level + (1 if is_package else 0)]
    return ".".join(base + ([imp.module] if imp.module else []))


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):  # Generic[...]
        node = node.value
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _arg_names(fn) -> set[str]:
    a = fn.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def _class_fields(cls: ast.ClassDef) -> set[str]:
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            names |= _arg_names(fn)
    return names | _self_attributes(cls)


def _self_attributes(tree: ast.AST) -> set[str]:
    """Names assigned as ``self.<name> = ...`` (or annotated) anywhere in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets if isinstance(node, (ast.Assign, ast.AnnAssign)) else ():
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names
