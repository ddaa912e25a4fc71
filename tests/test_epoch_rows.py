"""The rows an epoch trains, on 2 gloo ranks: metrics.jsonl's epoch record counts exactly the valid
rows of the batches the ranks trained (a worker's last partial batch dropped; the ranks ending
together at the shortest rank's last batch), within data/loader/dataset.py's bound of the training
split's rows; an epoch cut short by train.max_steps counts only its trained steps, and resumed from
its checkpoint counts the whole epoch. Plus, without a launch: the bound with 2 loader workers a
rank, and the console's epoch line.

One 2-process launch (``harness.rank_results``) trains the runs and returns, per rank, the valid
rows of each batch its loader yields per epoch, recomputed with the loader alone. The ranks read
their row groups themselves (data.num_workers 0, as the other training tests): a rank forking
loader workers at each epoch can deadlock on Python 3.11 (cpython#112275, a lock held at fork)."""

import pytest
from conftest import load_tiny, read_rows

from pinads_rec.experiments.harness import rank_results
from pinads_rec.training.console import epoch_line
from pinads_rec.training.run_log import read_run_log

FULL = ["train.epochs=2", "train.log_every=5", "model.calibration=none"]
# Cut short in epoch 0 (about 19 steps on the tiny data), then resumed to the epoch's end.
CUT = ["train.max_steps=5", "train.checkpoint_every=5", "model.calibration=none"]
RESUMED = ["train.max_steps=0", "train.epochs=1", "model.calibration=none"]


def batches_of(data_dir, rank, world_size, workers, epoch):
    """The valid rows of each batch of the rank's training loader in ``epoch``, and its rows dealt."""
    from pinads_rec.data.loader.dataset import LoaderSettings, make_loader

    settings = LoaderSettings.of(load_tiny(data_dir, [f"data.num_workers={workers}"]))
    loader = make_loader(settings.data.train_dir, settings, rank, world_size, part="train", epoch=epoch)
    return {"valid": [int(b.valid.sum()) for b in loader], "dealt": loader.dataset.rows_dealt(rank, workers)}


def _runs(data_dir, run_root):
    """On each rank: the three runs, then this rank's batches of each epoch as its loader yields them."""
    from pinads_rec import parallel
    from pinads_rec.training.run_log import RunLog
    from pinads_rec.training.trainer import Trainer

    env = parallel.init_distributed()
    Trainer(load_tiny(data_dir, FULL + [f"train.run_dir={run_root}/full"]), env, hooks=[RunLog()]).run()
    for extra in (CUT, RESUMED):
        Trainer(load_tiny(data_dir, extra + [f"train.run_dir={run_root}/cut"]), env, hooks=[RunLog()]).run()
    return {str(epoch): batches_of(data_dir, env.rank, env.world_size, 0, epoch) for epoch in (0, 1)}


@pytest.fixture(scope="module")
def epoch_runs(tiny_data, tmp_path_factory):
    """(per rank: {"<workers>/<epoch>": {"valid": [rows a batch], "dealt": rows}}, the runs' root,
    the data directory, the tiny config)."""
    cfg, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("epoch_rows")
    ranks = rank_results(_runs, 2, str(tmp / "work"), str(data_dir), str(tmp / "runs"), timeout_s=600)
    return ranks, tmp / "runs", data_dir, cfg


def expected(ranks, key, steps=None):
    """Per rank, the valid rows of its first ``steps`` batches (None: as many as the rank with the
    fewest batches has, where an epoch ends on every rank)."""
    if steps is None:
        steps = min(len(r[key]["valid"]) for r in ranks)
    return [sum(r[key]["valid"][:steps]) for r in ranks]


def assert_within_bound(ranks, key, batch_size, workers):
    """Each worker drops less than a batch, and the rows the ranks leave past the shortest rank's
    last batch are within data/loader/dataset.py's bound."""
    dealt = [r[key]["dealt"] for r in ranks]
    for r, d in zip(ranks, dealt):
        assert 0 <= d - sum(r[key]["valid"]) < max(workers, 1) * batch_size, "a worker drops less than a batch"
    trained = expected(ranks, key)
    left = sum(dealt) - sum(trained)
    bound = sum(d - min(dealt) for d in dealt) + len(ranks) * max(workers, 1) * (batch_size - 1)
    assert 0 <= left <= bound, (key, dealt, trained)
    return left


@pytest.mark.slow
def test_an_epoch_record_counts_the_rows_the_ranks_trained(epoch_runs):
    ranks, runs, data_dir, cfg = epoch_runs
    log = read_run_log(runs / "full")
    assert [r["epoch"] for r in log.epochs] == [0, 1] and all(r["complete"] for r in log.epochs)
    assert log.steps and all("loss" in r for r in log.steps), "epoch records are not step records"
    split_rows = read_rows(f"{data_dir}/train").num_rows
    steps = 0
    for record in log.epochs:
        key = str(record["epoch"])
        assert record["rows_trained_per_rank"] == expected(ranks, key)
        assert record["rows_trained"] == sum(expected(ranks, key))
        assert record["rows_dealt_per_rank"] == [r[key]["dealt"] for r in ranks]
        assert record["train_split_rows"] == split_rows == sum(record["rows_dealt_per_rank"])
        left = assert_within_bound(ranks, key, cfg.data.batch_size, 0)
        assert record["rows_trained"] == split_rows - left
        steps += min(len(r[key]["valid"]) for r in ranks)
        assert record["step"] == steps


@pytest.mark.slow
def test_an_epoch_cut_short_counts_its_steps_and_its_resume_the_whole_epoch(epoch_runs):
    ranks, runs, _, _ = epoch_runs
    cut, resumed = read_run_log(runs / "cut").epochs
    assert (cut["epoch"], cut["step"], cut["complete"]) == (0, 5, False)
    assert cut["rows_trained_per_rank"] == expected(ranks, "0", steps=5)
    assert (resumed["epoch"], resumed["complete"]) == (0, True)
    assert resumed["rows_trained_per_rank"] == expected(ranks, "0")


@pytest.mark.slow
def test_with_loader_workers_the_rows_left_out_are_within_the_bound(tiny_data):
    cfg, data_dir = tiny_data
    for epoch in (0, 1):
        ranks = [{"e": batches_of(data_dir, rank, 2, 2, epoch)} for rank in range(2)]
        assert_within_bound(ranks, "e", cfg.data.batch_size, 2)


RECORD = {
    "epoch": 0,
    "step": 15,
    "rows_trained": 3805,
    "rows_trained_per_rank": [1920, 1885],
    "train_split_rows": 4791,
    "rows_dealt_per_rank": [2906, 1885],
    "complete": True,
}


def test_the_console_line_of_an_epoch():
    assert epoch_line(RECORD) == (
        "epoch 0: trained 3,805 of 4,791 rows (79.4%; rows left: each loader worker's last partial batch, "
        "and those past the step where the rank with the fewest batches ran out; trained / dealt per rank: "
        "1,920 / 2,906, 1,885 / 1,885)"
    )
    every = dict(RECORD, rows_trained=4791, rows_trained_per_rank=[2906, 1885])
    assert epoch_line(every) == "epoch 0: trained 4,791 of 4,791 rows (100.0%)"
    cut = dict(RECORD, step=5, rows_trained=1280, rows_trained_per_rank=[640, 640], complete=False)
    assert epoch_line(cut) == "epoch 0 (cut short at step 5): trained 1,280 of 4,791 rows (26.7%)"
    assert epoch_line(RECORD, "ad_type") == (
        "epoch 0: trained 3,805 of 4,791 rows (before data.row_filter on ad_type) (79.4%)"
    )
