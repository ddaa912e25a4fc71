"""Any valid feature layout trains, plans, serves and exports: a TorchRec collection the layout gives
no table (``ebc`` without per-row pooled features, ``user_ebc`` without user-side ones, ``ec``
without sequence groups) is left out, and the pipeline still pipelines the ones present. A layout
the training cannot run (no input; dense features alone, no embedding table) is a ConfigError when
its model is built.

One 2-rank launch trains every layout (the demo config with features dropped, and the Taobao config
without its per-row pooled features on its built fixture); the serving checks reuse its runs."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO, REPO, train_few_steps
from dataset_fixtures import write_taobao

from pinads_rec import config

TAOBAO = Path(REPO) / "configs" / "datasets" / "taobao_ad.yaml"
TAOBAO_ROW_BAGS = ("adgroup_id", "campaign_id", "customer")  # the layout: every candidate feature shared


def sparse_without(path, names):
    """An override setting features.sparse to the config's own minus ``names``."""
    sparse = config.to_dict(config.load(path))["features"]["sparse"]
    return "features.sparse=" + json.dumps([s for s in sparse if s["name"] not in names])


# Without sparse features there are no candidate ids to count or match.
NO_CANDIDATE_IDS = ["model.sequence.encoders=[transformer]", "model.id_matches=[]"]

# name -> (overrides of the demo config, the collections the model has and the pipeline pipelines)
DEMO_LAYOUTS = {
    "no_row_bags": ([sparse_without(DEMO, ("advertiser_id", "ad_type"))], ["ec", "user_ebc"]),
    "no_user_side": ([sparse_without(DEMO, ("user_id", "query_tokens"))], ["ebc", "ec"]),
    "no_sequences": (["features.sequence_groups=[]"], ["ebc", "user_ebc"]),
    "dense_and_sequences": (["features.sparse=[]"] + NO_CANDIDATE_IDS, ["ec"]),
    "two_tower_dense_and_sequences": (["features.sparse=[]", "model.kind=two_tower"] + NO_CANDIDATE_IDS, ["ec"]),
}


def taobao_overrides(out: Path):
    """The Taobao config's features (minus its per-row pooled ones) and model on the demo's training
    settings, pointed at a build of the fixture."""
    raw = config.to_dict(config.load(TAOBAO))
    features = dict(raw["features"], sparse=[s for s in raw["features"]["sparse"] if s["name"] not in TAOBAO_ROW_BAGS])
    return [
        f"features={json.dumps(features)}",
        f"model={json.dumps(raw['model'])}",
        f"data.train_dir={out / 'train'}",
        f"data.calibration_dir={out / 'calibration'}",
        f"data.eval_dir={out / 'eval'}",
    ]


@pytest.fixture(scope="module")
def layouts(tiny_data, tmp_path_factory):
    """(name -> train_few_steps' result, name -> its run directory)."""
    from pinads_rec.data.build import build

    _, data_dir = tiny_data
    tmp = tmp_path_factory.mktemp("layouts")
    out = tmp / "taobao"
    write_taobao(tmp / "taobao_raw")
    overrides = [f"data.train_dir={out / 'train'}", f"data.calibration_dir={out / 'calibration'}"]
    overrides += [f"data.eval_dir={out / 'eval'}", "build.requests_per_row_group=64"]  # a few row groups per rank
    build(config.load(TAOBAO, overrides), str(tmp / "taobao_raw"), str(out))
    variants = [(name, o) for name, (o, _) in DEMO_LAYOUTS.items()] + [("taobao_no_row_bags", taobao_overrides(out))]
    results = train_few_steps(tmp, data_dir, variants)
    return results, {name: str(tmp / "runs" / str(i)) for i, (name, _) in enumerate(variants)}


@pytest.mark.slow
def test_every_layout_trains_pipelining_the_collections_it_has(layouts):
    results, _ = layouts
    expected = {name: pipelined for name, (_, pipelined) in DEMO_LAYOUTS.items()}
    expected["taobao_no_row_bags"] = ["ec", "user_ebc"]
    assert list(results) == list(expected)
    for name, r in results.items():
        assert r["steps"] == 3 and r["finite"], (name, r)
        assert sorted(m.rsplit(".", 1)[-1] for m in r["pipelined"]) == expected[name], (name, r)


@pytest.mark.slow
def test_layouts_without_bag_tables_serve_and_export(layouts, tiny_data):
    """The checkpoints load into the unsharded model, its absent collections absent, and score; the
    exported program, its empty KJTs included, scores a batch as the eager model does (exported for
    one layout only: a trace costs 3-13 s)."""
    from pinads_rec.serve.batching import file_order_batches
    from pinads_rec.serve.export import export_program, flat_inputs
    from pinads_rec.serve.scoring import Predictor

    _, runs = layouts
    for name in ("no_row_bags", "dense_and_sequences"):
        predictor = Predictor.from_run(runs[name], precision="fp32")
        model = predictor.model
        assert model.ebc is None and (model.user_ebc is None) == (name == "dense_and_sequences"), name
        batch = next(iter(file_order_batches(predictor.cfg, str(tiny_data[1] / "eval"), 64)))
        expected = predictor.score_batch(batch)
        assert batch.sparse.keys() == [] and expected.shape == (64, 3) and bool(expected.isfinite().all()), name
    program = export_program(model, predictor.cfg.features, batch)
    assert float((program.module()(*flat_inputs(batch)) - expected).abs().max()) < 1e-5


@pytest.mark.slow
def test_plan_covers_the_tables_present():
    from pinads_rec import plan

    report = plan.plan(config.load(DEMO, ["features.sparse=[]"] + NO_CANDIDATE_IDS), plan.PlanSpec(world_size=2))
    assert sorted(report["tables"]) == ["action", "item", "seq_query_token", "topic"]
    assert {t["module"].rsplit(".", 1)[-1] for t in report["tables"].values()} == {"ec"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["features.sparse=[]", "features.dense=[]", "features.sequence_groups=[]"] + NO_CANDIDATE_IDS,
            "the model has no input",
        ),
        # Dense features alone: no sharded collection, which TrainPipelineSparseDist cannot trace around.
        (["features.sparse=[]", "features.sequence_groups=[]"] + NO_CANDIDATE_IDS, "no embedding table"),
        (
            [sparse_without(DEMO, ("item_id", "advertiser_id", "ad_type", "item_topic", "context_topic"))]
            + [
                "features.dense=[{name: user_activity, column: user_activity, user_side: true}]",
                "model.kind=two_tower",
            ]
            + NO_CANDIDATE_IDS,
            "needs a candidate-side feature for its ad tower",
        ),
    ],
    ids=["nothing", "dense_only", "two_tower_without_ad_features"],
)
def test_a_layout_the_training_cannot_run_is_a_config_error(overrides, message):
    from pinads_rec.models import build_model

    cfg = config.load(DEMO, overrides)  # loads: the data tools read such configs too
    with pytest.raises(config.ConfigError, match=message):
        build_model(cfg.features, cfg.model, device=torch.device("meta"))
