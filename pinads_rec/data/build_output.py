"""What a complete build directory is, and how a build replaces one in a single step.

A build (data/build/) writes everything into ``.<name>.building-<pid>`` beside ``--out`` (same
parent: one rename moves it). ``manifest.json`` is the last file written: every other file's bytes
and sha256, one ``fingerprint`` over them, the split names, and ``complete: true``. Only then is
the directory swapped in: the old output renamed to ``.<name>.previous-<pid>``, the new one renamed
to ``<name>``, the old one removed. A failed or killed build never touches ``<name>``.

- ``replacing(out)``: the build's temporary directory; swapped in when the build returns,
  removed when it raises.
- ``recover(out)``: what killed builds left beside ``out``, found by name: a temporary directory
  is removed; a previous output set aside and never replaced (killed between the two renames) is
  renamed back. Every build starts with it.
- ``recover_under(parent)``: the same for every output in ``parent`` (a day build's days).
- ``require_complete(path)``: the readers' rule, in ``reader.list_files`` (loader, trainer,
  inspect, serve) and ``Vocabularies.load``.
- ``require_unchanged(paths)``: the files a reader is about to use against their manifest's sha256,
  each hashed once per process (``reader.list_files``: a job's ranks share the files;
  ``Vocabularies.load``; a day build's ``--vocabularies``; ``inspect --verify``).
- ``verify(out)``: every file's sha256 against the manifest; returns the fingerprint.
- ``kill_point(step)``: the test hook that stops a build at a named step.

A day build (data/build/days.py) makes each day's partition, ``<out>/days/<day>/``, a complete
build directory of its own: its files at its top, its manifest (no splits), ``replacing`` it alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

from pinads_rec.config import ConfigError
from pinads_rec.data.loader.contract import ContractError

MANIFEST = "manifest.json"
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>building|previous)-(?P<pid>\d+)")
# Test hook (tests/test_build_output.py, tests/test_build_days.py): the build SIGKILLs itself at
# this step, one of ``split:<name>`` (that split written; a day build's ``split:<day>``: that day's
# files written), ``publish`` (manifest written, nothing renamed yet),
# ``swap`` (the old output renamed aside, the new one not yet in) and ``cleanup`` (the new one in,
# the old one not yet removed).
KILL_AT = "PINADS_BUILD_KILL_AT"


def kill_point(step: str) -> None:
    if os.environ.get(KILL_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _shown(path: Path) -> str:
    """``path`` as a message shows it: relative to the working directory when under it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _beside(out: Path, kind: str, pid: int) -> Path:
    return out.parent / f".{out.name}.{kind}-{pid}"


def work_dir(out: Path, pid: int) -> Path:
    """The temporary directory the build of ``out`` running as process ``pid`` writes into (its
    DuckDB spill in ``.build_tmp`` inside: benchmarks/build.py measures it)."""
    return _beside(out, "building", pid)


def leftovers(out: Path) -> List[Tuple[str, Path, int]]:
    """(kind, path, pid) of every temporary (``building``) or set-aside (``previous``) directory
    of ``out`` beside it: names of the pattern only."""
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:
        return []
    found = []
    for name in names:
        m = _LEFTOVER.fullmatch(name)
        if m and m["name"] == out.name:
            found.append((m["kind"], out.parent / name, int(m["pid"])))
    return found


