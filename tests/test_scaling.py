"""pinads_rec.scaling: sweep planning and per-run configs (fast), then one tiny real sweep (1 and 2
gloo ranks, 3 warmup + 3 measured steps, planner projection for 8 and 16 GPUs) through the CLI."""

import csv
import os

import pytest
import torch.distributed as dist
from conftest import DEMO, load_tiny, tiny_overrides

from pinads_rec import config
from pinads_rec.experiments import scaling

BRIEF_SWEEPS = ["ranks=1,2", "batch_size=256,512,1024", "sequence_length=25,50,100", "table_rows=10000,100000,1000000"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def demo():
    return config.load(DEMO)


def test_parse_sweeps():
    assert scaling.parse_sweeps(["ranks=1,2", "batch_size=256, 512", "ranks=2,4"]) == {
        "ranks": [1, 2, 4],
        "batch_size": [256, 512],
    }
    assert scaling.parse_sweeps(["table_rows=1_000_000"]) == {"table_rows": [1000000]}
    for bad, words in (
        ("ranks", "NAME=v1"),
        ("gpus=8", "unknown dimension"),
        ("ranks=0,1", "> 0"),
        ("batch_size=a", "integers"),
        ("ranks=", "> 0"),
    ):
        with pytest.raises(ValueError, match=words):
            scaling.parse_sweeps([bad])


def test_one_at_a_time_around_the_base_point():
    cfg = demo()
    sweeps = scaling.parse_sweeps(BRIEF_SWEEPS)
    tables = scaling.scaled_table_names(cfg, None)
    assert tables == ["user", "item"]
    base = scaling.base_point(cfg, sweeps, tables)
    # The config's batch (512) and length (100) are listed; its 50000-row tables are not: first value.
    assert base == scaling.Point(ranks=1, batch_size=512, sequence_length=100, table_rows=10000)
    points = scaling.sweep_points(sweeps, base)
    assert points[0] == base and len(points) == len(set(points)) == 8  # base once + 7 variations
    for p in points[1:]:
        assert sum(getattr(p, d) != getattr(base, d) for d in scaling.DIMENSIONS) == 1
    assert len(scaling.sweep_points(sweeps, base, grid=True)) == 2 * 3 * 3 * 3
    moved = scaling.base_point(cfg, sweeps, tables, {"ranks": 2, "batch_size": 1024})
    assert (moved.ranks, moved.batch_size) == (2, 1024)
    # Dimensions not swept keep the config's values (and its table sizes).
    only_ranks = scaling.base_point(cfg, {"ranks": [1, 2]}, tables)
    assert only_ranks == scaling.Point(1, 512, 100, None)


def test_point_config_scales_lengths_tables_and_data():
    cfg = demo()
    before = config.to_dict(cfg)
    p = scaling.Point(ranks=2, batch_size=256, sequence_length=25, table_rows=1000000)
    out = scaling.point_config(cfg, p, ["user", "item"])
    assert config.to_dict(cfg) == before  # the loaded config is not touched
    assert out.data.batch_size == 256
    assert out.synth.sequence_length == 25
    assert [g.max_length for g in out.features.sequence_groups] == [25, 12, 12]  # 100/50/50 scaled by 1/4
    sizes = {t.name: t.num_embeddings for t in out.features.tables}
    assert sizes["user"] == sizes["item"] == 1000000
    assert sizes["advertiser"] == 2000 and sizes["query_token"] == 1024
    assert out.synth.num_users == out.synth.num_items == 1000000  # the ids span the whole table
    same = scaling.point_config(cfg, scaling.Point(1, 512, 100, None), ["user", "item"])
    assert config.to_dict(same) == before
    with pytest.raises(ValueError, match="no table named"):
        scaling.scaled_table_names(cfg, ["nope"])


def test_data_settings_give_every_rank_row_groups():
    cfg = load_tiny("unused")
    s = scaling.data_synth(cfg, rows_needed=2 * 8 * 128, max_ranks=2, max_batch=128)
    assert s.train_requests * s.candidates_per_request >= 2 * 8 * 128
    assert s.train_requests * s.candidates_per_request / s.row_group_size >= 2 * 3
    assert s.num_files >= 2


def test_comms_timer_restores_torch_distributed():
    originals = {n: getattr(dist, n) for n in scaling.CommsTimer.PATCHED}
    wait = dist.Work.wait
    timer = scaling.CommsTimer().install()
    assert dist.all_to_all_single is not originals["all_to_all_single"]
    assert dist.Work.wait is not wait
    timer.uninstall()
    assert {n: getattr(dist, n) for n in scaling.CommsTimer.PATCHED} == originals
    assert dist.Work.wait is wait


def test_cli_rejects_bad_arguments(capsys):
    for argv in (
        [],
        ["--sweep", "gpus=8"],
        ["--sweep", "ranks=1", "--steps", "0"],
        ["--sweep", "ranks=1", "--base", "ranks=1,2"],
    ):
        with pytest.raises(SystemExit):
            scaling.parse_args(argv)


@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path, capsys):
    out = tmp_path / "scaling"
    argv = [
        "--config",
        DEMO,
        "--sweep",
        "ranks=1,2",
        "--warmup",
        "3",
        "--steps",
        "3",
        "--gpus",
        "8,16",
        "--out",
        str(out),
        "--timeout",
        "180",
    ]
    for o in tiny_overrides(tmp_path / "unused"):
        argv += ["--set", o]
    assert scaling.main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 vs 1 ranks:" in printed and "planner projection" in printed

    with open(out / "scaling.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == scaling.COLUMNS
        rows = list(reader)
    assert [int(r["ranks"]) for r in rows] == [1, 2]
    for r in rows:
        ranks = int(r["ranks"])
        assert int(r["batch_size"]) == 128 and int(r["global_batch"]) == 128 * ranks
        assert int(r["sequence_length"]) == 20 and int(r["steps"]) == 3 and r["best"] == "1"
        for col in (
            "examples_per_s",
            "examples_per_s_per_rank",
            "step_ms",
            "data_ms",
            "forward_ms",
            "backward_ms",
            "optimizer_ms",
            "peak_rss_mib",
            "base_rss_mib",
            "ids_per_example",
            "embedding_rows",
            "wall_s",
        ):
            assert float(r[col]) > 0, (col, r)
        assert float(r["examples_per_s"]) == pytest.approx(float(r["examples_per_s_per_rank"]) * ranks, rel=1e-4)
        phases = sum(float(r[k]) for k in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"))
        assert phases <= float(r["step_ms"]) * 1.01  # the phases are inside the measured step
        assert float(r["comms_fwd_ms"]) <= float(r["forward_ms"])
        assert float(r["comms_bwd_ms"]) <= float(r["backward_ms"])
        assert float(r["peak_rss_mib_total"]) >= float(r["peak_rss_mib"])
        assert f"@{ranks - 1}" in r["plan"] or ranks == 1 and "@0" in r["plan"]
    two = rows[1]
    assert float(two["comms_ms"]) > 0 and float(two["ddp_allreduce_ms"]) > 0
    assert "+" in two["plan"] or "@1" in two["plan"]  # something lives on rank 1
    assert (out / "runs" / "r2-b128-L20-Tcfg-0" / "rank-1.json").exists()

    with open(out / "projection.csv") as f:
        projection = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in projection] == [8, 16]
    for r in projection:
        assert float(r["critical_path_ms"]) > 0 and float(r["embedding_examples_per_s"]) > 0
        assert 0 <= int(r["critical_rank"]) < int(r["gpus"]) and r["sharding"]

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["projection.png", "scaling_ranks.png"]
    import matplotlib.image

    for name in pngs:
        with open(out / name, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not [n for n in os.listdir(out) if n.startswith("error")]

    # --replot redraws from the CSVs and sweep.json alone.
    for name in pngs:
        (out / name).unlink()
    assert scaling.main(["--replot", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == pngs
    assert "2 vs 1 ranks:" in capsys.readouterr().out
