"""The console entry points of pyproject's [project.scripts]: each names a real function that is the
`python -m` command of the same name (its --help works in-process), and the README lists each one
beside its `python -m` form. Checked on pyproject itself, not on an installed copy: the scripts
appear on PATH only once scripts/setup_env.sh reinstalls the package after pyproject changes.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# script -> the `python -m` module it stands for
COMMANDS = {
    "pinads-train": "pinads_rec.train",
    "pinads-synth": "pinads_rec.data.synth",
    "pinads-plan": "pinads_rec.plan",
    "pinads-serve": "pinads_rec.serve",
    "pinads-scaling": "pinads_rec.experiments.scaling",
    "pinads-ablate": "pinads_rec.experiments.ablate",
    "pinads-stability": "pinads_rec.experiments.stability",
}


def _scripts() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_command_has_a_script():
    assert set(_scripts()) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_script_is_its_python_m_command(name, capsys):
    module_name, _, function = _scripts()[name].partition(":")
    # the target lives in the module `python -m` runs (a package's: the one its __main__ calls)
    assert module_name == COMMANDS[name] or module_name.startswith(COMMANDS[name] + ".")
    main = getattr(importlib.import_module(module_name), function)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_readme_lists_each_script_beside_its_python_m_form():
    lines = (REPO / "README.md").read_text().splitlines()
    for name, module in COMMANDS.items():
        assert any(f"`{name}`" in line and f"`python -m {module}`" in line for line in lines), name
