"""Find, in a Python file, every write to an attribute of something the file imports (the switchboard
rule of docs/settings.md: no module global is changed from outside its module).

A write is ``mod.NAME = v`` (also augmented or annotated, and ``mod.NAME[k] = v``, ``NAME[k] = v`` of an
imported ``NAME``), ``setattr(mod, "NAME", v)`` and ``monkeypatch.setattr(mod, "NAME", v)`` /
``monkeypatch.setattr("pkg.mod.NAME", v)``. Each is
reported with the dotted path of what the file imported under that name, so a test can resolve
the owner (a module or a class) and the value it holds.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "?"  # an attribute name not known without running the file


@dataclass(frozen=True)
class Write:
    path: Path
    line: int
    text: str  # the target as written: "fp8_block.CONFIG_OVERRIDE"
    owner: str  # dotted path of the object written to: "cutlass_kernels.fp8_block"
    names: Tuple[str, ...]  # the attribute(s) written (two for ``a if c else b``), or (UNKNOWN,)
    patched: bool  # through monkeypatch.setattr: undone when the test ends
    code_value: bool  # the value written is a lambda, or a function or class the file defines

    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}: {self.text}"


def module_name(path: Path) -> str:
    """``te_dist/gemm/entry.py`` -> ``te_dist.gemm.entry`` (a package's ``__init__`` -> the package)."""
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, path: Path) -> dict:
    """{local name: dotted path it was imported from} (relative imports resolved against ``path``, a
    file of this checkout)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
    return names


def _loop_constants(tree: ast.Module) -> dict:
    """{loop variable: the constant strings a ``for name in (...)`` gives it}."""
    found = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List))):
            values = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) == len(node.iter.elts):
                found[node.target.id] = tuple(values)
    return found


def _names(node: ast.AST, loops: dict) -> Tuple[str, ...]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.IfExp):
        return _names(node.body, loops) + _names(node.orelse, loops)
    if isinstance(node, ast.Name) and node.id in loops:
        return loops[node.id]
    return (UNKNOWN,)


def _split(target: ast.AST) -> Optional[Tuple[ast.Name, List[str]]]:
    """``a.b.c`` or ``a.b.c[k]`` -> (Name a, ["b", "c"]); ``a[k]`` -> (Name a, []); None for anything
    else (a plain name, a call...)."""
    chain, subscripted = [], False
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if isinstance(target, ast.Attribute):
            chain.append(target.attr)
        else:
            subscripted = subscripted or not chain
        target = target.value
    return (target, chain[::-1]) if isinstance(target, ast.Name) and (chain or subscripted) else None


def writes(path: Path) -> Iterator[Write]:
    """Every write in ``path`` to an attribute of an imported name (module docstring)."""
    tree = ast.parse(path.read_text())
    imported, loops = _imports(tree, path), _loop_constants(tree)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def code(value) -> bool:
        return isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in defined)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                split = _split(target)
                if split and split[0].id in imported:
                    base, chain = split
                    owner, _, name = ".".join([imported[base.id], *chain]).rpartition(".")
                    is_code = isinstance(node, ast.Assign) and code(node.value)
                    yield Write(path, node.lineno, ast.unparse(target), owner, (name,), False, is_code)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            is_setattr = isinstance(func, ast.Name) and func.id == "setattr"
            patched = (isinstance(func, ast.Attribute) and func.attr == "setattr"
                       and ast.unparse(func.value) == "monkeypatch")
            if not (is_setattr or patched):
                continue
            first = node.args[0]
            if patched and isinstance(first, ast.Constant) and isinstance(first.value, str):  # "pkg.mod.NAME"
                owner, _, name = first.value.rpartition(".")
                is_code = len(node.args) > 1 and code(node.args[1])
                yield Write(path, node.lineno, first.value, owner, (name,), True, is_code)
                continue
            split = (first, []) if isinstance(first, ast.Name) else _split(first)
            if split and split[0].id in imported and len(node.args) > 1:
                base, chain = split
                names = _names(node.args[1], loops)
                text = f"{ast.unparse(first)}.{'|'.join(names)}"
                yield Write(path, node.lineno, text, ".".join([imported[base.id], *chain]), names, patched,
                            code(node.args[2]) if len(node.args) > 2 else False)


def resolve(dotted: str):
    """The object at ``dotted``: a module, or an attribute reached from the longest importable prefix."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        parent, _, name = dotted.rpartition(".")
        if not parent:
            raise
        return getattr(resolve(parent), name)


def static_kind(owner: str, name: str) -> str:
    """How module ``owner`` (dotted, a file of this checkout) binds ``name`` at its top level: "code" for
    def/class/import, "data" for anything else; for modules that do not import here (no Triton)."""
    path = ROOT / Path(*owner.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return "code"
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return "code"
    return "data"
