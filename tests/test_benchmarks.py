"""Benchmark scripts run end to end on tiny data (their figures are measured by hand, never asserted
against a time: these only check the scripts work and report what they claim to)."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import DEMO, REPO, tiny_overrides

from pinads_rec.config import ConfigError

pytestmark = pytest.mark.slow

# Each benchmark runs at its smallest size: a minute or less on a quiet 2-core machine, most of it
# start-up (train_throughput.py: 8 fresh gloo processes, ~5 s of torch/TorchRec import each). The
# subprocess timeouts are hang guards only, long enough for a machine shared several times over.
HANG_GUARD_S = 1800


def test_train_throughput_measures_every_mode_and_the_utilization(tiny_data, tmp_path):
    _, data = tiny_data
    args = [sys.executable, os.path.join(REPO, "benchmarks", "train_throughput.py")]
    args += "--ranks 1 --steps 2 --warmup 1 --profile".split() + ["--out", str(tmp_path)]
    for o in tiny_overrides(data) + ["model.calibration=none"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    measured = {(r["model"], r["mode"]) for r in rows}
    for model in ("full", "no_sequence"):
        for mode in ("pipeline", "loop", "plain"):
            assert (model, mode) in measured
    for r in rows:
        if r["mode"] != "utilization":
            assert float(r["examples_per_s"]) > 0
    util = {r["model"]: r for r in rows if r["mode"] == "utilization"}
    assert set(util) == {"full", "no_sequence"}
    assert float(util["full"]["dense_flops_per_example"]) > 1e5
    for r in util.values():
        # sequences and pooled ids are looked up; the kernel alone and the loader both measured
        assert float(r["lookups_per_example"]) > 3
        assert float(r["fbgemm_lookups_per_s"]) > 0 and float(r["loader_examples_per_s"]) > 0
        assert float(r["loader_zero_fill_examples_per_s"]) > 0
    assert float(util["full"]["lookups_per_example"]) > float(util["no_sequence"]["lookups_per_example"])
    out = proc.stdout
    assert "pipeline / plain PyTorch" in out and "MFLOP/example" in out and "of fbgemm alone" in out
    for model in ("full", "no_sequence"):
        assert "self cpu" in (tmp_path / f"profile-{model}.txt").read_text().lower()


def test_training_efficiency_switches_run(tiny_data, tmp_path, monkeypatch):
    """The switches (attention pinned to SDPA's MATH kernel, the non-fused dense AdamW kernels,
    loader prefetch) train; the MATH switch reaches every self-attention layer."""
    import functools

    benchmarks = os.path.join(REPO, "benchmarks")
    monkeypatch.syspath_prepend(benchmarks)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([benchmarks] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    import train_throughput as tt

    from pinads_rec import config
    from pinads_rec.experiments import harness

    switches = (
        (["train.dense_optimizer_kernel=for_loop"], {"attention": "math"}),
        (["train.dense_optimizer_kernel=foreach", "data.prefetch_factor=1"], {}),
    )
    for overrides, kwargs in switches:
        cfg = config.load(
            os.path.join(REPO, "configs", "demo.yaml"),
            tiny_overrides(tiny_data[1]) + ["model.calibration=none"] + tt.REFERENCE["full"] + overrides,
        )
        measure = functools.partial(tt.measure_pipeline, **kwargs)
        (r,) = harness.rank_results(measure, 1, tmp_path / "switch", cfg, 1, 2, 1, timeout_s=HANG_GUARD_S)
        assert r["steps"] == 2 and r["valid_rows_per_step"] > 0
        # 3 sequence groups x 2 Transformer layers
        assert r["attention_layers_pinned"] == (6 if kwargs else 0)


def test_equal_auc_trains_both_and_evaluates_both(tiny_data, tmp_path):
    _, data = tiny_data
    args = [sys.executable, os.path.join(REPO, "benchmarks", "equal_auc.py")]
    args += "--steps 3 --ranks 1 --models no_sequence".split() + ["--out", str(tmp_path)]
    # reference.enabled=false: train.py's LightGBM reference after its run, which the benchmark does not read
    for o in tiny_overrides(data) + ["model.calibration=none", "reference.enabled=false"]:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    rows = json.loads((tmp_path / "equal_auc.json").read_text())
    assert [r["trainer"] for r in rows] == ["train.py", "plain"]
    for r in rows:
        assert r["examples_per_s"] > 0 and 0.0 <= r["auc_all"] <= 1.0 and r["steps"] == 3
    assert "train.py / plain:" in proc.stdout
    assert os.path.exists(tmp_path / "no_sequence-train_py" / "metrics.jsonl")


def test_collective_latency_reports_each_compute_setting():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "collective_latency.py"),
            "--calls",
            "10",
            "--compute-us",
            "0",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "of compute:" in line]
    assert [line.split()[1] for line in lines] == ["0", "200"]
    assert all("median" in line and "p90" in line and "compute alone" in line for line in lines)


def _run(script, flags, overrides=()):
    """``python benchmarks/<script> <flags> --set <override>...`` from the repository root (``flags``
    one string, split on spaces); its stdout (it must succeed)."""
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", script), *flags.split()]
    cmd += [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _numbers(text):
    """The numbers among the whitespace-separated words of ``text`` ("1,234" and "1.5x" read as numbers)."""
    out = []
    for word in text.split():
        try:
            out.append(float(word.rstrip("x").replace(",", "")))
        except ValueError:
            pass
    return out


def test_two_tower_cost_times_both_models_and_compares_run_aucs(tiny_data, tmp_path, capsys, monkeypatch):
    _, data = tiny_data
    out = _run("two_tower_cost.py", "--candidates 1 8 --requests 3 --repeats 1", tiny_overrides(data))
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split("|")[1].split()[0] for r in rows] == ["1", "8", "real"]
    for r in rows:  # ranker ms, two-tower ms, ratio, two-tower live ms: all measured
        assert len(_numbers(r.split("|", 2)[2])) == 4 and all(v > 0 for v in _numbers(r.split("|", 2)[2]))
    assert "ad export:" in out

    # --auc: two finished runs' summaries (run_log's format), one given as its metrics.jsonl
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import two_tower_cost

    runs = []
    for i, auc in enumerate((0.70, 0.72)):
        run = tmp_path / f"run{i}"
        run.mkdir()
        row = {"surface": "all", "task": "click", "auc": auc, "ne": 0.9, "calibration": 1.0, "oracle_auc": 0.8}
        (run / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "loss": 0.5}) + "\n" + json.dumps({"step": 4, "eval": [row]}) + "\n"
        )
        runs.append(str(run))
    two_tower_cost.main(["--auc", runs[0], runs[1] + "/metrics.jsonl"])
    table = capsys.readouterr().out
    assert "| all | click | 0.7000 | 0.7200 | +0.0200 | 0.9000 | 0.9000 | 1.000 | 1.000 | 0.8000 |" in table


def test_loader_reports_memory_flatness_and_throughput_per_worker_count(tiny_data):
    _, data = tiny_data
    out = _run("loader.py", f"--data {data}/train --workers 0 1 --scale 2 --max-batches 4", tiny_overrides(data))
    lines = out.splitlines()
    assert "flatness: peak(100%) / peak(10%) =" in out and "row-group tables alive at once" in out
    marks = [line for line in lines if line.split()[:1] in (["10%"], ["50%"], ["100%"])]
    assert len(marks) == 3 and all(_numbers(m)[1] > 0 for m in marks)  # rows, peak RSS MiB, ...
    rates = [_numbers(line) for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [r[0] for r in rates] == [0, 1]
    assert all(r[1] == 4 and r[6] > 0 for r in rates)  # 4 batches each, examples/s measured


def test_broadcasting_times_inference_and_training_with_broadcasting_on_and_off(tiny_data):
    _, data = tiny_data
    flags = "--rows 64 --candidates 32 --batches 1 --repeats 1 --train-repeats 1 --quiet-wait 0"
    out = _run("broadcasting.py", f"--data {data}/eval {flags}")
    table = out.split("\n\n")[-2].splitlines()  # the final table, after the progress lines
    cells = {line.split(" (")[0]: _numbers(line.split(")", 1)[1]) for line in table[2:]}
    assert set(cells) == {"inference", "training step"}
    for n_candidates, users, on, off, ratio, best, _ in cells.values():
        assert (n_candidates, users) == (32, 2) and min(on, off, ratio, best) > 0
    assert "acceptance (>= 2x inference throughput at 32 candidates/request)" in out


def test_inference_precision_reports_every_section(tmp_path):
    """On the golden run's checkpoint (tests/golden) and data made by its config."""
    from test_golden import SAVED_RUN, make_data

    data = tmp_path / "data"
    make_data(data)
    runs = []
    for name in ("fp32", "bf16"):  # finished runs' summaries, in run_log's format
        run = tmp_path / name
        run.mkdir()
        rows = [{"surface": "all", "task": t, "auc": 0.7} for t in ("click", "good_click", "save")]
        (run / "metrics.jsonl").write_text(json.dumps({"step": 8, "train_examples_per_s": 100.0, "eval": rows}) + "\n")
        runs.append(f"{name}={run}")
    flags = (
        f"--run {SAVED_RUN} --data {data}/eval --train-data {data}/train --rows 64 --batches 1 --repeats 1 "
        "--profile-rows 64 --train-rows 64 --train-repeats 1 --threads 1 --quiet-wait 0 --runs " + " ".join(runs)
    )
    out = _run("inference_precision.py", flags)
    report = out.split("=" * 80)[-1]
    for title in (
        "1. inference latency",
        "1b. inference latency",
        "2. eval AUC",
        "3. where the time goes",
        "4. training throughput",
        "SDPA backend micro-benchmark",
        "5. final eval AUC of real training runs",
    ):
        assert title in report, title
    lines = report.splitlines()
    for variant in ("fp32 ", "bf16 (MATH SDPA, as shipped)", "bf16 (default SDPA: flash)", "bf16 MATH", "bf16 flash"):
        assert any(line.startswith(variant) and _numbers(line)[0] > 0 for line in lines), variant
    assert "max |delta AUC| =" in report
    assert "train examples/s (whole run, as logged): fp32 100, bf16 100" in report


