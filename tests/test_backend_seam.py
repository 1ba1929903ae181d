"""Backend knowledge lives in the backends: outside the `backends/` folders no builder or runtime module
names a backend, branches on one or holds a table of backend facts, read with `ast`; each backend class
answers for itself (its facts: eagle3_runtime/backends/facts.py)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runtime.backends.base import RuntimeBackend
from eagle3_runtime.backends.facts import BACKENDS, backend_facts
from eagle3_runtime.backends.registry import SERVABLE, backend_class

ROOT = Path(__file__).resolve().parent.parent


def _is_name(n) -> bool:
    return isinstance(n, ast.Constant) and n.value in BACKENDS


def backend_mentions(path: Path) -> list[str]:
    """Non-docstring string constants that are a backend's name, and comparisons on a `.backend` or a
    `backend` variable."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if _is_name(n) and id(n) not in docstrings:
            out.append(f"{path.name}:{n.lineno}: {n.value!r}")
        if isinstance(n, ast.Compare):
            sides = (n.left, *n.comparators)
            if any(isinstance(x, ast.Attribute) and x.attr == "backend" for x in sides):
                out.append(f"{path.name}:{n.lineno}: compares .backend")
            elif any(isinstance(x, ast.Name) and x.id == "backend" for x in sides) and \
                    any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides):
                out.append(f"{path.name}:{n.lineno}: compares backend with a string")
    return out


def backend_tables(path: Path) -> list[str]:
    """Dict literals keyed by a backend's name, dict(name=...) calls, and tuples / lists / sets of names."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Dict) and any(_is_name(k) for k in n.keys if k is not None):
            out.append(f"{path.name}:{n.lineno}: dict keyed by backend")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict" and \
                any(k.arg in BACKENDS for k in n.keywords):
            out.append(f"{path.name}:{n.lineno}: dict keyed by backend")
        elif isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(_is_name(e) for e in n.elts):
            out.append(f"{path.name}:{n.lineno}: {type(n).__name__.lower()} of backends")
    return out


def outside_the_backends() -> list[Path]:
    files = []
    for pkg in ("eagle3_build", "eagle3_runtime"):
        files += [p for p in (ROOT / pkg).rglob("*.py") if "backends" not in p.relative_to(ROOT / pkg).parts]
    return files


def test_no_module_outside_the_backends_names_a_backend():
    files = outside_the_backends()
    assert len(files) > 60 and any(p.name == "manifest.py" for p in files)
    found = [m for p in files for m in backend_mentions(p)]
    assert not found, found


def test_no_table_of_backend_facts_outside_the_backends():
    found = [m for p in outside_the_backends() for m in backend_tables(p)]
    assert not found, found


def test_the_checkers_see_a_branch_and_a_table(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""export."""\nif m.backend == "neuron":\n    x = "aoti"\nif backend != "x":\n    pass\n')
    assert sorted(backend_mentions(p)) == ["m.py:2: 'neuron'", 'm.py:2: compares .backend', "m.py:3: 'aoti'",
                                           "m.py:4: compares backend with a string"]
    p.write_text('F = {"export": 1, "neuron": 2}\nP = ("aoti",)\nO = dict(aoti=("device",))\nS = [m, "neuron"]\n')
    assert sorted(backend_tables(p)) == ["m.py:1: dict keyed by backend", "m.py:2: tuple of backends",
                                         "m.py:3: dict keyed by backend", "m.py:4: list of backends"]


@pytest.mark.parametrize("name", SERVABLE)
def test_every_backend_class_answers_for_itself(name):
    cls = backend_class(name)
    assert issubclass(cls, RuntimeBackend) and cls.name == name and cls.graph_kind
    for method in ("host_checks", "join_world"):
        assert getattr(cls, method).__func__ is not getattr(RuntimeBackend, method).__func__, (name, method)
    for method in ("copy_kv_row", "compact_kv"):
        assert getattr(cls, method) is not getattr(RuntimeBackend, method), (name, method)


@pytest.mark.parametrize("name", SERVABLE)
def test_every_backend_class_is_its_facts(name):
    facts = backend_facts(name)
    assert facts.name == name and facts.graph_format
    assert issubclass(backend_class(name), facts)


def test_the_facts_are_read_without_torch():
    """The manifest's checks, the recipe and the builder's preflight ask the facts before torch may load."""
    code = ("import sys, eagle3_runtime.manifest, eagle3_build.recipe, eagle3_build.backends.registry as r; "
            "r.preflight('export'); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_the_build_orchestrator_and_plan_name_no_backend():
    """The builder's side: build, plan, the pair's models, the output directory and the compile cache
    drive any backend through eagle3_build.backends.base.Backend."""
    text = (ROOT / "eagle3_build" / "build.py").read_text()
    assert "SPMD" not in text and "spmd" not in text
