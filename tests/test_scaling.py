"""The scaling experiment (pinads_rec.experiments.scaling*): sweep planning and per-run configs and
the collectives' profile (fast), then one tiny real sweep (1 and 2 gloo ranks, 3 warmup + 3 measured
steps, planner projection for 8 and 16 GPUs) through the CLI, run once for the checks after it."""

import contextlib
import csv
import io
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from conftest import DEMO, load_tiny, tiny_overrides

from pinads_rec import config
from pinads_rec.experiments import collectives, scaling
from pinads_rec.experiments import scaling_sweep as sweep

BRIEF_SWEEPS = ["ranks=1,2", "batch_size=256,512,1024", "sequence_length=25,50,100", "table_rows=10000,100000,1000000"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Measured columns every run fills with a positive number.
POSITIVE = (
    "examples_per_s examples_per_s_per_rank step_ms data_ms forward_ms backward_ms optimizer_ms peak_rss_mib "
    "base_rss_mib ids_per_example embedding_rows wall_s"
).split()


def demo():
    return config.load(DEMO)


def test_parse_sweeps():
    assert sweep.parse_sweeps(["ranks=1,2", "batch_size=256, 512", "ranks=2,4"]) == {
        "ranks": [1, 2, 4],
        "batch_size": [256, 512],
    }
    assert sweep.parse_sweeps(["table_rows=1_000_000"]) == {"table_rows": [1000000]}
    for bad, words in (
        ("ranks", "NAME=v1"),
        ("gpus=8", "unknown dimension"),
        ("ranks=0,1", "> 0"),
        ("batch_size=a", "integers"),
        ("ranks=", "> 0"),
    ):
        with pytest.raises(ValueError, match=words):
            sweep.parse_sweeps([bad])


def test_one_at_a_time_around_the_base_point():
    cfg = demo()
    sweeps = sweep.parse_sweeps(BRIEF_SWEEPS)
    tables = sweep.scaled_table_names(cfg, None)
    assert tables == ["user", "item"]
    base = sweep.base_point(cfg, sweeps, tables)
    # The config's batch (512) and length (100) are listed; its 50000-row tables are not: first value.
    assert base == sweep.Point(ranks=1, batch_size=512, sequence_length=100, table_rows=10000)
    points = sweep.sweep_points(sweeps, base)
    assert points[0] == base and len(points) == len(set(points)) == 8  # base once + 7 variations
    for p in points[1:]:
        assert sum(getattr(p, d) != getattr(base, d) for d in sweep.DIMENSIONS) == 1
    assert len(sweep.sweep_points(sweeps, base, grid=True)) == 2 * 3 * 3 * 3
    moved = sweep.base_point(cfg, sweeps, tables, {"ranks": 2, "batch_size": 1024})
    assert (moved.ranks, moved.batch_size) == (2, 1024)
    # Dimensions not swept keep the config's values (and its table sizes).
    only_ranks = sweep.base_point(cfg, {"ranks": [1, 2]}, tables)
    assert only_ranks == sweep.Point(1, 512, 100, None)


def test_point_config_scales_lengths_tables_and_data():
    cfg = demo()
    before = config.to_dict(cfg)
    p = sweep.Point(ranks=2, batch_size=256, sequence_length=25, table_rows=1000000)
    out = sweep.point_config(cfg, p, ["user", "item"])
    assert config.to_dict(cfg) == before  # the loaded config is not touched
    assert out.data.batch_size == 256
    assert out.synth.sequence_length == 25
    assert [g.max_length for g in out.features.sequence_groups] == [25, 12, 12]  # 100/50/50 scaled by 1/4
    sizes = {t.name: t.num_embeddings for t in out.features.tables}
    assert sizes["user"] == sizes["item"] == 1000000
    assert sizes["advertiser"] == 2000 and sizes["query_token"] == 1024
    assert out.synth.num_users == out.synth.num_items == 1000000  # the ids span the whole table
    same = sweep.point_config(cfg, sweep.Point(1, 512, 100, None), ["user", "item"])
    assert config.to_dict(same) == before
    with pytest.raises(ValueError, match="no table named"):
        sweep.scaled_table_names(cfg, ["nope"])


def test_data_settings_give_every_rank_row_groups():
    cfg = load_tiny("unused")
    s = sweep.data_synth(cfg, rows_needed=2 * 8 * 128, max_ranks=2, max_batch=128)
    assert s.train_requests * s.candidates_per_request >= 2 * 8 * 128
    assert s.train_requests * s.candidates_per_request / s.row_group_size >= 2 * 3
    assert s.num_files >= 2


def test_union_of_collectives_in_flight():
    assert collectives._union_ms([(0, 1000), (500, 2000), (3000, 3500), (3100, 3200)]) == pytest.approx(2.5)
    assert collectives._union_ms([]) == 0.0


def test_phase_profile_attributes_collectives_without_touching_torch_distributed(tmp_path):
    before = (dist.all_reduce, dist.all_to_all_single, dist.Work.wait)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        profile = collectives.PhaseProfile()
        profile.start()
        for _ in range(2):
            with profile.phase("data"):
                time.sleep(0.001)
            with profile.phase("forward"):
                dist.all_reduce(torch.ones(4))
        profile.stop()
        summary = profile.summary(steps=2)
    finally:
        dist.destroy_process_group()
    assert (dist.all_reduce, dist.all_to_all_single, dist.Work.wait) == before
    assert summary["ops"]["forward all_reduce"][0] == 1  # one per step
    assert summary["ms"]["forward"] > 0 and summary["ms"]["data"] == 0
    assert "data all_reduce" not in summary["ops"]


def test_cli_rejects_bad_arguments(capsys):
    for argv in (
        [],
        ["--sweep", "gpus=8"],
        ["--sweep", "ranks=1", "--steps", "0"],
        ["--sweep", "ranks=1", "--base", "ranks=1,2"],
    ):
        with pytest.raises(SystemExit):
            scaling.parse_args(argv)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """One tiny 1- and 2-rank sweep through the CLI: (output directory, what it printed)."""
    tmp = tmp_path_factory.mktemp("scaling")
    out = tmp / "scaling"
    argv = ["--config", DEMO, "--sweep", "ranks=1,2", "--warmup", "3", "--steps", "3"]
    argv += ["--gpus", "8,16", "--out", str(out), "--timeout", "180"]
    for o in tiny_overrides(tmp / "unused"):
        argv += ["--set", o]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert scaling.main(argv) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def sweep_rows(tiny_sweep):
    with open(tiny_sweep[0] / "scaling.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == scaling.COLUMNS
        return list(reader)


@pytest.mark.slow
def test_sweep_prints_the_ratio_and_the_projection(tiny_sweep):
    assert "2 vs 1 ranks:" in tiny_sweep[1] and "planner projection" in tiny_sweep[1]


@pytest.mark.slow
def test_sweep_rows_hold_the_points(sweep_rows):
    assert [int(r["ranks"]) for r in sweep_rows] == [1, 2]
    for r in sweep_rows:
        ranks = int(r["ranks"])
        assert int(r["batch_size"]) == 128 and int(r["global_batch"]) == 128 * ranks
        assert int(r["sequence_length"]) == 20 and int(r["steps"]) == 3 and r["best"] == "1"


@pytest.mark.slow
def test_sweep_measures_every_phase(sweep_rows):
    for r in sweep_rows:
        for col in POSITIVE:
            assert float(r[col]) > 0, (col, r)
        ranks = int(r["ranks"])
        assert float(r["examples_per_s"]) == pytest.approx(float(r["examples_per_s_per_rank"]) * ranks, rel=1e-4)
        phases = sum(float(r[k]) for k in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"))
        assert phases <= float(r["step_ms"]) * 1.01  # the phases are inside the measured step
        assert float(r["peak_rss_mib_total"]) >= float(r["peak_rss_mib"])


@pytest.mark.slow
def test_sweep_comms_lie_inside_their_phases(tiny_sweep, sweep_rows):
    # Comms are measured on the profiled steps that follow the timed ones (the profiler slows a step
    # and a shared machine varies between the two), so they lie inside those steps' own phase times
    # (each rank's comms_phase_ms), not necessarily inside the timed steps' averages.
    ranks = list((tiny_sweep[0] / "runs").glob("*/rank-*.json"))
    assert ranks
    for path in ranks:
        r = json.loads(path.read_text())
        assert r["comms_fwd_ms"] <= r["comms_phase_ms"]["forward"] + 1e-3, path
        assert r["comms_bwd_ms"] <= r["comms_phase_ms"]["backward"] + 1e-3, path
    two = sweep_rows[1]
    assert float(two["comms_ms"]) > 0 and float(two["ddp_allreduce_ms"]) > 0


@pytest.mark.slow
def test_sweep_records_the_plan_and_per_rank_json(tiny_sweep, sweep_rows):
    for r in sweep_rows:
        ranks = int(r["ranks"])
        assert f"@{ranks - 1}" in r["plan"] or ranks == 1 and "@0" in r["plan"]
    assert "+" in sweep_rows[1]["plan"] or "@1" in sweep_rows[1]["plan"]  # something lives on rank 1
    assert (tiny_sweep[0] / "runs" / "r2-b128-L20-Tcfg-0" / "rank-1.json").exists()
    assert not [n for n in os.listdir(tiny_sweep[0]) if n.startswith("error")]


@pytest.mark.slow
def test_sweep_projects_the_gpus(tiny_sweep):
    with open(tiny_sweep[0] / "projection.csv") as f:
        projection = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in projection] == [8, 16]
    for r in projection:
        assert float(r["critical_path_ms"]) > 0 and float(r["embedding_examples_per_s"]) > 0
        assert 0 <= int(r["critical_rank"]) < int(r["gpus"]) and r["sharding"]


@pytest.mark.slow
def test_sweep_plots_and_replots(tiny_sweep, capsys):
    import matplotlib.image

    out = tiny_sweep[0]
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["projection.png", "scaling_ranks.png"]
    for name in pngs:
        with open(out / name, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # --replot redraws from the CSVs and sweep.json alone.
    for name in pngs:
        (out / name).unlink()
    assert scaling.main(["--replot", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == pngs
    assert "2 vs 1 ranks:" in capsys.readouterr().out
