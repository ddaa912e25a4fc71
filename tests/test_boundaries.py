"""The package's import boundaries and module names, checked on the source (no imports run).

- The library (everything in ``pinads_rec/`` but ``pinads_rec/experiments/``) never imports the
  experiment drivers or the benchmarks: they are built on the library, not the other way round.
- Models and modules are plain ``nn.Module``s: they never import the parallelism (``parallel``,
  ``torchrec.distributed``) or the training loop; sharding is applied from outside.
- ``train.py`` runs as a script, so ``pinads_rec/`` itself is on ``sys.path`` in every rank: no
  module there may shadow a standard-library or installed module of the same name.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

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
