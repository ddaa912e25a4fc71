"""Training: the Trainer (set-up, step, loop, calibration, evaluation) and its hooks
(``trainer.py``), the run's record on disk (``run_log.py``), the console report (``console.py``)
and sharded checkpoints (``checkpoint.py``)."""
