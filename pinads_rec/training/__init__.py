"""Training: the Trainer (set-up, and a loop of components: ``trainer.py``), the training task it
shards (``task.py``), the epochs' batches and rows (``epochs.py``), the step meter
(``step_meter.py``), evaluations during training and the best (``validator.py``), what it evaluates
(``evaluation.py``), where a run starts and when it saves (``checkpointer.py``) in sharded
checkpoints (``checkpoint.py``), a collective's errors named (``collectives.py``); the hooks
(``hooks.py``): the run's record on disk (``run_log.py``), the console report (``console.py``),
TensorBoard (``tensorboard_writer.py``), the profiler (``profiler.py``)."""
