"""The two-tower ad table (serve/ad_table.py): every distinct item's ad vectors written once, read
back, and scores from the table equal the model's own."""

import os

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, tiny_overrides

from pinads_rec import config
from pinads_rec.models import build_model
from pinads_rec.serve.ad_table import export_ad_embeddings, item_ids, load_ad_table, score_with_ad_table
from pinads_rec.serve.batching import file_order_batches


@pytest.fixture(scope="module")
def two_tower(tiny_data):
    """(an untrained two-tower model in eval mode, its config, the eval batches in file order)."""
    cfg = config.load(os.path.join(REPO, "configs", "two_tower.yaml"), tiny_overrides(tiny_data[1]))
    torch.manual_seed(0)
    model = build_model(cfg.features, cfg.model)
    model.eval()
    return model, cfg, list(file_order_batches(cfg, cfg.data.eval_dir))


@pytest.fixture(scope="module")
def exported(two_tower, tmp_path_factory):
    """(the ad table's path, the number of items export_ad_embeddings reported)."""
    model, _, batches = two_tower
    path = tmp_path_factory.mktemp("ad_table") / "ads.parquet"
    return path, export_ad_embeddings(model, batches, path)


def test_export_writes_every_distinct_item_once(two_tower, exported):
    model, cfg, batches = two_tower
    path, n = exported
    seen = torch.cat([item_ids(model, b)[b.valid] for b in batches]).unique()
    table = pq.read_table(path)
    assert n == len(seen) == table.num_rows  # every distinct item, once
    assert table.column_names == ["item_id"] + [t.name for t in cfg.features.tasks]
    assert table.schema.field("click").type.list_size == cfg.model.two_tower.embedding_dim
    assert torch.equal(load_ad_table(path).ids, seen)


@pytest.mark.slow
def test_scores_from_the_ad_table_equal_the_models(two_tower, exported):
    model, _, batches = two_tower
    ads = load_ad_table(exported[0])
    worst = 0.0
    with torch.no_grad():
        for b in batches:
            raw, calibrated = model.scores(b)
            raw_t, calibrated_t = score_with_ad_table(model, b, ads)
            worst = max(worst, float((calibrated_t - calibrated).abs().max()), float((raw_t - raw).abs().max()))
    assert worst < 1e-4, worst


def test_an_item_missing_from_the_table_is_a_key_error(exported):
    with pytest.raises(KeyError, match="missing from the ad table"):
        load_ad_table(exported[0]).lookup(torch.tensor([10**9]))