def test_storage_layout_measures_both_layouts_side_by_side(tmp_path):
    out = _run(
        "storage_layout.py",
        f"--train-requests 300 --eval-requests 20 --repeats 2 --max-batches 3 --out {tmp_path}",
        ["synth.sequence_length=20", "synth.row_group_size=600", "synth.num_files=2", "data.batch_size=128"],
    )
    assert "first batches equal: True" in out
    for label in ("disk MB", "sequence columns MB", "held per row group MB", "loader rows/s (median)"):
        assert label in out
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["disk"]["per_request"]["files"] < result["disk"]["per_row"]["files"]
    assert result["disk"]["per_request"]["sequences"] < result["disk"]["per_row"]["sequences"]
    for layout in ("per_row", "per_request"):
        assert len(result["throughput"][layout]) == 2
        assert all(r["rows_per_s"] > 0 and r["batches"] == 3 for r in result["throughput"][layout])


def test_build_measures_the_builder_pandas_polars_and_spark_and_their_outputs_agree(tmp_path):
    from pinads_rec.data.build.spark_engine import check_java

    try:
        check_java()
        spark = True
    except ConfigError:  # no Java runtime: Spark's row is left out (tests/test_spark_build.py says why)
        spark = False
    out = _run("build.py", f"--smoke --threads 2 --out {tmp_path}{'' if spark else ' --spark-events 0'}")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "engine" not in line]
    engines = [r.split("|")[1].strip() for r in rows]
    assert engines == [
        "DuckDB builder",
        "pandas",
        "DuckDB builder",
        "Polars streaming (core step)",
        "DuckDB builder (core step)",
    ] + (["Spark local[2] builder"] if spark else [])
    for r in rows:
        assert r.rstrip().endswith("| yes |"), r
        numbers = _numbers(r.split("|", 2)[2])  # events, impressions, (cap), wall s, rows/s x2, RSS, temp, output
        assert numbers[0] > 0 and numbers[1] > 0 and all(v >= 0 for v in numbers)
    # both comparisons check the outputs, not only the times
    assert "pandas output == builder output" in out
    assert "Polars sequences == builder sequences" in out
    if spark:
        assert "Spark output == builder output" in out and "Spark local[2] / DuckDB at 60,000 events: wall" in out
    assert "x the 256MB cap" in out and "pandas / builder at 30,000 events: wall" in out
    result = json.loads((tmp_path / "build_benchmark.json").read_text())
    assert result["log"]["in_memory_total"] > 0 and all(r["peak_rss_mb"] > 0 for r in result["rows"])


