"""Which code an experiment or benchmark ran, as its report states it: the git commit of the working
tree the launches ran (``training.run_log.git_state``, what every run records in
``run_metadata.json``) and the files changed beside it; and as a run's key states it, a digest of
the package's sources (``source_digest``: a run trained by other code is not reused)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Dict, List, Union

from pinads_rec.training.run_log import git_state

REPO = Path(__file__).resolve().parents[3]


def changed_files(repo: Path = REPO) -> List[str]:
    """``git status --porcelain`` lines of ``repo`` (tracked and untracked changes); [] outside git."""
    try:
        out = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.strip().splitlines() if out.returncode == 0 else []


def code_state(repo: Path = REPO) -> Dict[str, Union[str, List[str]]]:
    """The commit the runs ran and the files changed beside it (launches run the working tree)."""
    commit, _ = git_state(repo)
    return {"commit": commit, "changed": changed_files(repo)}


def code_version(repo: Path = REPO) -> str:
    """One line for a report: "commit abc1234", "... with uncommitted changes", or "outside git"."""
    commit, dirty = git_state(repo)
    if commit == "unknown":
        return "outside git"
    return f"commit {commit[:7]}" + (" with uncommitted changes" if dirty else "")


def source_digest(repo: Path = REPO) -> str:
    """A digest of the package's Python sources: a run trained by other code is not reused."""
    h = hashlib.sha1()
    for path in sorted((repo / "pinads_rec").rglob("*.py")):
        h.update(str(path.relative_to(repo)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
