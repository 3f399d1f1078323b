"""No import circle inside the package.

The graph is built with `ast` from every module under ckptsup/, counting ALL imports: top-level
ones, those inside functions, and those under `if TYPE_CHECKING:` — a lazy import still couples
the two modules (one cannot be understood, tested or moved without the other). Relative imports
are resolved to module names; `from pkg import name` counts as an import of the submodule
`pkg.name` when there is one, else of `pkg` itself. The implicit import of a parent package's
`__init__` (importing `ckptsup.a.b` runs `ckptsup/a/__init__.py`) is not an edge: the
`__init__` modules stay empty or lazy, and counting it would make every module depend on every
package above it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping, Set
from pathlib import Path

PACKAGE = "ckptsup"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve_from(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    """The absolute name of `from <...> import` in `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, modules):
        base = base[:-1]                 # a plain module's relative imports start at its package
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` or its closest enclosing module that is part of the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _dynamic_import(node: ast.AST) -> str | None:
    """The module named by `importlib.import_module("x")` or `__import__("x")`: a literal string."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    named = (isinstance(func, ast.Name) and func.id in ("__import__", "import_module")) or \
        (isinstance(func, ast.Attribute) and func.attr == "import_module")
    return node.args[0].value if named and isinstance(node.args[0].value, str) else None


def external_imports(module: str, modules: dict[str, Path]) -> set[str]:
    """The top-level names of everything `module` imports, statements and literal importlib
    strings alike (torch, click, ...)."""
    tree = ast.parse(modules[module].read_text(), filename=str(modules[module]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif (name := _dynamic_import(node)) is not None:
            found.add(name.split(".")[0])
    return found


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """Every package module that `module` imports, anywhere in its body (literal importlib and
    __import__ strings included)."""
    tree = ast.parse(modules[module].read_text(), filename=str(modules[module]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if (name := _dynamic_import(node)) is not None and (target := _known(name, modules)):
            found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, node, modules)
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _known(base, modules)
                if target:
                    found.add(target)
    found.discard(module)
    return found


@functools.lru_cache(maxsize=None)
def import_graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    modules = module_names(root)
    return {name: frozenset(imports_of(name, modules)) for name in modules}


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:   # the package is small: recursion depth is no concern
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def cycle_path(graph: Mapping[str, Set[str]], component: list[str]) -> list[str]:
    """One closed path through a component (a -> b -> ... -> a), found breadth-first from its
    first module, for the failure message."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return component


# The layers of docs/architecture.md §Layers and their rules: which part of the package may import
# which. A part is a top-level module or a subpackage; the top-level modules are the base.
BASE = {"ckptsup.errors", "ckptsup._version", "ckptsup.wire", "ckptsup.messages", "ckptsup.events", "ckptsup.env", "ckptsup.safe_io",
        "ckptsup.config", "ckptsup.rundir", "ckptsup.resources", "ckptsup.progress", "ckptsup.memory_wire",
        "ckptsup.textsafe", "ckptsup.stack_dump", "ckptsup.step_lines", "ckptsup.console",
        "ckptsup.container", "ckptsup.memory_left"}
MAY_IMPORT = {
    **{name: BASE for name in BASE},
    "ckptsup.checkpoint": BASE,                       # torch-free core
    "ckptsup.planning": BASE,                         # reads events.jsonl, never the supervisor
    "ckptsup.slurm": BASE,                            # the one seam to Slurm
    "ckptsup.hooks": BASE | {"ckptsup.checkpoint"},   # the training side: never the supervisor
    "ckptsup.rankside": BASE,                         # rank processes on a node (torch): never the supervisor
    "ckptsup.supervisor": BASE | {"ckptsup.checkpoint", "ckptsup.planning", "ckptsup.slurm"},  # never the hooks
    "ckptsup.integrations": BASE | {"ckptsup.checkpoint", "ckptsup.hooks"},  # framework callbacks over the hooks
    "ckptsup.cli": BASE,                              # subsystems' commands by name (importlib)
    "ckptsup": {"ckptsup._version", "ckptsup.hooks"},  # attach() reaches the hooks lazily
}


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


