"""pinads_rec.library_notices: a silenced third-party notice is exactly one message, so everything
else the same library (or logger, or warning category) says still reaches the user."""

import logging
import warnings

from pinads_rec.library_notices import drop_log_message, without_log_message, without_warning


def test_without_warning_drops_that_message_only_and_only_inside():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with without_warning("`broadcast_buffers` is deprecated", FutureWarning):
            warnings.warn("`broadcast_buffers` is deprecated. Use ...", FutureWarning, stacklevel=1)
            warnings.warn("`broadcast_buffers` is deprecated. Use ...", UserWarning, stacklevel=1)  # another category
            warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("`broadcast_buffers` is deprecated. Use ...", FutureWarning, stacklevel=1)  # outside the block
    assert [(type(w.message).__name__, str(w.message)) for w in caught] == [
        ("UserWarning", "`broadcast_buffers` is deprecated. Use ..."),
        ("FutureWarning", "something else is deprecated"),
        ("FutureWarning", "`broadcast_buffers` is deprecated. Use ..."),
    ]


def test_without_warning_takes_the_message_literally():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with without_warning("a.b (c)", FutureWarning):
            warnings.warn("aXb (c)", FutureWarning, stacklevel=1)  # "." is not a wildcard
    assert [str(w.message) for w in caught] == ["aXb (c)"]


def test_log_messages_are_dropped_by_logger_and_prefix(caplog):
    name = "pinads_test.library_notices"
    with caplog.at_level(logging.WARNING, logger=name):
        with without_log_message(name, "The topology was constructed directly"):
            logging.getLogger(name).warning("The topology was constructed directly rather than ...")
            logging.getLogger(name).warning("another warning")
            logging.getLogger(name + ".child").warning("The topology was constructed directly by a child")
        logging.getLogger(name).warning("The topology was constructed directly, after the block")
        drop_log_message(name, "is_fx_tracing will return true")
        drop_log_message(name, "is_fx_tracing will return true")  # idempotent
        logging.getLogger(name).warning("is_fx_tracing will return true for both ...")
        logging.getLogger(name).warning("is_fx_tracing is fine")
    assert len(logging.getLogger(name).filters) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "another warning",
        "The topology was constructed directly by a child",
        "The topology was constructed directly, after the block",
        "is_fx_tracing is fine",
    ]
