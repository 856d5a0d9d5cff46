"""Dependencies point one way: server -> engine -> FlashLoop features -> pipeline -> runtime /
scheduling -> checkpoint -> model -> kernels, with the wire types, plans, configuration and
errors at the bottom; and the core never imports a feature package: only the composition
root (`specloop/engine/build.py`) names the FlashLoop features (`specloop/flashloop/*/`).

Every module under specloop/ and server/ is parsed with `ast`; nothing is imported, so a
broken module cannot hide its imports and the check costs no torch. Every import counts:
module level, inside functions, under `if TYPE_CHECKING`, in `try` blocks, and
`importlib.import_module("...")` with a literal name. A layer may import lower ranks and
its own package; `RANKS` places every file, and a file it does not place fails the test, so
a new package is put in its layer on purpose.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specloop", "server")

# Path prefix (a file, or a folder ending in "/") -> rank; the longest matching prefix wins.
# Lower ranks may not import higher ones.
RANKS: dict[str, float] = {
    "specloop/errors.py": 0,
    "specloop/config.py": 0,
    "specloop/sampling_params.py": 0,
    "specloop/protocol.py": 0,
    "specloop/plan.py": 0,  # plans: torch-free data from the scheduler to the runner
    "specloop/flashloop/__init__.py": 0,
    "specloop/flashloop/config.py": 0,  # FlashLoop configuration groups and window geometry (torch-free)
    "specloop/assets/": 0,
    "specloop/kernels/": 0.5,
    "specloop/model/": 1,
    "specloop/parallel/": 1.2,  # tensor parallelism below the engine: weight shards, the ranks' process group
    "specloop/checkpoint/": 1.5,  # builds the model from a checkpoint folder
    "specloop/runtime/": 2,
    "specloop/scheduling/": 2,
    "specloop/pipeline/": 3,
    "specloop/flashloop/": 3.5,  # the FlashLoop features, one package each (plug-ins: see FEATURES)
    "specloop/engine/": 4,
    "specloop/llm.py": 5,
    "specloop/client.py": 5,
    "specloop/cli.py": 5,
    "specloop/training/": 5,
    "server/": 6,
}
# The root package as an import target: `from specloop import __version__` pulls in only
# rank-0 modules (its public names load lazily, resolved below to their real modules).
ROOT_PACKAGE = "specloop/__init__.py"
EXEMPT = {ROOT_PACKAGE}  # as an importer: its lazy exports name every layer by design
# Layers of one rank that must stay apart: runtime is the device side, scheduling the
# torch-free host side; the engine joins them.
APART = {("specloop/runtime/", "specloop/scheduling/"), ("specloop/scheduling/", "specloop/runtime/")}
# Layers that may import only these layers of specloop (besides their own package).
ONLY = {"specloop/kernels/": {"specloop/errors.py"}}
# Layers that may not import these third-party packages, directly or through the specloop
# modules they import at module level.
NO_THIRD_PARTY = {"specloop/scheduling/": ("torch", "triton"), "specloop/flashloop/config.py": ("torch", "triton")}
# The feature packages: only the composition root and the features themselves import them.
FEATURES = "specloop/flashloop/"
COMPOSITION_ROOT = "specloop/engine/build.py"


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    target: str  # dotted module name
    eager: bool  # runs when the importer is imported (module level, not under TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> str | None:
    """The repository path of a dotted module of ours (package: its __init__.py), else None."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def layer_of(path: str) -> str | None:
    """The RANKS key that places `path` (a file path, or a module's would-be path)."""
    matches = [key for key in RANKS if path == key or (key.endswith("/") and path.startswith(key))]
    return max(matches, key=len, default=None)


