"""The config reference, ``docs/config.md``, generated from the dataclasses ``config/schema.py``
composes (``ExperimentConfig``), wherever each is declared.

Keys, types and defaults come from the dataclasses (a nested section's defaults from the default
instance, so ``model.two_tower.dcn`` shows its own, not ``model.dcn``'s); each key's meaning from
the ``#`` comment lines right above its field in the source of the class that declares it
(``schema.py``, ``modules/encoders.py``, ``data/synth_settings.py``...; else the comment ending its
line), each section's from its class docstring. ``python -m pinads_rec.config_reference`` writes the file;
``--check`` exits 1 and says what differs when the file is out of date (as
``tests/test_config_reference.py`` does).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import io
import re
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, NamedTuple, Optional, Tuple

import yaml

from pinads_rec import config

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "python -m pinads_rec.config_reference"
MAX_MEANING = 200  # characters: one line of a table, the rest is in the declaring source

# Unit and scope where a number means little without them. Per rank: in each training process (the
# global value is that x the world size; docs/performance.md quotes batches as "rows per rank per
# step"); global: over all ranks together. Keys ending in _s are seconds. The test checks that every
# key here still exists.
SCOPES = {
    "data.batch_size": "rows per rank per step",
    "data.shuffle_buffer_rows": "rows, per loader worker of each rank",
    "data.num_workers": "processes per rank",
    "data.prefetch_factor": "batches per loader worker",
    "data.max_unique_users_per_batch": "requests per batch, per rank",
    "data.calibration_holdout": "fraction of the training row groups (global)",
    "train.epochs": "global: the ranks share each pass",
    "train.max_steps": "steps; global (every rank takes every step)",
    "train.warmup_steps": "steps",
    "train.checkpoint_every": "steps",
    "train.log_every": "steps",
    "train.profile_steps": "steps, traced on every rank",
    "train.eval_every.steps": "steps",
    "features.tables[].num_embeddings": "rows of the whole table (sharded over ranks)",
    "features.sequence_groups[].max_length": "events per request",
    "synth.train_requests": "requests in the split",
    "synth.eval_requests": "requests in the split",
    "synth.calibration_requests": "requests in the split",
    "synth.row_group_size": "rows per row group",
    "synth.long_history.burst_days": "days",
    "build.requests_per_row_group": "requests",
    "build.requests_per_file": "requests",
}


class Row(NamedTuple):
    key: str
    type: str
    default: str
    scope: str
    meaning: str


class Section(NamedTuple):
    path: str
    doc: str
    rows: List[Row]


HEADER = f"""# Config reference

Every key of the experiment config (composed by `pinads_rec/config/schema.py`): its type, default,
unit or scope and meaning. Generated from the dataclasses and their comments by
`{COMMAND}`: do not edit by hand (edit the comments where the key is declared and
rerun it; `tests/test_config_reference.py` fails when this file is out of date, and `--check` says
what differs).

A config file states only what differs from these defaults, or, with `extends: <file>` (a path
relative to it), from that file: mappings merged, lists and values replaced
(`configs/two_tower.yaml` extends `configs/demo.yaml`). The key `a.b.c` is, in YAML,
`a: {{b: {{c: value}}}}` (nested mappings), and on a command line `--set a.b.c=value`, the value read
as YAML (`--set model.sequence.encoders=[transformer,din]`, `--set data.row_filter=null`).

- A type that links to a section is a mapping with that section's keys.
- `[]` in a key: a list of such mappings (`features.tables[].name` is the `name` of each element of
  `features.tables`). On a command line an element is picked by its `name` or index:
  `--set features.sequence_groups.pins.max_length=1000` (or `features.sequence_groups.0.max_length=1000`).
- `map str -> ...`: a mapping of any names to values of that type. `model.sequence_groups.<group>`
  takes `model.sequence`'s keys for one group; the keys it leaves out are `model.sequence`'s.
- `required`: the key has no default and must be given (in each list element). Those of
  `config.REQUIRED` are checked where they are needed: `features.surfaces` and `features.tasks` on
  every config, a path by the tool that reads it (its meaning says which; the others load a config
  without it).
- Unit / scope: per rank means in each training process (the global value is that times the world
  size); global means over all ranks together.