def test_long_sequences_measures_every_variant_per_cap_and_the_arch_padded_vs_bucketed(tiny_data, tmp_path):
    _, data = tiny_data
    flags = (
        f"--data {data} --caps 100 1000 --steps 2 --warmup 1 --skip-padded-above 100 --arch-units 4 "
        f"--arch-repeats 1 --out {tmp_path}"
    )
    out = _run("long_sequences.py", flags, ["data.batch_size=128", "data.num_workers=0", "model.calibration=none"])
    table = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    cells = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table}
    assert set(cells) == {"padded Transformer", "unpadded Transformer", "retrieval", "HSTU"}
    assert cells["padded Transformer"][1].strip() == "-"  # cap 1000 skipped: no ratio
    for name in ("unpadded Transformer", "retrieval", "HSTU"):
        rate100, rate1000, ratio = (_numbers(c)[0] for c in cells[name])
        # The ratio is printed to 2 decimals: half a unit of the last one (and the rates' own rounding), or 1%.
        assert rate100 > 0 and rate1000 > 0 and ratio == pytest.approx(rate1000 / rate100, rel=0.01, abs=0.006)
    assert "padded Transformer     cap  1000: skipped" in out
    result = json.loads((tmp_path / "long_sequences.json").read_text())
    assert len(result["train"]) == 7 and all(r["examples_per_s"] > 0 for r in result["train"])
    assert [r["cap"] for r in result["arch"]] == [100, 1000]
    for r in result["arch"]:  # outputs checked, both paths timed
        assert r["max_abs_diff"] <= 1e-5 and r["padded_ms"] > 0 and r["buckets_ms"] > 0


