"""Command-line argument types every command shares: a user's mistake in a count, an input or an
output path is refused by argparse before any work starts (one line naming the flag, exit 2), never
after the work by a traceback from deep inside a library; ``config_paths`` holds the paths a config
names to the same rule (docs/reliability.md, "One rule for every command line")."""

from __future__ import annotations

import argparse
import math
import os
from typing import Sequence


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """An integer of at least 1 (thread, worker, batch counts)."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count: give 1 or more")
    return value


def non_negative_int(text: str) -> int:
    """An integer of 0 or more (a count where 0 means none: DataLoader workers, extra steps)."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a count: give 0 or more")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds, more than 0 (timeouts, deadlines)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a duration: give seconds above 0")
    return value


def _check_parent(path: str) -> None:
    """The nearest existing ancestor of ``path`` must be a directory (the rest is created)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{path}: {parent} is a file, not a directory")


def output_file(path: str) -> str:
    """A file to write: not an existing directory, under a directory (or under one to be created).
    "-" (stdout) passes."""
    if path == "-":
        return path
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"{path} is a directory: give a file name (e.g. {path.rstrip('/')}/out.parquet)"
        )
    _check_parent(path)
    return path


def output_dir(path: str) -> str:
    """A directory to write: not an existing file, under a directory (or under one to be created)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a file, not a directory")
    _check_parent(path)
    return path


def existing_dir(path: str) -> str:
    """A directory to read (raw logs, a run, a build): it must be there, and be a directory. A URI
    (``s3a://``, ``hdfs://``) passes: the engine that reads it says what is wrong there."""
    existing_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a file, not a directory")
    return path


def existing_path(path: str) -> str:
    """A file or directory to read (Parquet data): it must be there. A URI passes, as above."""
    from pinads_rec.data.raw_sources import is_remote

    if not is_remote(path) and not os.path.exists(path):
        raise argparse.ArgumentTypeError(f"{path} does not exist")
    return path


def config_paths(cfg, inputs: Sequence[str] = (), outputs: Sequence[str] = ()) -> None:
    """The paths a command's config names, checked as the flags above before any work: each of
    ``inputs`` (dotted keys, e.g. ``data.train_dir``) must exist, each of ``outputs`` (directories)
    must be creatable. A ConfigError names the key; an unset key passes (``config.require`` asks for
    the keys a command cannot do without)."""
    from pinads_rec.config import ConfigError

    for key, check in [(k, existing_path) for k in inputs] + [(k, output_dir) for k in outputs]:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not value:
            continue
        try:
            check(str(value))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{key}: {e}") from None
