"""docs/config.md is what pinads_rec/config_reference.py generates from config.py, and it covers
every key with a meaning."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

from pinads_rec import config, config_reference
from pinads_rec.config_reference import COMMAND, OUTPUT


def reference_rows() -> dict:
    """{key: {type, default, scope, meaning}} from docs/config.md's tables (cells split on bare |)."""
    rows = {}
    for line in OUTPUT.read_text().splitlines():
        if line.startswith("| `"):
            key, *cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[key.strip("`")] = dict(zip(("type", "default", "scope", "meaning"), cells))
    return rows


def leaf_keys(cls: type, path: str = ""):
    """Every key that holds a value rather than a section, walked here independently of the generator:
    a dataclass (optional or not) is entered, a list of them entered as ``key[]``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{path}.{f.name}" if path else f.name, hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from leaf_keys(typing.get_args(tp)[0], key + "[]")
        elif dataclasses.is_dataclass(tp):
            yield from leaf_keys(tp, key)
        else:
            yield key


def test_the_reference_is_up_to_date():
    problem = config_reference.difference(OUTPUT, config_reference.render())
    assert not problem, f"docs/config.md is out of date: run `{COMMAND}`\n{problem}"


def test_every_leaf_key_has_a_meaning():
    rows = reference_rows()
    keys = list(leaf_keys(config.ExperimentConfig))
    assert len(keys) > 150  # the walk found the config, not an empty class
    missing = [k for k in keys if k not in rows]
    assert not missing, f"keys absent from docs/config.md: {missing}"
    empty = [k for k in keys if not rows[k]["meaning"]]
    assert not empty, f"keys without a meaning (add a # comment above the field in config.py): {empty}"


def test_every_scope_names_a_key():
    rows = reference_rows()
    assert [k for k in config_reference.SCOPES if k not in rows] == []


def test_spot_checks():
    rows = reference_rows()
    batch = rows["data.batch_size"]
    assert "per rank" in batch["scope"] and "per rank" in batch["meaning"]
    assert batch["default"] == "`512`"
    assert rows["features.sparse[].pooling"]["type"] == '"sum" \\| "mean"'
    assert rows["model.precision.train"]["type"] == '"fp32" \\| "bf16" \\| "fp16"'
    assert rows["features.tables[].name"]["default"] == "required"
    assert rows["train.early_stop.mode"]["type"] == 'optional "max" \\| "min"'
    assert rows["build.side_tables[].key"]["type"] == "map str -> str"
    # A nested section's defaults come from the default instance, not its class.
    assert rows["model.two_tower.dcn.num_layers"]["default"] == "`1`"
    assert rows["model.dcn.num_layers"]["default"] == "`2`"
    assert rows["train.collective_timeout_s"]["scope"] == "seconds"


def test_meaning_is_the_comment_above_else_the_one_ending_the_line():
    comments, docs = config_reference._parse(
        'class A:\n    """Doc\n    string."""\n\n    # One\n    # two.\n    x: int = 1  # not this\n'
        '    y: str = "#"  # the trailing one\n    z: int = 0\n'
    )
    assert comments["A"] == {"x": "One two.", "y": "the trailing one", "z": ""}
    assert docs["A"] == "Doc string."
    long = "First sentence, e.g. this one. Then " + "x" * 300
    assert config_reference._summary(long) == "First sentence, e.g. this one."


def test_check_reports_the_section_that_differs(tmp_path):
    stale = tmp_path / "config.md"
    text = config_reference.render()
    stale.write_text(text.replace("| `data.batch_size` |", "| `data.batch_rows` |"))
    problem = config_reference.difference(stale, text)
    assert COMMAND in problem and "## `data`" in problem
    assert config_reference.difference(stale, stale.read_text()) == ""
