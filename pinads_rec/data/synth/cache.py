"""The data cache experiments and benchmarks share: a directory is reused when its ``summary.json``
was written with the same ``synth`` settings (``is_cached``), else generated (``ensure``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

from pinads_rec.config import ExperimentConfig, LongHistoryConfig, SynthConfig
from pinads_rec.data.synth.checks import check_synth_config
from pinads_rec.data.synth.writing import generate


def is_cached(s: SynthConfig, out_dir: str | Path, at_least: Sequence[str] = ()) -> bool:
    """Whether ``out_dir/summary.json`` was written with the settings ``s``: every field equal, except
    the fields named in ``at_least`` (e.g. ``train_requests``), where more than asked also serves."""
    try:
        old = json.loads((Path(out_dir) / "summary.json").read_text())["synth"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if isinstance(old, dict) and "long_history" not in old:  # written before the key existed: it was off
        old["long_history"] = dataclasses.asdict(LongHistoryConfig())
    if isinstance(old, dict) and "drift" not in old:  # written before synth.drift existed: a fixed world
        old["drift"] = None
    want = json.loads(json.dumps(dataclasses.asdict(s)))  # tuples as lists, as the summary holds them
    return all(old.get(k, -math.inf) >= v if k in at_least else k in old and old[k] == v for k, v in want.items())


def ensure(
    cfg: ExperimentConfig, out_dir: str | Path, at_least: Sequence[str] = (), echo=None, raw: bool = False
) -> bool:
    """Generates ``cfg.synth``'s data into ``out_dir`` (with ``raw``, its raw logs too: ``generate``)
    unless it is there already (``is_cached``); returns True when it generated. ``echo`` (e.g.
    ``print``) hears what was decided."""
    say = echo or (lambda _: None)
    check_synth_config(cfg.synth)  # refused here as generate refuses them, cached or not
    cached = is_cached(cfg.synth, out_dir, at_least)
    if cached and (not raw or "raw" in json.loads((Path(out_dir) / "summary.json").read_text())):
        say(f"data {out_dir}: reusing it (same synth settings)")
        return False
    d = cfg.synth.drift
    what = f"{d.days} days of {d.requests_per_day:,} requests" if d else f"{cfg.synth.train_requests:,} train requests"
    say(f"data {out_dir}: generating {what}")
    summary = generate(cfg, out_dir, raw=raw)
    say(f"data {out_dir}: generated in {summary['seconds']:.1f} s")
    return True
