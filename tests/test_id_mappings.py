"""The three ways to map the ads that keep arriving (pinads_rec/experiments/id_mappings.py), on a
tiny drifting world: the vocabulary fitted once on the first day's build and applied to every later
day, the hashed and managed tables on the same generated days, and the comparison's report."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import rows_of
from test_continuous import TINY_DRIFT

from pinads_rec.experiments.continuous import VOCABULARY_FIT
from pinads_rec.experiments.continuous_report import metric_value
from pinads_rec.experiments.id_mappings import ID_END, ID_START, VARIANTS, report, run, summary, write_report

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "continuous_managed.yaml")
SMALL = TINY_DRIFT + [
    "synth.drift.days=3",
    "features.tables.item.num_embeddings=600",
    "features.tables.item.managed_collision.eviction_interval=5",  # rounds within a tiny day's ~25 steps
]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("id_mappings")
    return out, run(CONFIG, SMALL, out, ranks=1)


def test_every_variant_trains_and_scores_each_day_on_the_same_days(compared):
    out, results = compared
    assert set(results) == set(VARIANTS)
    for name, rows in results.items():
        assert [r["day"] for r in rows] == [0, 1], name
        ev = rows[1]["eval"]
        assert metric_value(ev["new"], "examples") > 0 and metric_value(ev["recent"], "examples") > 0, name
        assert metric_value(ev["recent"], "examples") + metric_value(ev["older"], "examples") == metric_value(
            ev["old"], "examples"
        )
    # The same rows everywhere: the hashed and managed loops read the vocabulary loop's generated days.
    examples = {name: metric_value(rows[1]["eval"]["all"], "examples") for name, rows in results.items()}
    assert len(set(examples.values())) == 1
    # ... and each trains on about as many: the built days' row groups are the generator's size, so
    # the calibration holdout (the latest row groups) takes about the same share (not the same rows:
    # the generator cuts its groups by rows, the build by requests).
    trained = [rows[1]["rows_trained"] for rows in results.values()]
    assert max(trained) <= 1.05 * min(trained), trained
    assert (out / "hashed" / "data").resolve() == (out / "vocabulary" / "data").resolve()


def test_the_vocabulary_is_fitted_once_on_the_first_day_and_maps_every_later_day(compared):
    out, _ = compared
    fitted = out / "vocabulary" / "built" / VOCABULARY_FIT
    kept = np.array([int(k) for k in pq.read_table(fitted / "vocabularies" / "item.parquet").column("raw").to_pylist()])
    (last,) = sorted((out / "vocabulary" / "built" / "days").iterdir())[-1:]
    generated = out / "vocabulary" / "data" / "days" / last.name
    built = pa.concat_tables(rows_of(pq.read_table(p)) for p in sorted(last.rglob("*.parquet")))
    raw = pa.concat_tables(rows_of(pq.read_table(p)) for p in sorted(generated.rglob("*.parquet")))
    ids, raw_ids = built.column("item_id").to_numpy(), raw.column("item_id").to_numpy()
    # An ad the fitted day never showed is out of vocabulary (0); the ones it kept have their index.
    later = ~np.isin(raw_ids, kept)
    assert later.any() and (ids[later] == 0).all() and (ids[~later] > 0).all()
    assert len(kept) <= 600 - 1  # at most the table's rows less the unknown bucket


def test_the_report_tabulates_each_variant_and_the_differences(compared, tmp_path):
    _, results = compared
    s = summary(results)
    assert set(s) == set(VARIANTS) and all(v["examples_per_s"] > 0 for v in s.values())
    text = report(results, CONFIG, SMALL, ranks=1)
    assert "| managed |" in text and "managed minus hashed: all" in text and "managed minus vocabulary" in text
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{ID_START}\nstale\n{ID_END}\noutro\n")
    write_report(text, page)
    written = page.read_text()
    assert written.startswith("intro\n") and written.endswith("outro\n") and "stale" not in written