def root_exports() -> dict[str, str]:
    """Public name -> module for `specloop/__init__.py`: its `from specloop.x import ...` lines
    and its lazy table (a dict literal of name -> module)."""
    tree = ast.parse((ROOT / ROOT_PACKAGE).read_text())
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) \
                        and isinstance(value.value, str) and value.value.startswith("specloop"):
                    names[key.value] = value.value
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, name: str, is_package: bool = False) -> list[Import]:
    """Every module `source` (the module `name`) imports, wherever the import statement sits."""
    package = name if is_package else name.rpartition(".")[0]
    exports = root_exports()
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            eager = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, eager)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, eager) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if module_path(submodule) is not None:
                    target = submodule
                elif module == "specloop" and alias.name in exports:
                    target = exports[alias.name]
                else:
                    target = module
                found.append(Import(node.lineno, target, eager))
        elif isinstance(node, ast.Call) and _literal_import(node) is not None:
            found.append(Import(node.lineno, _literal_import(node), False))
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(ast.parse(source), True)
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def _literal_import(call: ast.Call) -> str | None:
    """`importlib.import_module("x")` or `__import__("x")` with a literal name."""
    func = call.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    if named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def file_imports(path: Path) -> list[Import]:
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def ours(target: str) -> bool:
    return target.split(".")[0] in PACKAGES


def target_path(target: str) -> str:
    """Where an imported module of ours lives (or would live, for one not written yet)."""
    return module_path(target) or target.replace(".", "/") + ".py"


def target_layer(target: str) -> str | None:
    path = target_path(target)
    return ROOT_PACKAGE if path == ROOT_PACKAGE else layer_of(path)


def rank_of_layer(layer: str) -> float:
    return 0 if layer == ROOT_PACKAGE else RANKS[layer]


def violations(path: Path) -> list[str]:
    """`importer:line: importer -> imported (why)` for every import of `path` against the rules."""
    rel = path.relative_to(ROOT).as_posix()
    layer = layer_of(rel)
    if rel in EXEMPT or layer is None:
        return []
    found = []
    for imp in file_imports(path):
        if not ours(imp.target):
            continue
        to = target_layer(imp.target)
        where = f"{rel}:{imp.line}: {module_name(path)} -> {imp.target}"
        if to is None:
            found.append(f"{where} (the imported module has no rank in RANKS)")
        elif to == layer:
            continue
        elif rank_of_layer(to) > RANKS[layer]:
            found.append(f"{where} (rank {RANKS[layer]:g} {layer} may not import rank {rank_of_layer(to):g} {to})")
        elif (layer, to) in APART:
            found.append(f"{where} ({layer} and {to} stay apart)")
        elif layer in ONLY and to not in ONLY[layer]:
            found.append(f"{where} ({layer} may import only {sorted(ONLY[layer])} of specloop)")
    return found