def test_datasets_benchmark_sets_model_no_sequence_reference_and_oracle_side_by_side(tmp_path):
    """KuaiRand-shaped logs of a few users through the whole benchmark: generated in KuaiRand-Pure's
    layout with a unique truth key, built with the truth joined, both trainings through TorchX, the
    reference fitted, every AUC reported beside the oracle's."""
    import pandas as pd
    import pyarrow.parquet as pq
    from dataset_fixtures import KUAIRAND_LOG_HEADER, KUAIRAND_USER_HEADER, KUAIRAND_VIDEO_HEADER

    small = ["build.requests_per_row_group=64", "data.batch_size=256", "data.shuffle_buffer_rows=2048"]
    small += ["data.num_workers=0", "train.warmup_steps=5", "train.log_every=5", "train.tensorboard=false"]
    out = _run("datasets.py", f"--dataset kuairand --users 100 --seeds 3 --work {tmp_path}", small)
    work = tmp_path / "seed-3"
    raw = work / "raw"
    logs = sorted(raw.glob("log_*.csv"))
    assert [f.name for f in logs] == [
        "log_random_4_22_to_5_08_pure.csv",
        "log_standard_4_08_to_4_21_pure.csv",
        "log_standard_4_22_to_5_08_pure.csv",
    ]
    headers = {f.name: f.open().readline().strip() for f in raw.glob("*.csv")}
    assert all(headers[f.name] == KUAIRAND_LOG_HEADER for f in logs)
    assert headers["user_features_pure.csv"] == KUAIRAND_USER_HEADER
    assert headers["video_features_basic_pure.csv"] == KUAIRAND_VIDEO_HEADER
    log = pd.concat([pd.read_csv(f) for f in logs])
    truth = pd.read_csv(raw / "truth.csv")
    key = ["user_id", "video_id", "time_ms"]
    assert not truth.duplicated(key).any() and len(truth) == len(log)
    assert (log.is_rand == 1).sum() > 0 and (log.is_rand == 0).sum() > 0
    joined = log.merge(truth, on=key)
    assert (
        len(joined) == len(log) and ((joined.p_long_view <= joined.p_click) & (joined.p_like <= joined.p_click)).all()
    )

    # every split carries the truth; the reference sees the item's attributes through the history
    schema = pq.read_schema(next((work / "data" / "train").glob("*.parquet")))
    assert {"true_click", "true_long_view", "true_like"} <= set(schema.names)
    names = json.loads((work / "reference_features.json").read_text())
    assert "video_id~click_video: newest 5" in names and "author_id~click_author: all" in names
    assert any("~click_video." in n for n in names), names  # an item attribute (its type, music...) through the history

    report = json.loads((work / "report.json").read_text())
    assert report["seed"] == 3 and "train.seed=3" in report["commands"]["model"]
    cells = {(r["surface"], r["task"]): r for r in report["rows"]}
    models = ["model", "no sequences", "logistic regression", "LightGBM"]
    for task in ("click", "long_view", "like"):
        r = cells[("all", task)]
        assert r["examples"] == (log.is_rand == 1).sum() and 0.5 < r["oracle"] <= 1.0
        assert all(0.0 <= r[m] <= 1.0 for m in models), r
        for run in ("model", "no sequences"):  # the runs' oracle is this script's, on the same rows
            assert r[f"{run} oracle (run)"] == pytest.approx(r["oracle"], abs=1e-9)
    assert set(report["stages"]) == {"generate", "build", "train: model", "train: no sequences", "reference"}
    assert all(s["wall_s"] > 0 and s["peak_rss_mib"] > 0 for s in report["stages"].values())
    assert "features.sequence_groups=[]" in report["commands"]["no sequences"]
    table = (work / "report.md").read_text()
    assert "| all | click |" in table and "oracle AUC" in table and table in out

    # over the seeds (one here): each model's mean, the margin over LightGBM and its verdict
    seeds = json.loads((tmp_path / "report.json").read_text())
    assert seeds["seeds"] == [3] and seeds["models"] == report["models"]
    r = {(r["surface"], r["task"]): r for r in seeds["rows"]}[("all", "click")]
    assert r["model"] == cells[("all", "click")]["model"] and r["margin"] == pytest.approx(r["model"] - r["LightGBM"])
    assert r["verdict"] in {"ahead", "level", "behind"} and "model - LightGBM" in (tmp_path / "report.md").read_text()


