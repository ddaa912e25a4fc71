"""Run reuse, the one owner: whether a training run in a directory finished, whether it ran the
config wanted and the code of today, so an experiment keeps it instead of training again (an
interrupted experiment resuming, another one needing the same model, a report rewritten).

- ``finished_run``: the run's log once it wrote its final evaluation (else None);
- ``keyed_run_dir``: ``<runs>/<hash of a key and of the package's sources>``: a run trained by
  other code is never found there (``provenance.source_digest``);
- ``comparable_config`` / ``same_config``: a run's ``config.json`` against the config wanted, less
  what does not change the model (where the run sits, the plan a resume recorded, the step cap);
- ``newest_finished_run``: the newest finished run of a config among many, whatever code made it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from pinads_rec import config
from pinads_rec.experiments.harness.provenance import source_digest
from pinads_rec.training.run_log import CONFIG_FILE, METRICS_FILE, RunRecords, read_run_log

# Not what a run is: a resumed run records the checkpoint's plan as its plan_file, an evaluation of
# a trained model its last step as max_steps, and the run directory is where it is.
NOT_COMPARED = ("plan_file", "max_steps", "run_dir")


def finished_run(run_dir: Path) -> Optional[RunRecords]:
    """``run_dir``'s log (``training.run_log``) when the run wrote its final evaluation, else None."""
    if not (Path(run_dir) / METRICS_FILE).exists():
        return None
    log = read_run_log(run_dir)
    return log if log.summary is not None else None


def keyed_run_dir(runs: Path, *key: object) -> Path:
    """``runs/<hash of the key's parts (JSON) and of the code>``: one directory per run and code version."""
    text = json.dumps([*key, source_digest()], sort_keys=True, default=str)
    return Path(runs) / hashlib.sha1(text.encode()).hexdigest()[:12]


def comparable_config(cfg: config.ExperimentConfig) -> dict:
    """``cfg`` as runs are matched: its JSON form (as ``config.json`` holds it) less ``NOT_COMPARED``."""
    return _comparable(config.to_dict(cfg))


def _comparable(c: dict) -> dict:
    c = json.loads(json.dumps(c))  # as config.json holds it (tuples as lists)
    return dict(c, train={k: v for k, v in c["train"].items() if k not in NOT_COMPARED})


def same_config(run_dir: Path, wanted: dict) -> bool:
    """Whether ``run_dir`` recorded the config ``wanted`` (a ``comparable_config``)."""
    saved = Path(run_dir) / CONFIG_FILE
    # A run from before a config key was added recorded no value for it: it ran the default.
    return saved.exists() and _comparable(config.saved_as_today(json.loads(saved.read_text()))) == wanted


def newest_finished_run(runs: Path, wanted: dict) -> Optional[Path]:
    """The newest finished run directly under ``runs`` of the config ``wanted`` (a
    ``comparable_config``), whatever code trained it; None when there is none."""
    found = [d.parent for d in Path(runs).glob(f"*/{CONFIG_FILE}") if same_config(d.parent, wanted)]
    found = [d for d in found if finished_run(d) is not None]  # the log parsed only where the config matches
    return max(found, key=lambda d: (d / METRICS_FILE).stat().st_mtime) if found else None