def eager_closure(name: str) -> set[str]:
    """Modules of ours that importing `name` runs: its eager imports, transitively, and the
    packages above each of them."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        parts = current.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            path = module_path(module)
            if module in seen or path is None:
                continue
            seen.add(module)
            todo.extend(imp.target for imp in file_imports(ROOT / path) if imp.eager and ours(imp.target))
    return seen


LAYER_FILES = {layer: [p for p in source_files() if layer_of(p.relative_to(ROOT).as_posix()) == layer]
               for layer in RANKS}


def test_every_module_has_a_rank():
    unplaced = [p.relative_to(ROOT).as_posix() for p in source_files()
                if p.relative_to(ROOT).as_posix() not in EXEMPT and layer_of(p.relative_to(ROOT).as_posix()) is None]
    assert not unplaced, "modules without a rank (add their package to RANKS in its layer):\n" + "\n".join(unplaced)


@pytest.mark.parametrize("layer", [layer for layer, files in LAYER_FILES.items() if files])
def test_imports_point_down(layer):
    found = [v for p in LAYER_FILES[layer] for v in violations(p)]
    print("\n".join(found))
    assert not found, f"{len(found)} imports against the layering:\n" + "\n".join(found)


@pytest.mark.parametrize("layer", sorted(NO_THIRD_PARTY))
def test_layer_never_imports_torch(layer):
    """Directly anywhere in the layer, or through what importing one of its modules runs."""
    banned = NO_THIRD_PARTY[layer]
    found = []
    for path in LAYER_FILES[layer]:
        rel = path.relative_to(ROOT).as_posix()
        for imp in file_imports(path):
            if imp.target.split(".")[0] in banned:
                found.append(f"{rel}:{imp.line}: {module_name(path)} -> {imp.target}")
        for module in sorted(eager_closure(module_name(path)) - {module_name(path)}):
            dep = module_path(module)
            assert dep is not None
            for imp in file_imports(ROOT / dep):
                if imp.eager and imp.target.split(".")[0] in banned:
                    found.append(f"{rel}: {module_name(path)} -> {module} -> {imp.target} ({dep}:{imp.line})")
    print("\n".join(found))
    assert not found, f"{layer} must not import {', '.join(banned)}:\n" + "\n".join(found)


def test_core_never_imports_a_feature_package():
    """A module outside the feature packages imports none of them, the composition root aside."""
    found = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXEMPT or rel == COMPOSITION_ROOT or layer_of(rel) == FEATURES:
            continue
        for imp in file_imports(path):
            if ours(imp.target) and target_layer(imp.target) == FEATURES:
                found.append(f"{rel}:{imp.line}: {module_name(path)} -> {imp.target}")
    print("\n".join(found))
    assert not found, "core modules import feature packages:\n" + "\n".join(found)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    """No two modules of ours import each other, directly or through others (every import
    counts, those under TYPE_CHECKING too): a cycle means two modules are one concept, or a
    type sits in the wrong one."""
    graph = {}
    for path in source_files():
        name = module_name(path)
        if path.relative_to(ROOT).as_posix() in EXEMPT:
            continue
        graph[name] = {imp.target for imp in file_imports(path)
                       if ours(imp.target) and module_path(imp.target) and imp.target != name}
    assert not import_cycles(graph)
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_feature_rule_sees_a_feature_import():
    source = "from specloop.flashloop.kv_residual.feature import KVResidualFeature\n"
    [imp] = imports_of(source, "specloop.runtime.runner")
    assert target_layer(imp.target) == FEATURES
    assert target_layer("specloop.flashloop.config") == "specloop/flashloop/config.py"


def test_the_checker_sees_every_kind_of_import():
    """The walk finds imports in functions, under TYPE_CHECKING, in try blocks, relative ones,
    submodules named in `from pkg import mod`, lazy root exports and literal import_module."""
    source = '''
from __future__ import annotations
import typing
from typing import TYPE_CHECKING
import specloop.errors
from specloop import engine, LLM, __version__
from . import kv_manager
from .plan import Plan
if TYPE_CHECKING:
    from specloop.runtime.runner import Runner
else:
    import specloop.config
try:
    import server.app
except ImportError:
    pass
def later():
    from specloop.pipeline import acceptance
    importlib.import_module("server.main")
'''
    found = imports_of(source, "specloop.scheduling.scheduler")
    targets = {(imp.target, imp.eager) for imp in found}
    assert {("specloop.errors", True), ("specloop.engine", True), ("specloop.llm", True), ("specloop", True),
            ("specloop.scheduling.kv_manager", True), ("specloop.scheduling.plan", True),
            ("specloop.runtime.runner", False), ("specloop.config", True), ("server.app", True),
            ("specloop.pipeline.acceptance", False), ("server.main", False)} <= targets, targets
    assert [imp.line for imp in found if imp.target == "server.main"] == [19]


def test_the_checker_places_new_packages_and_targets():
    assert layer_of("specloop/kernels/sparse_decode_source.py") == "specloop/kernels/"
    assert layer_of("specloop/newthing/x.py") is None  # a new package must be placed in RANKS
    assert target_layer("specloop") == ROOT_PACKAGE and rank_of_layer(ROOT_PACKAGE) == 0
    assert target_layer("specloop.protocol") == "specloop/protocol.py"
    assert target_layer("server") == "server/"
