"""Third-party notices the project silences: each one exactly (one message, from one logger or of one
warning category) and only around the call that raises it -- never a blanket filter, so any other
warning of the same library still reaches the user. Every caller says why its message does not
apply; the list of them, with the measurements, is in docs/reliability.md ("A quiet start").
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Iterator, Type


class DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix``; lets the rest through."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def without_warning(message: str, category: Type[Warning]) -> Iterator[None]:
    """The enclosed calls raise no ``category`` warning whose text starts with ``message``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield


@contextlib.contextmanager
def without_log_message(logger: str, prefix: str) -> Iterator[None]:
    """The enclosed calls log no record on ``logger`` whose message starts with ``prefix``."""
    f = DropMessage(prefix)
    logging.getLogger(logger).addFilter(f)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(f)


def drop_log_message(logger: str, prefix: str) -> None:
    """For the whole process: ``logger`` logs no record whose message starts with ``prefix``. For a
    notice raised deep inside a library on a path the project cannot enclose (idempotent)."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, DropMessage) and f.prefix == prefix for f in target.filters):
        target.addFilter(DropMessage(prefix))
