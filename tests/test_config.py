"""Typed config: errors name the offending key's dotted path; overrides and defaults apply."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from pinads_rec import config
from pinads_rec.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"
# Experiment configs; configs/ablations/ holds ablation files (each names experiment configs).
ALL_CONFIGS = [p for p in sorted((REPO / "configs").rglob("*.y*ml")) if "ablations" not in p.parts]
ABLATIONS = sorted((REPO / "configs" / "ablations").glob("*.yaml"))


def demo_raw() -> dict:
    return yaml.safe_load(DEMO.read_text())


def table_index(raw: dict, name: str) -> int:
    return next(i for i, t in enumerate(raw["features"]["tables"]) if t["name"] == name)


def assert_config_error(pattern: str, raw: dict = None, overrides=()):
    """from_dict(raw or demo, overrides) raises a ConfigError matching ``pattern`` (re.search)."""
    with pytest.raises(ConfigError, match=pattern) as info:
        config.from_dict(demo_raw() if raw is None else raw, list(overrides))
    return str(info.value)


# --------------------------------------------------------------------------------------------
# Unknown keys.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,key",
    [
        ("foo=1", "foo"),
        ("model.dcn.foo=1", "model.dcn.foo"),
        ("data.batchsize=64", "data.batchsize"),
        ("synth.faults.zero_fil_column=x", "synth.faults.zero_fil_column"),
        ("features.columns.query=q", "features.columns.query"),
    ],
)
def test_unknown_key_override(override, key):
    msg = assert_config_error("^" + re.escape(key) + ": unknown key", overrides=[override])
    assert "valid keys here" in msg


@pytest.mark.parametrize("override", ["train.lr=[1,", "build.impressions.filter=a: b: c", "train.run_dir='x"])
def test_an_override_that_is_not_yaml_names_its_key(override):
    key = override.split("=", 1)[0]
    assert_config_error("^override " + re.escape(key) + ": the value .* is not valid YAML", overrides=[override])


def test_unknown_key_inside_a_list_item():
    raw = demo_raw()
    raw["features"]["tables"][1]["sized"] = 3
    raw["features"]["sequence_groups"][1]["features"][2]["pool"] = "sum"
    assert_config_error(r"^features\.tables\[1\]\.sized: unknown key", raw)
    del raw["features"]["tables"][1]["sized"]
    assert_config_error(r"^features\.sequence_groups\[1\]\.features\[2\]\.pool: unknown key", raw)


def test_unknown_key_via_load_names_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    raw = demo_raw()
    raw["model"] = {"dcn": {"num_layer": 3}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": model\.dcn\.num_layer: unknown key"):
        config.load(path)


# --------------------------------------------------------------------------------------------
# Wrong types.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("train.lr=abc", r"^train\.lr: expected a number, got 'abc'"),
        ("train.lr=true", r"^train\.lr: expected a number, got True"),
        ("data.batch_size=1.5", r"^data\.batch_size: expected an integer, got 1\.5"),
        ("data.batch_size=true", r"^data\.batch_size: expected an integer, got True"),
        ("data.batch_size='64'", r"^data\.batch_size: expected an integer, got '64'"),
        ("train.run_dir=5", r"^train\.run_dir: expected a string, got 5"),
        ("features.surfaces=home_feed", r"^features\.surfaces: expected a list"),
        ("model.mmoe.expert_dims=[64, x]", r"^model\.mmoe\.expert_dims\[1\]: expected an integer, got 'x'"),
        ("model.dcn=3", r"^model\.dcn: expected a mapping"),
        ("synth.faults.zero_fill_column=3", r"^synth\.faults\.zero_fill_column: expected a string, got 3"),
    ],
)
def test_wrong_type(override, pattern):
    assert_config_error(pattern, overrides=[override])


def test_wrong_type_inside_a_list_item():
    raw = demo_raw()
    i = table_index(raw, "item")
    raw["features"]["tables"][i]["hash"] = "yes"
    assert_config_error(rf"^features\.tables\[{i}\]\.hash: expected true/false, got 'yes'", raw)
    raw = demo_raw()
    raw["features"]["dense"][2]["dim"] = "32"
    assert_config_error(r"^features\.dense\[2\]\.dim: expected an integer, got '32'", raw)


def test_int_for_float_is_accepted_as_float():
    cfg = config.from_dict(demo_raw(), ["train.lr=1"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_required_key_missing():
    raw = demo_raw()
    del raw["features"]["tables"][0]["num_embeddings"]
    assert_config_error(r"^features\.tables\[0\]\.num_embeddings: required key is missing", raw)
    raw = demo_raw()
    del raw["features"]["sparse"][3]["column"]
    assert_config_error(r"^features\.sparse\[3\]\.column: required key is missing", raw)


# --------------------------------------------------------------------------------------------
# Sizes.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("num_embeddings", -5, r"^features\.tables\[2\]\.num_embeddings: must be > 0, got -5"),
        ("num_embeddings", 0, r"^features\.tables\[2\]\.num_embeddings: must be > 0, got 0"),
        ("embedding_dim", -1, r"^features\.tables\[2\]\.embedding_dim: must be > 0, got -1"),
    ],
)
def test_negative_table_size(field, value, pattern):
    raw = demo_raw()
    raw["features"]["tables"][2][field] = value
    assert_config_error(pattern, raw)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("data.batch_size=-1", r"^data\.batch_size: must be > 0, got -1"),
        ("data.batch_size=0", r"^data\.batch_size: must be > 0, got 0"),
        ("data.shuffle_buffer_rows=-1", r"^data\.shuffle_buffer_rows: must be >= 0, got -1"),
        ("data.num_workers=-2", r"^data\.num_workers: must be >= 0, got -2"),
        ("data.prefetch_factor=0", r"^data\.prefetch_factor: must be > 0, got 0"),
        ("model.mmoe.expert_dims=[64, -1]", r"^model\.mmoe\.expert_dims\[1\]: must be > 0, got -1"),
        ("model.sequence.num_heads=3", r"^model\.sequence\.num_heads: 3 does not divide d_model 32"),
        ("train.lr=-0.1", r"^train\.lr: must be > 0"),
    ],
)
def test_bad_size(override, pattern):
    assert_config_error(pattern, overrides=[override])


def test_calibration_needs_exactly_one_source_of_unseen_rows():
    assert_config_error(
        r"^data\.calibration_holdout: 0\.05 rows held out of training would go unused",
        overrides=["data.calibration_holdout=0.05"],
    )
    assert_config_error(
        r"^data\.calibration_holdout: model\.calibration 'surface' is fit on unseen rows",
        overrides=["data.calibration_dir=null"],
    )
    assert config.load(DEMO, ["data.calibration_dir=null", "model.calibration=none"]).data.calibration_dir is None


def test_bad_dense_and_sequence_sizes():
    raw = demo_raw()
    raw["features"]["dense"][0]["dim"] = 0
    assert_config_error(r"^features\.dense\[0\]\.dim: must be > 0, got 0", raw)
    raw = demo_raw()
    raw["features"]["sequence_groups"][1]["max_length"] = -3
    assert_config_error(r"^features\.sequence_groups\[1\]\.max_length: must be > 0, got -3", raw)
    raw = demo_raw()
    raw["features"]["dense"][1]["clip_max"] = -1.0
    assert_config_error(r"^features\.dense\[1\]\.clip_max: must exceed clip_min", raw)


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_non_finite_learning_rate(value):
    assert_config_error(r"^train\.lr:", overrides=[f"train.lr={value}"])


# --------------------------------------------------------------------------------------------
# References, literals, duplicates.
# --------------------------------------------------------------------------------------------


def test_reference_to_missing_table():
    raw = demo_raw()
    raw["features"]["sparse"][1]["table"] = "items"
    assert_config_error(r"^features\.sparse\[1\]\.table: no table named 'items' in features\.tables", raw)
    raw = demo_raw()
    raw["features"]["sequence_groups"][0]["features"][1]["table"] = "actions"
    assert_config_error(r"^features\.sequence_groups\[0\]\.features\[1\]\.table: no table named 'actions'", raw)


def test_reserved_group_name():
    raw = demo_raw()
    raw["features"]["sequence_groups"][0]["name"] = "candidate"
    assert_config_error(r"^features\.sequence_groups\[0\]\.name: 'candidate' is reserved", raw)


@pytest.mark.parametrize(
    "override,key",
    [
        ("data.nonfinite_dense=drop", "data.nonfinite_dense"),
        ("data.overlong_sequence=keep", "data.overlong_sequence"),
        ("train.embedding_optimizer=lamb", "train.embedding_optimizer"),
        ("train.dense_optimizer_kernel=cuda_graph", "train.dense_optimizer_kernel"),
        ("model.kind=tower", "model.kind"),
    ],
)
def test_invalid_literal(override, key):
    msg = assert_config_error("^" + re.escape(key) + ": must be one of", overrides=[override])
    assert repr(override.split("=")[1]) in msg


def test_invalid_literal_inside_a_list_item():
    raw = demo_raw()
    raw["features"]["sparse"][0]["pooling"] = "max"
    assert_config_error(r"^features\.sparse\[0\]\.pooling: must be one of \['sum', 'mean'\], got 'max'", raw)
    raw = demo_raw()
    raw["features"]["dense"][0]["norm"] = "zscore"
    assert_config_error(r"^features\.dense\[0\]\.norm: must be one of", raw)


def test_invalid_sharding_type():
    assert_config_error(
        r"^train\.sharding_types\[1\]: 'grid' is not one of", overrides=["train.sharding_types=[row_wise, grid]"]
    )


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("train.profile_steps=[3]", r"^train\.profile_steps: need \[first, last\] \(two steps\), got \[3\]"),
        ("train.profile_steps=[1, 2, 3]", r"^train\.profile_steps: need \[first, last\]"),
        ("train.profile_steps=[0, 2]", r"^train\.profile_steps\[0\]: must be > 0, got 0"),
        ("train.profile_steps=[5, 4]", r"^train\.profile_steps: last step 4 is before first step 5"),
        ("train.profile_steps=[5, 9]", r"^train\.profile_steps: last step 9 is after train\.max_steps 8"),
    ],
)
def test_bad_profile_steps(override, pattern):
    assert_config_error(pattern, overrides=["train.max_steps=8", override])


def test_profile_steps_name_a_range():
    assert config.from_dict(demo_raw(), ["train.profile_steps=[4, 4]"]).train.profile_steps == [4, 4]


@pytest.mark.parametrize(
    "section,index,name",
    [
        ("tables", 4, "user"),
        ("sparse", 3, "item_id"),
        ("dense", 2, "user_activity"),
        ("sequence_groups", 2, "pins"),
        ("tasks", 2, "click"),
    ],
)
def test_duplicate_names(section, index, name):
    raw = demo_raw()
    raw["features"][section][index]["name"] = name
    assert_config_error(f"^features\\.{section}\\[{index}\\]\\.name: duplicate name '{name}'", raw)


def test_duplicate_surfaces():
    assert_config_error(r"^features\.surfaces", overrides=["features.surfaces=[home_feed, home_feed, search]"])


@pytest.mark.parametrize("section", ["tasks", "surfaces"])
def test_empty_required_list(section):
    msg = assert_config_error(f"^features\\.{section}: required -- ", overrides=[f"features.{section}=[]"])
    assert "at least one" in msg
    raw = demo_raw()
    del raw["features"][section]  # no default either: a forgotten list is the same error
    assert assert_config_error(f"^features\\.{section}: required -- ", raw) == msg


# --------------------------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(path))} does not exist"):
        config.load(path)


@pytest.mark.parametrize("text", ["features: [unclosed\n", "a: b: c\n", "data:\n  batch_size: 1\n bad: 2\n"])
def test_invalid_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": not valid YAML"):
        config.load(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "5\n"], ids=["list", "string", "int"])
def test_yaml_root_not_a_mapping(tmp_path, text):
    path = tmp_path / "root.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": <root>: expected a mapping"):
        config.load(path)


def test_load_prefixes_the_file():
    with pytest.raises(ConfigError, match=re.escape(str(DEMO)) + r": data\.batch_size: must be > 0"):
        config.load(DEMO, ["data.batch_size=-4"])


# --------------------------------------------------------------------------------------------
# --set overrides.
# --------------------------------------------------------------------------------------------


def test_overrides_apply():
    cfg = config.load(
        DEMO,
        [
            "model.dcn.num_layers=3",  # nested, section absent from demo.yaml
            "train.lr=0.01",
            "model.mmoe.expert_dims=[64, 32, 16]",  # list value
            "train.sharding_types=[row_wise, table_wise]",
            "features.surfaces=[home_feed, search]",
            "synth.faults.zero_fill_column=user_activity",  # two levels below an absent key
            "train.run_dir=runs/a=b",  # '=' inside the value
            "data.batch_size=64",
            "data.batch_size=128",  # the last one wins
        ],
    )
    assert cfg.model.dcn.num_layers == 3
    assert cfg.model.dcn.low_rank == config.DCNConfig().low_rank  # siblings keep their defaults
    assert cfg.train.lr == 0.01
    assert cfg.model.mmoe.expert_dims == [64, 32, 16]
    assert cfg.train.sharding_types == ["row_wise", "table_wise"]
    assert cfg.features.surfaces == ["home_feed", "search"]
    assert cfg.synth.faults.zero_fill_column == "user_activity"
    assert cfg.train.run_dir == "runs/a=b"
    assert cfg.data.batch_size == 128
    assert cfg.data.shuffle_buffer_rows == 16384  # from the file, untouched


def test_override_can_set_null():
    cfg = config.load(DEMO, ["features.tasks=[{name: click, label_column: click}]", "features.sequence_groups=[]"])
    assert [t.name for t in cfg.features.tasks] == ["click"]
    assert cfg.features.tasks[0].true_probability_column is None
    assert cfg.features.sequence_groups == []


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("nokey", r"override 'nokey': expected key\.path=value"),
        (
            "features.tables.9.num_embeddings=5",
            r"override features\.tables\.9\.num_embeddings: features\.tables has 8 elements, no index 9",
        ),
        ("data.batch_size.x=1", r"override data\.batch_size\.x: data\.batch_size is not a mapping"),
    ],
)
def test_bad_override(override, pattern):
    assert_config_error(pattern, overrides=[override])


def test_overrides_do_not_modify_the_callers_dict():
    raw = demo_raw()
    before = copy.deepcopy(raw)
    config.from_dict(raw, ["data.batch_size=7", "model.dcn.num_layers=4"])
    assert raw == before


@pytest.mark.parametrize("text", ["1e-3", "5E-4"])
def test_exponent_notation_is_a_number(text):
    cfg = config.from_dict(demo_raw(), [f"train.lr={text}"])
    assert cfg.train.lr == float(text)


# --------------------------------------------------------------------------------------------
# Defaults; every shipped config loads.
# --------------------------------------------------------------------------------------------


MINIMAL = {"features": {"surfaces": ["feed"], "tasks": [{"name": "click", "label_column": "click"}]}}


def test_defaults_load():
    cfg = config.from_dict(copy.deepcopy(MINIMAL))
    want = config.ExperimentConfig()
    assert cfg.data == want.data
    assert cfg.synth == want.synth
    assert cfg.model == want.model
    assert cfg.train == want.train
    assert cfg.features.columns == want.features.columns
    assert cfg.features.surfaces == ["feed"]
    assert cfg.features.tasks == [config.TaskConfig(name="click", label_column="click")]


def test_no_task_is_an_error():
    assert_config_error(r"^features\.tasks: required -- the prediction tasks, at least one", raw={})


def test_no_default_is_the_demos_path_or_surface():
    # A config that forgot one would silently read or write the demo's files.
    defaults = config.ExperimentConfig()
    assert defaults.data.train_dir is None and defaults.data.eval_dir is None and defaults.train.run_dir is None
    assert defaults.features.surfaces == [] and defaults.features.tasks == []
    for key in config.REQUIRED:
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}: required -- {re.escape(config.REQUIRED[key])}$"):
            config.require(defaults, key)


def test_paths_are_required_by_the_tool_that_reads_them():
    cfg = config.from_dict(copy.deepcopy(MINIMAL))  # loads: the planner, build and inspect need no paths
    assert cfg.data.train_dir is None
    with pytest.raises(
        ConfigError, match=r"^data\.train_dir: required -- the directory of the training Parquet files$"
    ):
        config.require(cfg, "data.train_dir")
    with pytest.raises(ConfigError, match=r"^train\.run_dir: required -- "):
        config.require(config.from_dict(copy.deepcopy(MINIMAL), ["train.run_dir="]), "train.run_dir")  # empty
    assert config.require(config.load(DEMO), "data.eval_dir") == "data/demo/eval"


def test_training_requires_its_paths(tmp_path, capsys):
    from pinads_rec import train
    from pinads_rec.training.trainer import Trainer

    assert Trainer.REQUIRED_KEYS == ("data.train_dir", "data.eval_dir", "train.run_dir")
    assert set(Trainer.REQUIRED_KEYS) <= set(config.REQUIRED)
    raw = demo_raw()
    del raw["train"]["run_dir"]
    path = tmp_path / "no_run_dir.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^train\.run_dir: required -- "):
        Trainer(config.load(path))  # before any process group or file
    assert train.main(["--config", str(path)]) == 2
    assert "config error: train.run_dir: required -- " in capsys.readouterr().err


def test_demo_unstated_keys_take_defaults():
    cfg = config.load(DEMO)
    # The model's stated keys: the counts encoder with its pairs, and the match indicator.
    stated = config.ModelConfig(id_matches=cfg.model.id_matches)
    stated.sequence.encoders, stated.sequence.counts = cfg.model.sequence.encoders, cfg.model.sequence.counts
    assert cfg.model == stated and cfg.model.sequence.encoders == ["transformer", "counts"]
    assert cfg.train.warmup_steps == config.TrainConfig().warmup_steps
    assert cfg.data.nonfinite_dense == "error" and cfg.data.overlong_sequence == "truncate"
    assert cfg.features.table("user").hash and not cfg.features.table("item").hash
    assert cfg.features.sparse[0].pooling == "sum"


def test_config_round_trips_through_to_dict():
    cfg = config.load(DEMO)
    assert config.from_dict(copy.deepcopy(config.to_dict(cfg))) == cfg


def test_sections_declared_beside_their_owners_keep_their_keys():
    """synth:, build: and the encoders' keys are declared beside the generator, the build and the
    encoder registry; the config composes them, so a YAML file and --set name them as before."""
    cfg = config.load(
        DEMO,
        [
            "synth.num_users=7",
            "synth.drift.days=3",
            "build.timezone=Europe/Paris",
            "build.impressions.duplicates=error",
            "model.sequence.num_layers=2",
            "model.sequence.projection.dim=8",
            "model.sequence.din_hidden=[8]",
            "model.sequence.short_length=4",
            "model.sequence.period_boundaries_s=[60.0]",
            "model.sequence.hstu.num_heads=4",
            "model.sequence.retrieval.max_events=5",
        ],
    )
    assert (cfg.synth.num_users, cfg.synth.drift.days) == (7, 3)
    assert (cfg.build.timezone, cfg.build.impressions.duplicates) == ("Europe/Paris", "error")
    s = cfg.model.sequence
    assert (s.num_layers, s.projection.dim, s.din_hidden, s.short_length) == (2, 8, [8], 4)
    assert (s.period_boundaries_s, s.hstu.num_heads, s.retrieval.max_events) == ([60.0], 4, 5)
    assert_config_error(r"model\.sequence\.hstu\.num_heads: must be > 0", overrides=["model.sequence.hstu.num_heads=0"])


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=[p.name for p in ALL_CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = config.load(path)
    assert isinstance(cfg, config.ExperimentConfig)
    assert dataclasses.is_dataclass(cfg) and cfg.features.tasks


@pytest.mark.parametrize("path", ABLATIONS, ids=[p.name for p in ABLATIONS])
def test_every_shipped_ablation_loads_with_valid_variants(path):
    from pinads_rec.experiments.ablate import load_ablation

    ab = load_ablation(str(path))
    for quick in (False, True):
        common = ab.overrides + (ab.quick if quick else [])
        for v in ab.variants:
            assert config.load(REPO / ab.base, common + v.overrides).features.tasks, v.name


def test_ablations_sharing_a_data_directory_generate_the_same_data():
    # The runner regenerates a data directory whose synth settings differ from the file's: two files
    # sharing one with different settings would wipe each other's data on every run.
    from pinads_rec.experiments.ablate import load_ablation

    wanted = {}
    for path in ABLATIONS:
        ab = load_ablation(str(path))
        for quick in (False, True):
            cfg = config.load(REPO / ab.base, ab.overrides + (ab.quick if quick else []))
            data = str(Path(cfg.data.train_dir).parent)
            first = wanted.setdefault(data, (path.name, cfg.synth))
            assert first[1] == cfg.synth, f"{path.name} and {first[0]} generate different data into {data}"


def test_configs_dir_is_not_empty():
    assert ALL_CONFIGS, "configs/ holds no YAML"


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    """``extends:`` (config.read_yaml): the extended file under this one, mappings merged, lists and
    values replaced, the path relative to the extending file; a cycle is an error naming it."""
    (tmp_path / "sub").mkdir()
    relative = os.path.relpath(DEMO, tmp_path / "sub")
    (tmp_path / "sub" / "child.yaml").write_text(
        f"extends: {relative}\ndata: {{batch_size: 64}}\nfeatures:\n  surfaces: [a, b, c]\n"
    )
    demo, child = config.load(DEMO), config.load(tmp_path / "sub" / "child.yaml")
    assert child.data.batch_size == 64 and child.data.train_dir == demo.data.train_dir  # merged
    assert child.features.surfaces == ["a", "b", "c"] and child.features.tables == demo.features.tables  # replaced
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(config.ConfigError, match=r"extends .*a.yaml, which extends it back"):
        config.load(tmp_path / "a.yaml")


def test_the_shipped_configs_extending_the_demo_state_only_their_differences():
    demo = config.load(DEMO)
    two_tower = config.load(REPO / "configs" / "two_tower.yaml")
    assert two_tower.features.tables == demo.features.tables and two_tower.model.kind == "two_tower"
    assert [s.name for s in two_tower.features.sparse if s.user_side] == ["user_id", "context_topic", "query_tokens"]
    prod = config.load(REPO / "configs" / "prod_8gpu.yaml")
    assert prod.features.tasks == demo.features.tasks and prod.data.calibration_dir is None
