"""The installed environment is the lock file's (locks/cpu.txt or locks/cuda.txt, scripts/setup_env.sh
installs them): every locked package at exactly its version, nothing else but the project itself.
And the two locks agree on every package they share, so the variants differ only where they must."""

import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

LOCKS = Path(__file__).resolve().parent.parent / "locks"
# The packages only one variant has: torch's build, fbgemm's build, and the CUDA runtime torch requires.
VARIANT_ONLY = re.compile(r"^(torch|fbgemm-gpu(-cpu)?|nvidia-.*|cuda-.*|triton)$")
# What the project needs in every lock (issue 18): installed today, TensorBoard, the kubernetes extra.
REQUIRED = {"torch", "torchrec", "torchx", "pyarrow", "tensorboard", "kubernetes", "ruff", "pytest", "pytest-xdist"}


def _name(name: str) -> str:
    """PEP 503 normalized (pip freeze writes fbgemm_gpu-cpu, the lock may too)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(lines) -> Dict[str, str]:
    """name -> version of `name==version` lines; comments and blank lines skipped."""
    pins: Dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"not pinned with ==: {line!r}"
        assert _name(name) not in pins, f"listed twice: {name}"
        pins[_name(name)] = version
    return pins


def _lock(variant: str) -> Dict[str, str]:
    return _pins((LOCKS / f"{variant}.txt").read_text().splitlines())


@pytest.mark.slow
def test_the_venv_is_the_lock():
    variant = "cuda" if torch.version.cuda else "cpu"
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--exclude", "pip", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    installed = _pins(line for line in freeze if " @ " not in line)  # "name @ url": not from the index
    by_url = sorted(_name(line.split(" @ ")[0]) for line in freeze if " @ " in line)
    locked = _lock(variant)
    wrong = {n: (v, installed.get(n, "missing")) for n, v in locked.items() if installed.get(n) != v}
    # The project itself is no locked package: pip lists it as editable, or, when the checkout with its
    # pinads_rec.egg-info is on sys.path (python -m from the repo root), as pinads_rec==0.1.0.
    extra = sorted(set(installed) - set(locked) - {"pinads-rec"}) + by_url
    fix = f"run scripts/setup_env.sh (or remove {sys.prefix} and run it)"
    assert not wrong, f"locks/{variant}.txt (locked, installed): {wrong}; {fix}"
    assert not extra, f"installed but not in locks/{variant}.txt: {extra}; {fix}"


def test_the_locks_agree_on_what_they_share():
    cpu, cuda = _lock("cpu"), _lock("cuda")
    assert REQUIRED <= set(cpu) and REQUIRED <= set(cuda), REQUIRED - (set(cpu) & set(cuda))
    shared = {n for n in set(cpu) | set(cuda) if not VARIANT_ONLY.match(n)}
    assert {n: (cpu.get(n), cuda.get(n)) for n in shared if cpu.get(n) != cuda.get(n)} == {}
    assert cpu["torch"].endswith("+cpu") and "fbgemm-gpu-cpu" in cpu
    assert "+" not in cuda["torch"] and "fbgemm-gpu" in cuda
