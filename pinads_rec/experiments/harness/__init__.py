"""The harness experiments, benchmarks and tests share, one job a module:

- ``launch``: ``run_ranks`` / ``rank_results``, the one way code runs on several gloo ranks from
  Python (spawned processes, file rendezvous, a deadline, every failed rank's traceback), and the
  one launcher of ``pinads_rec/train.py`` of each kind: ``train_py`` (torchrun), ``torchx_train``;
- ``meters``: ``CpuMeter`` / ``wait_quiet`` (the machine is shared), ``rss_mib`` / ``peak_rss_mib``,
  another process's memory (``status_mib``), the ranks' peaks (``RankMemory``), a process tree's
  (``TreePeak``);
- ``finished_runs``: run reuse, its one owner: a finished run (``finished_run``), a run directory
  keyed by config and code (``keyed_run_dir``), a run's config against the one wanted
  (``comparable_config``, ``same_config``), the newest finished run of a config
  (``newest_finished_run``);
- ``provenance``: the code a report's runs ran (``code_version``, ``code_state``) and a digest of it
  that keys reusable runs (``source_digest``);
- ``timing``: the instrumented training loop over a ``Trainer`` (``measured_trainer``,
  ``timed_steps``, ``measure_training``).

The data cache experiments share is ``pinads_rec.data.synth.ensure``; the text tables they print,
``pinads_rec.text_table``.
"""

from pinads_rec.experiments.harness.launch import RanksFailed, quiet_library_logs, rank_results, run_ranks
from pinads_rec.experiments.harness.meters import CpuMeter, peak_rss_mib, rss_mib, wait_quiet
from pinads_rec.experiments.harness.timing import (
    PHASES,
    embedding_size,
    measure_training,
    measured_trainer,
    one_rank_step_ms,
    plan_summary,
    timed_steps,
)

__all__ = [
    "PHASES",
    "CpuMeter",
    "RanksFailed",
    "embedding_size",
    "measure_training",
    "one_rank_step_ms",
    "measured_trainer",
    "peak_rss_mib",
    "plan_summary",
    "quiet_library_logs",
    "rank_results",
    "rss_mib",
    "run_ranks",
    "timed_steps",
    "wait_quiet",
]
