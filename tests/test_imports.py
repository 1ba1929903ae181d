"""The import graph, read with `ast` (function-level imports included): no circles, the runtime imports
nothing of the builder, and no builder module imports a stage above its own."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle3_runtime", "eagle3_build")

# the builder's stages, lowest first: a module may import its own stage or one below it
STAGES = [
    ["", "errors", "files", "host", "progress"],
    ["recipe", "default_buckets"],
    ["models"],
    ["checkpoints"],
    ["sharding"],
    ["graphs", "pair"],
    ["compile"],
    ["backends"],
    ["build", "output"],
    ["plan", "publish", "verify"],
    ["testing", "demo"],
    ["cli"],
]


def module_files() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT / pkg).with_suffix("").parts
            if not all((ROOT / pkg).joinpath(*rel[:i], "__init__.py").exists() for i in range(len(rel))):
                continue  # not a module of the package (a build/ left by pip, say)
            name = ".".join((pkg, *(x for x in rel if x != "__init__")))
            mods[name] = (p, p.name == "__init__.py")
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports; importing a.b.c also runs the packages a and a.b."""
    mods = module_files()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets.add(base)
                targets |= {f"{base}.{a.name}" for a in node.names}
        edges = set()
        for t in targets:
            parts = t.split(".")
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = {t for t in edges if t in mods and t != name and not name.startswith(t + ".")}
    return graph


def stage(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(STAGES) if top in names)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t, path + [t])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_runtime_imports_nothing_of_the_builder():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith("eagle3_build")) for m, ts in graph.items()
           if m.startswith("eagle3_runtime")}
    assert not {m: ts for m, ts in bad.items() if ts}


def test_no_stage_imports_one_above_it():
    graph = import_graph()
    assert stage("eagle3_build.cli") > stage("eagle3_build.build") > stage("eagle3_build.checkpoints.load")
    upward = [f"{m} -> {t}" for m, ts in graph.items() if m.startswith("eagle3_build")
              for t in ts if t.startswith("eagle3_build") and stage(t) > stage(m)]
    assert not upward, upward


def test_the_checker_sees_a_circle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert stage("eagle3_build.models.llama") < stage("eagle3_build.compile.cache")