def running(pid: int) -> bool:
    """Another process of that pid (not this one) runs on this machine: what it named after its pid
    (a build's directory, ``serve score``'s temporary file) is not a leftover."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(out: Path) -> None:
    """Cleans up after killed builds of ``out``: temporary directories removed, and the previous
    output put back if a build was killed between moving it aside and moving the new one in."""
    for kind, path, pid in leftovers(out):
        if running(pid):
            continue
        if kind == "previous" and not os.path.lexists(out):
            os.rename(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def recover_under(parent: Path) -> None:
    """``recover`` for every output directory that killed builds left something of in ``parent``
    (a day build's ``<out>/days``: yesterday's killed day is cleaned up by today's build)."""
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return
    for name in dict.fromkeys(m["name"] for m in map(_LEFTOVER.fullmatch, names) if m):
        recover(parent / name)


@contextmanager
def replacing(out_dir: str) -> Iterator[Path]:
    """The directory a build writes into; on a normal exit it must hold a complete manifest and
    replaces ``out_dir`` whole, on an exception it is removed and ``out_dir`` stays as it was."""
    out = Path(os.path.abspath(out_dir))
    recover(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        # Replacing --out whole would delete whatever else the directory holds.
        raise ConfigError(
            f"--out {out_dir}: exists and is not a build's output (no {MANIFEST}); the build replaces it "
            f"whole: give a new directory, or remove this one"
        )
    work = work_dir(out, os.getpid())
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir()
    try:
        yield work
        problem = _problem(work, None)
        if problem:
            raise ContractError(f"build: {work} is not complete ({problem}); nothing replaced")
        kill_point("publish")
        _swap(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already once swapped in


def _swap(work: Path, out: Path) -> None:
    aside = _beside(out, "previous", os.getpid())
    if os.path.lexists(out):
        os.rename(out, aside)
        kill_point("swap")
    try:
        os.rename(work, out)
    except OSError:
        if os.path.lexists(aside):
            os.rename(aside, out)
        raise
    kill_point("cleanup")
    shutil.rmtree(aside, ignore_errors=True)


def _files(directory: Path, prefix: str = "") -> Dict[str, int]:
    """Relative path (``prefix`` + posix path) -> bytes, of every file under ``directory``, the
    manifest at its top excepted."""
    found = {}
    for top, _, names in os.walk(directory):
        for name in names:
            path = Path(top) / name
            rel = prefix + path.relative_to(directory).as_posix()
            if rel != MANIFEST:
                found[rel] = path.stat().st_size
    return found


def sha256(path: Path) -> str:
    """A file's sha256, as the manifest lists it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fingerprint(files: Dict[str, dict]) -> str:
    """sha256 over ``sha256sum``'s lines of every file, in path order."""
    lines = "".join(f"{files[p]['sha256']}  {p}\n" for p in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def write_manifest(root: Path, manifest: dict, splits: List[str]) -> None:
    """``manifest`` plus every file under ``root`` (bytes, sha256), their fingerprint, the splits
    and, last, ``complete: true``: the last file of the build."""
    files = {rel: {"bytes": n, "sha256": sha256(root / rel)} for rel, n in sorted(_files(root).items())}
    manifest = {**manifest, "splits": list(splits), "files": files, "fingerprint": _fingerprint(files)}
    manifest["complete"] = True
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _manifest(root: Path) -> Tuple[Optional[dict], str]:
    """The complete manifest of ``root``, or None and why not."""
    try:
        m = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        kinds = {kind: path.name for kind, path, _ in leftovers(root)}
        if "previous" in kinds:
            return None, (
                f"{_shown(root)} is missing and {kinds['previous']} beside it holds the previous build: a build "
                f"was killed while replacing it; the next build puts it back"
            )
        if "building" in kinds:
            return None, f"{MANIFEST} missing: a build of {_shown(root)} is running or was killed ({kinds['building']})"
        return None, f"{MANIFEST} missing: the build of {_shown(root)} did not finish"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST} unreadable ({str(e).splitlines()[0]}): the build of {_shown(root)} did not finish"
    if not isinstance(m, dict) or m.get("complete") is not True or not isinstance(m.get("files"), dict):
        return None, f"{MANIFEST} has no completion marker: an unfinished build, or one older than complete markers"
    return m, ""


def _problem(root: Path, split: Optional[str]) -> Optional[str]:
    """Why ``root`` (or its ``split``) is not complete per its manifest: a file missing, of another
    size or not listed; None when it is."""
    m, why = _manifest(root)
    if m is None:
        return why
    prefix = ""
    if split is not None:
        if split not in m.get("splits", []):
            return f"the build of {_shown(root)} has no split {split!r}, only {', '.join(m.get('splits', []))}"
        prefix = split + "/"
    listed = {p: f["bytes"] for p, f in m["files"].items() if p.startswith(prefix)}
    found = _files(root / split, prefix) if split is not None else _files(root)
    for p in sorted(listed):
        if p not in found:
            return f"{p} missing"
        if found[p] != listed[p]:
            return f"{p} holds {found[p]} bytes, the manifest says {listed[p]}"
    extra = sorted(set(found) - set(listed))
    return f"{extra[0]} is not in the manifest" if extra else None


def require_complete(path: str) -> None:
    """ContractError (one line) unless ``path`` -- a data file or directory -- may be read. A build's
    output, or a split directory of one, must be complete per its manifest (files and sizes);
    inside a build's temporary or set-aside directory it never is. A directory with no manifest in
    it or its parent, and no build leftover beside either, is not a build's: it passes (generated or
    hand-made data)."""
    here = Path(os.path.abspath(path))
    if here.is_file():
        here = here.parent
    for root, split in ((here, None), (here.parent, here.name)):
        m = _LEFTOVER.fullmatch(root.name)
        if m:
            target = root.parent / m["name"]
            kind = "temporary" if m["kind"] == "building" else "set-aside previous"
            problem = f"{root.name} is the {kind} directory of a build of {_shown(target)}"
        elif (root / MANIFEST).exists() or leftovers(root):
            target, problem = root, _problem(root, split)
        else:
            continue
        if problem:
            raise ContractError(
                f"{path}: not a complete build ({problem}); rebuild it with python -m pinads_rec.data.build "
                f"... --out {_shown(target)}"
            )
        return


def verify(out_dir: str) -> str:
    """The build's fingerprint, after checking every file's sha256 against its manifest (the
    readers hash only the files they use); ContractError names the first file that differs."""
    root = Path(out_dir)
    problem = _problem(root, None)
    if problem:
        raise ContractError(f"{out_dir}: not a complete build ({problem})")
    m = json.loads((root / MANIFEST).read_text())
    for rel, f in sorted(m["files"].items()):
        if sha256(root / rel) != f["sha256"]:
            raise ContractError(changed(root / rel, root))
    if _fingerprint(m["files"]) != m.get("fingerprint"):
        raise ContractError(f"{root / MANIFEST}: its fingerprint does not match its file list")
    return m["fingerprint"]


def changed(path: Path, root: Path) -> str:
    """The one line saying that ``path``, a file of the build ``root``, is not the file it wrote."""
    return (
        f"{_shown(path)}: its sha256 differs from {MANIFEST}'s (the file changed after the build wrote it: disk, "
        f"copy or edit); rebuild with python -m pinads_rec.data.build ... --out {_shown(root)}, or restore the "
        f"file from a copy of that build"
    )


# (path, bytes, mtime, the manifest's sha256) of each file this process found unchanged: hashed
# once, again only when the file or its build changes.
_UNCHANGED: Set[Tuple[str, int, int, str]] = set()


def _listed(path: Path, manifests: Dict[Path, Optional[dict]]) -> Optional[Tuple[Path, str]]:
    """(the build's root, the sha256 its manifest lists) of ``path``: a file at a build's top or
    one directory down (a split's, the vocabularies'), as ``require_complete`` finds builds; None
    for a file no manifest lists."""
    for root in (path.parent, path.parent.parent):
        if root not in manifests:
            try:
                manifests[root] = json.loads((root / MANIFEST).read_text())
            except (OSError, ValueError):
                manifests[root] = None
        m = manifests[root]
        if m is not None:
            entry = m.get("files", {}).get(path.relative_to(root).as_posix()) if isinstance(m, dict) else None
            return (root, entry["sha256"]) if isinstance(entry, dict) and "sha256" in entry else None
    return None


def require_unchanged(paths: Iterable[str]) -> int:
    """ContractError (one line, ``changed``) unless each of ``paths`` that a build's manifest lists
    has the listed sha256: page checksums (data/page_checksums.py) guard the Parquet pages a reader
    decodes; this guards whole files, those written without page checksums too (DuckDB's
    vocabularies, builds made before them). Hashing costs about a second per GB, once per process.
    Returns how many of ``paths`` a manifest lists."""
    manifests: Dict[Path, Optional[dict]] = {}
    listed_count = 0
    for name in paths:
        path = Path(os.path.abspath(name))
        listed = _listed(path, manifests)
        if listed is None:
            continue
        listed_count += 1
        root, digest = listed
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, digest)
        if key in _UNCHANGED:
            continue
        if sha256(path) != digest:
            raise ContractError(changed(path, root))
        _UNCHANGED.add(key)
    return listed_count