# The supervisor's rooms (ckptsup/supervisor/__init__.py; docs/architecture.md §Rooms): which room
# may import which. A room is a sub-package; the supervisor's top-level modules are shared by all.
SUPERVISOR = "ckptsup.supervisor"
SHARED = {f"{SUPERVISOR}.{m}" for m in ("spec", "torchrun_args", "processes")}
ROOM_MAY_IMPORT = {
    **{name: SHARED for name in SHARED},
    f"{SUPERVISOR}.health": SHARED,
    f"{SUPERVISOR}.node": SHARED,
    f"{SUPERVISOR}.job": SHARED | {f"{SUPERVISOR}.health", f"{SUPERVISOR}.node"},
    f"{SUPERVISOR}.ops": SHARED | {f"{SUPERVISOR}.health", f"{SUPERVISOR}.job"},
    f"{SUPERVISOR}.cli": SHARED | {f"{SUPERVISOR}.job", f"{SUPERVISOR}.node"},   # the two entry points
    SUPERVISOR: set(),
}


def room(module: str) -> str:
    return ".".join(module.split(".")[:3])


def _describe(graph: Mapping[str, Set[str]], found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle_path(graph, c)) for c in found)


def test_the_graph_sees_relative_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "ckptsup.wire" in graph["ckptsup.supervisor.job.agent_step"]          # from .. import wire
    assert "ckptsup.hooks.session" in graph["ckptsup"]                       # inside a function
    assert "ckptsup.checkpoint.commit" in graph["ckptsup.checkpoint.tiers"]   # from .commit import ...
    assert all(name.startswith("ckptsup") for deps in graph.values() for name in deps)


def test_cycle_finder_reports_each_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_cycle_path_is_a_closed_walk() -> None:
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"c"}}
    path = cycle_path(graph, ["a", "b", "c", "d"])
    assert path[0] == path[-1] == "a" and all(b in graph[a] for a, b in zip(path, path[1:]))


def test_every_part_of_the_package_has_a_layer() -> None:
    assert {part(m) for m in import_graph()} <= set(MAY_IMPORT)


def test_parts_import_only_what_their_layer_allows() -> None:
    bad = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                 if part(a) != part(b) and part(b) not in MAY_IMPORT.get(part(a), set()))
    assert not bad, "imports across layers (docs/architecture.md §Layers and their rules):\n" + "\n".join(bad)


def test_the_supervisor_side_never_imports_torch_not_even_by_name() -> None:
    """docs/architecture.md §Layers: supervisor/, slurm/, planning/ and checkpoint/ run without
    torch; a rank-side process (rankside/) is started by module name, never imported."""
    modules = module_names()
    torch_free = [m for m in modules if part(m) in ("ckptsup.supervisor", "ckptsup.slurm", "ckptsup.planning",
                                                      "ckptsup.checkpoint")]
    bad = sorted(m for m in torch_free if "torch" in external_imports(m, modules))
    assert not bad, f"torch imported on the supervisor side: {bad}"


def test_importlib_strings_count_as_imports() -> None:
    tree = ast.parse('import importlib\nimportlib.import_module("torch.distributed")\n__import__("ckptsup.wire")\n'
                     'from importlib import import_module\nimport_module(name)\n')
    assert [_dynamic_import(n) for n in ast.walk(tree) if _dynamic_import(n)] == ["torch.distributed", "ckptsup.wire"]


def test_no_import_cycles_in_the_package() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in ckptsup/ (break each one):\n" + _describe(graph, found)


def test_every_supervisor_module_sits_in_a_room() -> None:
    rooms = {room(m) for m in import_graph() if part(m) == SUPERVISOR}
    assert rooms <= set(ROOM_MAY_IMPORT), sorted(rooms - set(ROOM_MAY_IMPORT))


def test_supervisor_rooms_import_only_what_their_init_allows() -> None:
    bad = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                 if part(a) == part(b) == SUPERVISOR and room(a) != room(b)
                 and room(b) not in ROOM_MAY_IMPORT.get(room(a), set()))
    assert not bad, "imports across the supervisor's rooms (their __init__ docstrings):\n" + "\n".join(bad)


def test_the_room_rule_sees_a_forbidden_import() -> None:
    """The node agent may not reach into the job supervisor: a graph with that edge is caught."""
    graph = {f"{SUPERVISOR}.node.agent": {f"{SUPERVISOR}.job.policy", f"{SUPERVISOR}.spec"}}
    bad = [b for a, deps in graph.items() for b in deps
           if room(a) != room(b) and room(b) not in ROOM_MAY_IMPORT[room(a)]]
    assert bad == [f"{SUPERVISOR}.job.policy"]
