"""The package's import boundaries and module names, checked on the source (no imports run).

- The library (everything in ``pinads_rec/`` but ``pinads_rec/experiments/``) never imports the
  experiment drivers or the benchmarks: they are built on the library, not the other way round.
- Models and modules are plain ``nn.Module``s: they never import the parallelism (``parallel``,
  ``torchrec.distributed``) or the training loop; sharding is applied from outside.
- No import circle anywhere in the package: every import counts, a function's included (a lazy
  import still ties the two modules together), and importing ``a.b.c`` counts as importing the
  packages ``a`` and ``a.b`` too, since Python runs their ``__init__`` first -- except the importer's
  own packages, which are already initializing when it runs.
- ``train.py`` runs as a script, so ``pinads_rec/`` itself is on ``sys.path`` in every rank: no
  module there may shadow a standard-library or installed module of the same name.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pinads_rec"


def imported_modules(path: Path, root: Path = REPO) -> set:
    """Absolute names of every module ``path`` (under ``root``) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def violations(paths, forbidden):
    out = []
    for path in paths:
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(REPO)} imports {name}")
    return out


def library_files():
    return [p for p in PACKAGE.rglob("*.py") if "experiments" not in p.relative_to(PACKAGE).parts]


def test_the_library_never_imports_experiments_or_benchmarks():
    assert violations(library_files(), ("pinads_rec.experiments", "benchmarks")) == []


def test_models_and_modules_never_import_parallelism_or_training():
    files = list((PACKAGE / "models").rglob("*.py")) + list((PACKAGE / "modules").rglob("*.py"))
    forbidden = ("pinads_rec.parallel", "pinads_rec.training", "pinads_rec.train", "torchrec.distributed")
    assert violations(files, forbidden + ("pinads_rec.experiments",)) == []


def test_the_checks_see_a_forbidden_import(tmp_path):
    bad = tmp_path / "pinads_rec" / "models" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from pinads_rec import parallel\nfrom ..experiments import harness\n")
    assert {"pinads_rec.parallel", "pinads_rec.experiments.harness"} <= imported_modules(bad, tmp_path)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def packages_of(name: str) -> List[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages whose ``__init__`` runs before it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(package: Path, root: Path) -> Dict[str, Set[str]]:
    """Each module of ``package`` (a package is its ``__init__``) -> the package's modules it imports,
    every import counted (``imported_modules``: a function's too). A name that is not a module
    (``from a.b import function``) is its module's; importing ``a.b.c`` also imports ``a`` and ``a.b``
    (their ``__init__`` runs first), unless they are the importer's own packages, already initializing."""
    modules = {module_name(p, root): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        own = set(packages_of(name)) | {name}
        deps = set()
        for imported in imported_modules(path, root):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported:
                deps.update(m for m in (*packages_of(imported), imported) if m in modules and m not in own)
        graph[name] = deps
    return graph


def import_circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The graph's circles: its strongly connected components of more than one module (Tarjan's)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circle_in_the_package():
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    circles = import_circles(import_graph(PACKAGE, REPO))
    assert circles == [], "modules that import each other, directly or around a circle: " + "; ".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_check_sees_a_planted_circle(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b  # a lazy import is a circle too\n",
        "pkg/b.py": "from pkg.a import f\n",
        # Importing pkg.sub.leaf runs pkg/sub/__init__.py, which imports pkg.c back.
        "pkg/c.py": "import pkg.sub.leaf\n",
        "pkg/sub/__init__.py": "from pkg.c import *\n",
        "pkg/sub/leaf.py": "from .. import c\n",
        # A submodule importing its own package is no circle: the package is already initializing.
        "pkg/own/__init__.py": "from pkg.own.x import X\n",
        "pkg/own/x.py": "from pkg.own import y\nX = 1\n",
        "pkg/own/y.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_circles(import_graph(tmp_path / "pkg", tmp_path)) == [
        ["pkg.a", "pkg.b"],
        ["pkg.c", "pkg.sub", "pkg.sub.leaf"],
    ]


def top_level_names():
    return sorted(
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", top_level_names())
def test_no_module_of_the_package_shadows_another(name):
    assert name not in sys.stdlib_module_names, f"pinads_rec/{name} shadows the standard library's {name}"
    # Look the name up as a script's rank would, but without pinads_rec/ on the path: from another
    # directory, in a fresh interpreter of the project's environment.
    found = subprocess.run(
        [sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}) is not None)"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert found == "False", f"pinads_rec/{name} shadows an installed module named {name}"
    assert importlib.util.find_spec(f"pinads_rec.{name}") is not None