def test_reference_features_refits_without_each_group(tiny_data):
    _, data_dir = tiny_data
    out = _run("reference_features.py", f"--config {DEMO} --top 5", tiny_overrides(data_dir))
    table = out[out.index("| features |") :]
    for variant in ("all features", "no history matches", "no pins matches", "no item rates", "no dense features"):
        assert f"| {variant} |" in table
    assert "gain share" in out
    # Without the history the tiny world's planted interests are lost: the AUC over all falls.
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table.splitlines() if line.startswith("| ")}
    whole, blind = float(rows["all features"][-1]), float(rows["no history matches"][-1])
    assert whole > blind


def test_history_designs_times_each_design_side_by_side(tmp_path):
    likes, shipped = "configs/datasets/movielens_100k_likes.yaml", "configs/datasets/movielens_100k.yaml"
    out = _run("history_designs.py", f"{likes} {shipped} --users 60 --steps 2 --repeats 1 --work {tmp_path}")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  movielens_100k")}
    assert set(lines) == {"movielens_100k_likes", "movielens_100k"}
    assert "x1.00" in lines["movielens_100k_likes"]
    # The shipped design holds every rating besides the likes: more events per request.
    events = {name: float(line.split("events/request")[1].split()[0]) for name, line in lines.items()}
    assert events["movielens_100k"] > events["movielens_100k_likes"] > 0


def test_kuairand_ceiling_reports_the_oracle_and_what_the_logs_reveal():
    out = _run("kuairand_ceiling.py", "--users 300")
    lines = {line.split(" AUC ")[0].strip(): _numbers(line) for line in out.splitlines() if " AUC " in line}
    assert list(lines) == [
        "oracle",
        "oracle without current interest",
        "non-history logit alone",
        "ceiling: non-history logit + history features",
    ]
    assert lines["oracle"][-1] == 1.0  # lift of the oracle itself
    assert all(0.5 < auc < 1.0 for auc, _ in lines.values())


