"""Command-line argument types every command shares: a user's mistake in a count or an output path
is refused by argparse before any work starts (one line naming the flag, exit 2), never after the
work by a traceback from deep inside a library."""

from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """An integer of at least 1 (thread, worker, batch counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count: give 1 or more")
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
