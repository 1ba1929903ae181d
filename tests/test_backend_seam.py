"""Backend knowledge lives in the backends: outside `eagle3_runtime/backends/` (and the manifest's one
table of backend facts) no runtime module names a backend or branches on `manifest.backend`, read with
`ast`; each backend class answers for itself."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eagle3_runtime.backends import SERVABLE, backend_class
from eagle3_runtime.backends.base import RuntimeBackend
from eagle3_runtime.manifest import BACKENDS

ROOT = Path(__file__).resolve().parent.parent


def backend_mentions(path: Path) -> list[str]:
    """Non-docstring string constants that are a backend's name, and comparisons on a `.backend`."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and n.value in BACKENDS and id(n) not in docstrings:
            out.append(f"{path.name}:{n.lineno}: {n.value!r}")
        if isinstance(n, ast.Compare) and any(isinstance(x, ast.Attribute) and x.attr == "backend"
                                              for x in (n.left, *n.comparators)):
            out.append(f"{path.name}:{n.lineno}: compares .backend")
    return out


def test_no_runtime_module_outside_the_backends_names_a_backend():
    files = [p for p in (ROOT / "eagle3_runtime").rglob("*.py")
             if "backends" not in p.relative_to(ROOT / "eagle3_runtime").parts and p.name != "manifest.py"]
    assert len(files) > 20
    found = [m for p in files for m in backend_mentions(p)]
    assert not found, found


def test_the_checker_sees_a_branch_on_the_backend(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""export."""\nif m.backend == "neuron":\n    x = "aoti"\n')
    assert backend_mentions(p) == ['m.py:2: compares .backend', "m.py:2: 'neuron'", "m.py:3: 'aoti'"]


@pytest.mark.parametrize("name", SERVABLE)
def test_every_backend_class_answers_for_itself(name):
    cls = backend_class(name)
    assert issubclass(cls, RuntimeBackend) and cls.name == name and cls.graph_kind
    for method in ("host_checks", "join_world"):
        assert getattr(cls, method).__func__ is not getattr(RuntimeBackend, method).__func__, (name, method)
    for method in ("copy_kv_row", "compact_kv"):
        assert getattr(cls, method) is not getattr(RuntimeBackend, method), (name, method)


def test_the_build_orchestrator_and_plan_name_no_backend():
    """The builder's side: build, plan, the pair's models, the output directory and the compile cache
    drive any backend through eagle3_build.backends.base.Backend."""
    files = [ROOT / "eagle3_build" / f for f in ("build.py", "plan.py", "pair.py", "output.py")]
    files += sorted((ROOT / "eagle3_build" / "compile").glob("*.py"))
    found = [m for p in files for m in backend_mentions(p)]
    assert not found, found
    text = (ROOT / "eagle3_build" / "build.py").read_text()
    assert "SPMD" not in text and "spmd" not in text