def test_event_bags_times_both_histories_side_by_side(tmp_path):
    out = _run("event_bags.py", f"--users 60 --steps 2 --repeats 1 --work {tmp_path}")
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["bags", "first"]
    assert "x step time" in out and "x files" in out
    import pyarrow as pa
    import pyarrow.parquet as pq

    def genres(variant):  # the built history's genres: a bag per event, or one id per event
        return pq.read_schema(next((tmp_path / variant / "train").glob("*.parquet"))).field("liked_genres").type

    assert pa.types.is_list(genres("bags").value_type) and pa.types.is_integer(genres("first_genre").value_type)


def test_managed_collision_times_the_hashed_and_the_managed_table_side_by_side(tmp_path):
    small = ["synth.num_items=2000", "synth.row_group_size=600", "data.batch_size=128", "data.shuffle_buffer_rows=1024"]
    out = _run("managed_collision.py", f"--requests 600 --steps 12 --repeats 1 --work {tmp_path}", small)
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["hashed", "managed"]
    assert "x step time" in out and "x examples/s" in out and "id map: 0.01 MiB" in out


# benchmarks/serving.py's smoke run is scripts/gpu_check.sh's serving step, whose dry run starts one
# Ray cluster for both (tests/test_gpu_check.py, test_the_serving_benchmark_drives_the_service).


def test_seeds_trains_each_seed_beside_its_reference_and_keeps_finished_runs(tiny_data, tmp_path):
    _, data_dir = tiny_data
    overrides = tiny_overrides(data_dir) + ["train.max_steps=3", "model.calibration=none"]
    flags = f"--config {DEMO} --seeds 0 1 --ranks 1 --work {tmp_path} --out {tmp_path / 'seeds.md'}"
    out = _run("seeds.py", flags, overrides)
    assert "seed 0: training into" in out and "seed 1: training into" in out
    rows = json.loads((tmp_path / "seeds.json").read_text())["rows"]
    assert {(r["surface"], r["task"]) for r in rows} >= {("all", "click"), ("home_feed", "save")}
    for r in rows:
        assert r["seeds"] == 2 and abs(r["margin"] - (r["auc"] - r["ref_auc"])) < 1e-9
        assert r["auc_se"] > 0 and r["lift"] is not None
    runs = [json.loads((tmp_path / f"seed-{s}" / "config.json").read_text()) for s in (0, 1)]
    assert [(c["train"]["seed"], c["reference"]["seed"]) for c in runs] == [(0, 0), (1, 1)]
    verdicts = [line for line in out.splitlines() if line.startswith("all click: ")]
    assert len(verdicts) == 1 and re.search(r"^all click: (ahead|level|behind) \([+-]", verdicts[0])
    assert "| all | click |" in (tmp_path / "seeds.md").read_text()
    again = _run("seeds.py", flags, overrides)  # the finished runs are kept, not trained again
    assert "seed 0: keeping the finished run" in again and "seed 1: keeping the finished run" in again


def test_embedding_dtypes_measures_every_dtype_side_by_side(served_run, tmp_path):
    """The served run at fp32, int8 and int4: its tables' measured bytes (each smaller), a fresh
    process's peak RSS, the model alone's rows/s per batch size and the online path's p50."""
    run, raw, _ = served_run
    out = tmp_path / "dtypes.json"
    flags = f"--run {run} --raw {raw} --requests 1 4 --batches 2 --repeats 1 --online-requests 6 --out {out}"
    text = _run("embedding_dtypes.py", flags)
    result = json.loads(out.read_text())["dtypes"]
    assert list(result) == ["fp32", "int8", "int4"]
    tables = [result[d]["memory"]["tables"] for d in result]
    assert tables[0] > tables[1] > tables[2] > 0
    for r in result.values():
        assert r["memory"]["rss_kib"] > 0 and r["rows_per_s@1"] > 0 and r["rows_per_s@4"] > 0
        assert 0 < r["online_p50_ms"] <= r["online_p99_ms"]
    assert "| int8 |" in text and "x smaller" in text