"""


def _parse(source: str) -> Tuple[Dict[str, Dict[str, str]], Dict[str, str]]:
    """({class: {field: comment}}, {class: docstring}) from a module's source. A field's comment is
    the ``#`` lines right above it, joined, else the comment ending its line (found by tokenize, so a
    ``#`` inside a string is not one)."""
    lines = source.splitlines()
    trailing = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1].lstrip().startswith("#")
    }
    comments, docs = {}, {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = " ".join((ast.get_docstring(node) or "").split())
        fields = comments[node.name] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, n = [], stmt.lineno - 1  # n: the 1-based line above the field
                while n >= 1 and lines[n - 1].lstrip().startswith("#"):
                    above.insert(0, lines[n - 1].lstrip()[1:].strip())
                    n -= 1
                fields[stmt.target.id] = " ".join(above) or trailing.get(stmt.lineno, "")
    return comments, docs


def _summary(text: str) -> str:
    """The whole text if it fits a table cell, else its first sentence (cut if even that is long)."""
    if len(text) <= MAX_MEANING:
        return text
    end = re.search(r"[.!?](?=\s+[A-Z])", text)  # "e.g. the" is no sentence end
    first = text[: end.end()] if end else text
    return first if len(first) <= MAX_MEANING else first[:MAX_MEANING].rsplit(" ", 1)[0] + " ..."


def _without_none(tp: Any) -> Tuple[Any, bool]:
    """(X, True) for Optional[X], else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _section_class(tp: Any) -> Tuple[Optional[type], bool]:
    """(dataclass, is_list) when a field holds its own section: X, Optional[X] or List[X]."""
    tp, _ = _without_none(tp)
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return (item, True) if dataclasses.is_dataclass(item) else (None, False)
    return (tp, False) if dataclasses.is_dataclass(tp) else (None, False)


def _anchor(path: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but - and _ dropped."""
    return "#" + re.sub(r"[^a-z0-9_ -]", "", path.lower()).replace(" ", "-")


def _type(tp: Any, link: Optional[str]) -> str:
    """``int``, ``list[str]``, ``"sum" | "mean"``, ``optional str``, ``map str -> str``; a dataclass is
    a link to the section ``link`` that lists its keys."""
    tp, optional = _without_none(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if optional:
        return "optional " + _type(tp, link)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin is list:
        item = _type(args[0], link)
        return f"list of {item}" if dataclasses.is_dataclass(args[0]) else f"list[{item}]"
    if origin is dict:
        return f"map {_type(args[0], link)} -> {_type(args[1], link)}"
    if dataclasses.is_dataclass(tp):
        return f"[`{link}`]({_anchor(link)})"
    return tp.__name__


def _default(f: dataclasses.Field, obj: Any) -> str:
    """The default as YAML writes it: from ``obj`` (the default instance) where there is one, else the
    field's own; ``required`` without either."""
    if obj is not None:
        value = getattr(obj, f.name)
    elif f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "see section"
    if isinstance(value, list):  # a list of sections' default entries, as their keys
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return "`" + text.removesuffix("...\n").strip() + "`"  # a bare scalar ends its document with "..."


def _scope(key: str) -> str:
    return SCOPES.get(key) or ("seconds" if key.endswith("_s") else "")


def sections() -> List[Section]:
    """Every section of ExperimentConfig, each followed by the sections nested in it."""
    parsed: Dict[str, Tuple[Dict[str, Dict[str, str]], Dict[str, str]]] = {}  # module -> _parse of its source
    first_path: Dict[type, str] = {}  # where a class's keys are listed: a map's values link there
    out: List[Section] = []

    def source_of(cls: type) -> Tuple[Dict[str, Dict[str, str]], Dict[str, str]]:
        if cls.__module__ not in parsed:
            parsed[cls.__module__] = _parse(Path(sys.modules[cls.__module__].__file__).read_text())
        return parsed[cls.__module__]

    def doc(cls: type) -> str:
        return source_of(cls)[1].get(cls.__name__, "")

    def comment(cls: type, name: str) -> str:
        # An inherited field's comment is in the class that declares it, maybe in another module.
        return next(
            source_of(c)[0][c.__name__][name] for c in cls.__mro__ if name in source_of(c)[0].get(c.__name__, {})
        )

    def walk(cls: type, path: str, obj: Any) -> None:
        first_path.setdefault(cls, path)
        section = Section(path, doc(cls), [])
        out.append(section)  # before the nested sections walk() adds below
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, tp = f"{path}.{f.name}", hints[f.name]
            sub, is_list = _section_class(tp)
            meaning = comment(cls, f.name)
            if sub is not None:
                link = key + "[]" if is_list else key
                child = getattr(obj, f.name) if obj is not None and not is_list else None
                walk(sub, link, child)
                meaning = meaning or doc(sub)
            else:
                values = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
                link = first_path[values[0]] if values else None  # model.sequence_groups -> model.sequence
            if key in config.REQUIRED:  # its None or [] is a placeholder the config must replace
                typ, default = _type(_without_none(tp)[0], link), "required"
            else:
                typ, default = _type(tp, link), _default(f, obj)
            section.rows.append(Row(key, typ, default, _scope(key), _summary(meaning)))

    defaults = config.ExperimentConfig()
    for f in dataclasses.fields(config.ExperimentConfig):
        value = getattr(defaults, f.name)
        walk(type(value), f.name, value)
    return out


def _markdown(text: str) -> str:
    """Docstring/comment text as Markdown: rst ``code`` as `code`, <placeholders> kept visible."""
    parts = re.split(r"(`[^`]*`)", text.replace("``", "`"))
    return "".join(p if p.startswith("`") else p.replace("<", "\\<") for p in parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell, even inside `code`


def render() -> str:
    parts = [HEADER]
    for s in sections():
        parts.append(f"{'##' if '.' not in s.path else '###'} `{s.path}`\n")
        if s.doc:
            parts.append(_markdown(s.doc) + "\n")
        parts.append("| key | type | default | unit / scope | meaning |\n|---|---|---|---|---|")
        for r in s.rows:
            parts.append(
                f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {r.scope} | {_cell(_markdown(r.meaning))} |"
            )
        parts.append("")
    return "\n".join(parts)


def _parts(text: str) -> Dict[str, str]:
    """The file cut at its headings: {heading line: its text}."""
    chunks = re.split(r"(?m)^(?=#{1,3} )", text)
    return {c.splitlines()[0]: c for c in chunks if c}


def difference(path: Path, text: str) -> str:
    """'' when ``path`` holds ``text``, else what differs, for a person: the sections, then a diff."""
    old = path.read_text() if path.exists() else ""
    if old == text:
        return ""
    before, after = _parts(old), _parts(text)
    changed = [h for h in {**before, **after} if before.get(h) != after.get(h)]
    diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=1))
    return "\n".join(
        [f"{path} is out of date: run `{COMMAND}`", "sections that differ: " + ", ".join(changed)]
        + diff[:60]
        + (["..."] if len(diff) > 60 else [])
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=f"Write {OUTPUT.name} from the config's dataclasses.")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {OUTPUT} is not what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        problem = difference(OUTPUT, text)
        print(problem or f"{OUTPUT} is up to date")
        return 1 if problem else 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
