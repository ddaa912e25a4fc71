"""The reference fitted when a run ends: a trainer hook listed before those that print and write the
summary (train.py's ``default_hooks``), so the final table and metrics.jsonl carry it."""

from __future__ import annotations

import logging

from pinads_rec.reference.fit import reference_summary
from pinads_rec.training.hooks import Hook
from pinads_rec.training.trainer import Trainer

log = logging.getLogger("pinads_rec.reference")


class ReferenceBaseline(Hook):
    """On rank 0, after the final evaluation: ``summary["reference"]``, the reference fitted on the
    run's training split and scored on its eval split (reference.enabled; pinads_rec.reference.fit).
    The other ranks are done by then and leave; a reference that cannot be fitted is reported, and
    the run's own result stands."""

    def on_evaluation(self, trainer: Trainer, summary: dict) -> None:
        settings = trainer.cfg.reference
        if not (settings.enabled and trainer.env.is_main):
            return
        log.info(
            "fitting the reference (LightGBM, up to %d training rows; reference.enabled: false skips it)",
            settings.max_train_rows,
        )
        summary["reference"] = reference_summary(trainer.cfg)
