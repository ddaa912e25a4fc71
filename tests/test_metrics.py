"""Tests for pinads_rec.metrics: exact AUC (with ties, against brute force and torchmetrics), NE /
log loss / calibration, per-surface accumulation, and the cross-rank gather (one 2-rank launch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from pinads_rec.experiments.harness import run_ranks
from pinads_rec.metrics import (
    MetricAccumulator,
    auc,
    calibration,
    expected_calibration_error,
    format_table,
    gather_rows,
    gauc,
    log_loss,
    normalized_entropy,
)


def T(x):
    """float64 tensor, so hand-computed decimals (0.8, 0.4, ...) are represented exactly enough."""
    return torch.tensor(x, dtype=torch.float64)


def _pairwise_auc(scores, labels) -> float:
    """O(n^2) reference: P(score_pos > score_neg) + 1/2 P(tie)."""
    s = [float(x) for x in scores]
    y = [float(x) for x in labels]
    pos = [a for a, l in zip(s, y) if l > 0.5]
    neg = [a for a, l in zip(s, y) if l <= 0.5]
    total = 0.0
    for p in pos:
        for n in neg:
            total += 1.0 if p > n else (0.5 if p == n else 0.0)
    return total / (len(pos) * len(neg))


def _same(a, b, rel=1e-12) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == pytest.approx(b, rel=rel, abs=1e-15)


def row_differences(r1, r2) -> list:
    """Where two metric tables differ: [] when every row has the same keys and values."""
    if len(r1) != len(r2):
        return [f"{len(r1)} rows vs {len(r2)}"]
    out = []
    for a, b in zip(r1, r2):
        if a.keys() != b.keys():
            out.append((a.get("surface"), a.get("task"), "keys", sorted(a), sorted(b)))
            continue
        out += [(a["surface"], a["task"], k, a[k], b[k]) for k in a if not _same(a[k], b[k])]
    return out


# --------------------------------------------------------------------------------------------
# AUC
# --------------------------------------------------------------------------------------------


def test_auc_hand_example():
    # positive 0.35 beats negative 0.1 only, positive 0.8 beats both: 3 of 4 pairs.
    assert auc(T([0.1, 0.4, 0.35, 0.8]), T([0, 0, 1, 1])) == pytest.approx(0.75)


def test_auc_with_ties_hand_example():
    # positives: 0.3, 0.6, 0.6; negatives: 0.3, 0.6, 0.9.
    # pos 0.3: tie with neg 0.3 (1/2)            -> 0.5
    # pos 0.6: beats 0.3 (1), ties 0.6 (1/2)     -> 1.5, twice -> 3.0
    # 3.5 / 9 pairs
    scores = T([0.3, 0.3, 0.6, 0.6, 0.6, 0.9])
    labels = T([0, 1, 0, 1, 1, 0])
    assert auc(scores, labels) == pytest.approx(3.5 / 9)
    # order of examples is irrelevant
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert auc(scores[perm], labels[perm]) == pytest.approx(3.5 / 9)
    # all scores tied -> 0.5; perfect and inverted rankings
    assert auc(torch.full((6,), 0.4), labels) == pytest.approx(0.5)
    assert auc(T([0.1, 0.2, 0.8, 0.9]), T([0, 0, 1, 1])) == pytest.approx(1.0)
    assert auc(T([0.9, 0.8, 0.2, 0.1]), T([0, 0, 1, 1])) == pytest.approx(0.0)


def test_auc_one_class_is_nan():
    assert math.isnan(auc(T([0.1, 0.5, 0.9]), T([1, 1, 1])))
    assert math.isnan(auc(T([0.1, 0.5, 0.9]), T([0, 0, 0])))
    assert math.isnan(auc(T([]), T([])))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairwise_bruteforce_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = 300
    # coarse scores -> many ties; labels correlated with score
    scores = torch.randint(0, 25, (n,), generator=g).to(torch.float32) / 25
    labels = (torch.rand(n, generator=g) < 0.2 + 0.6 * scores).to(torch.float32)
    assert 0 < labels.sum() < n
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), rel=1e-12)
    # also continuous scores (float64, no ties)
    s2 = torch.rand(n, generator=g, dtype=torch.float64)
    assert auc(s2, labels) == pytest.approx(_pairwise_auc(s2, labels), rel=1e-12)


def _tied_scores_and_labels(seed, n=5000):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 40, (n,), generator=g).to(torch.float64) / 40  # many ties
    labels = (torch.rand(n, generator=g, dtype=torch.float64) < 0.1 + 0.5 * scores).to(torch.float64)
    return scores, labels


@pytest.fixture
def float64_by_default():
    """torchmetrics builds its ROC curve in the default dtype (float32): float64 for one test."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_agrees_with_torchmetrics_to_its_float32_precision(seed):
    scores, labels = _tied_scores_and_labels(seed)
    reference = binary_auroc(scores, labels.long())
    assert reference.dtype == torch.float32  # why pinads_rec.metrics computes AUC itself
    assert auc(scores, labels) == pytest.approx(float(reference), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_agrees_with_torchmetrics_in_float64_to_one_ulp(seed, float64_by_default):
    scores, labels = _tied_scores_and_labels(seed)
    assert auc(scores, labels) == pytest.approx(float(binary_auroc(scores, labels.long())), rel=0, abs=2.3e-16)


def test_metrics_take_numpy_arrays():
    scores, labels = _tied_scores_and_labels(3, n=300)
    assert auc(scores.numpy(), labels.numpy().astype(np.int64)) == auc(scores, labels)
    assert normalized_entropy(scores.numpy(), labels.numpy()) == normalized_entropy(scores, labels)


# --------------------------------------------------------------------------------------------
# Log loss / NE / calibration
# --------------------------------------------------------------------------------------------


def test_log_loss_ne_calibration_hand_example_balanced():
    probs, labels = T([0.8, 0.4]), T([1.0, 0.0])
    # -(ln 0.8 + ln 0.6) / 2
    assert log_loss(probs, labels) == pytest.approx(0.3669845875401002, rel=1e-12)
    # base rate 0.5 -> entropy ln 2
    assert normalized_entropy(probs, labels) == pytest.approx(0.3669845875401002 / math.log(2), rel=1e-12)
    assert normalized_entropy(probs, labels) == pytest.approx(0.5294468445267843, rel=1e-12)
    assert calibration(probs, labels) == pytest.approx(1.2)


def test_log_loss_ne_calibration_hand_example_skewed():
    probs, labels = T([0.1, 0.2, 0.3, 0.6]), T([0.0, 0.0, 0.0, 1.0])
    # -(ln .9 + ln .8 + ln .7 + ln .6) / 4
    assert log_loss(probs, labels) == pytest.approx(0.2990011586691898, rel=1e-12)
    # H(0.25) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446...
    assert normalized_entropy(probs, labels) == pytest.approx(0.2990011586691898 / 0.5623351446188083, rel=1e-12)
    assert calibration(probs, labels) == pytest.approx(1.2 / 1.0)
    # predicting the base rate everywhere gives NE == 1
    assert normalized_entropy(torch.full((4,), 0.25), labels) == pytest.approx(1.0, rel=1e-12)


def test_clamping_and_degenerate_cases():
    # p = 0 for a positive is clamped to 1e-7: loss = -ln(1e-7)
    assert log_loss(T([0.0]), T([1.0])) == pytest.approx(-math.log(1e-7), rel=1e-9)
    assert log_loss(T([1.0]), T([0.0])) == pytest.approx(-math.log(1e-7), rel=1e-6)
    assert math.isfinite(log_loss(T([0.0, 1.0]), T([0.0, 1.0])))
    # base rate 0 or 1 -> NE nan; no positives -> calibration nan
    assert math.isnan(normalized_entropy(T([0.2, 0.3]), T([0.0, 0.0])))
    assert math.isnan(normalized_entropy(T([0.2, 0.3]), T([1.0, 1.0])))
    assert math.isnan(calibration(T([0.2, 0.3]), T([0.0, 0.0])))
    assert math.isnan(log_loss(T([]), T([])))


# --------------------------------------------------------------------------------------------
# Accumulator
# --------------------------------------------------------------------------------------------


def _row(rows, surface, task):
    (r,) = [r for r in rows if r["surface"] == surface and r["task"] == task]
    return r


def test_accumulator_groups_by_surface():
    tasks = ["click", "save"]
    surfaces = ["home", "search", "related"]
    acc = MetricAccumulator(tasks, surfaces, has_oracle=True)
    # home: perfect ranking for click (AUC 1); search: inverted (AUC 0); related: the ties example.
    home_p = T([[0.1, 0.3], [0.2, 0.3], [0.8, 0.3], [0.9, 0.3]])
    home_y = T([[0, 0], [0, 1], [1, 0], [1, 1]])
    search_p = T([[0.9, 0.5], [0.8, 0.5], [0.2, 0.5], [0.1, 0.5]])
    search_y = T([[0, 1], [0, 0], [1, 1], [1, 0]])
    rel_s = T([0.3, 0.3, 0.6, 0.6, 0.6, 0.9])
    rel_p = torch.stack([rel_s, 1 - rel_s], 1)
    rel_y = torch.stack([T([0, 1, 0, 1, 1, 0]), T([0, 1, 0, 1, 1, 0])], 1)

    probs = torch.cat([home_p, search_p, rel_p])
    labels = torch.cat([home_y, search_y, rel_y])
    surface = torch.tensor([0] * 4 + [1] * 4 + [2] * 6, dtype=torch.int64)
    true = probs.clone()
    # feed in two interleaved batches (shuffled), plus garbage rows masked out by `valid`
    perm = torch.randperm(14, generator=torch.Generator().manual_seed(0))
    junk_p, junk_y = torch.full((3, 2), 0.99), torch.zeros(3, 2)
    junk_s = torch.tensor([0, 1, 2])
    for half in (perm[:7], perm[7:]):
        acc.update(
            torch.cat([probs[half], junk_p]),
            torch.cat([labels[half], junk_y]),
            torch.cat([surface[half], junk_s]),
            true_probs=torch.cat([true[half], junk_p]),
            valid=torch.cat([torch.ones(len(half), dtype=torch.bool), torch.zeros(3, dtype=torch.bool)]),
        )
    assert acc.num_examples == 14
    rows = acc.compute()
    assert [(r["surface"], r["task"]) for r in rows] == [(s, t) for s in surfaces + ["all"] for t in tasks]

    assert _row(rows, "home", "click")["auc"] == pytest.approx(1.0)
    assert _row(rows, "search", "click")["auc"] == pytest.approx(0.0)
    assert _row(rows, "related", "click")["auc"] == pytest.approx(3.5 / 9)
    assert _row(rows, "related", "save")["auc"] == pytest.approx(1 - 3.5 / 9)
    assert _row(rows, "home", "save")["auc"] == pytest.approx(0.5)  # constant prediction
    r = _row(rows, "home", "click")
    assert (r["examples"], r["positives"]) == (4, 2)
    assert r["calibration"] == pytest.approx((0.1 + 0.2 + 0.8 + 0.9) / 2)
    assert r["log_loss"] == pytest.approx(log_loss(home_p[:, 0], home_y[:, 0]))
    assert r["ne"] == pytest.approx(normalized_entropy(home_p[:, 0], home_y[:, 0]))
    # oracle == model here
    for r in rows:
        assert _same(r["oracle_auc"], r["auc"]) and _same(r["oracle_ne"], r["ne"])
        assert r["calibration_vs_truth"] == pytest.approx(1.0)
        assert r["ece"] >= 0.0

    a = _row(rows, "all", "click")
    assert (a["examples"], a["positives"]) == (14, 7)
    assert a["auc"] == pytest.approx(_pairwise_auc(probs[:, 0], labels[:, 0]))
    assert a["ne"] == pytest.approx(normalized_entropy(probs[:, 0], labels[:, 0]))
    assert a["calibration"] == pytest.approx(float(probs[:, 0].sum() / labels[:, 0].sum()))

    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert len({len(l) for l in lines}) == 1  # fixed width
    assert "AUC" in lines[0] and "lift" in lines[0] and "related" in table

    acc.reset()
    assert acc.num_examples == 0
    empty = acc.compute()
    assert all(r["examples"] == 0 and math.isnan(r["auc"]) for r in empty)


def test_accumulator_without_oracle_and_validation():
    acc = MetricAccumulator(["click"], ["home", "search"], has_oracle=False)
    acc.update(T([[0.2], [0.7], [0.6]]), T([[0.0], [1.0], [0.0]]), torch.tensor([0, 0, 1]))
    rows = acc.compute()
    assert all(r["oracle_auc"] is None and r["oracle_ne"] is None for r in rows)
    assert _row(rows, "home", "click")["auc"] == pytest.approx(1.0)
    assert math.isnan(_row(rows, "search", "click")["auc"])  # only negatives
    assert "-" in format_table(rows)
    with pytest.raises(ValueError):
        acc.update(T([[0.2]]), T([[0.0]]), torch.tensor([2]))  # surface index out of range
    with pytest.raises(ValueError):
        acc.update(T([[0.2, 0.1]]), T([[0.0, 0.0]]), torch.tensor([0]))  # wrong task count
    with pytest.raises(ValueError):
        MetricAccumulator(["click"], ["home"], has_oracle=True).update(T([[0.2]]), T([[0.0]]), torch.tensor([0]))


def test_update_copies_inputs():
    acc = MetricAccumulator(["click"], ["home"], has_oracle=False)
    p, y = T([[0.2], [0.7]]), T([[0.0], [1.0]])
    acc.update(p, y, torch.tensor([0, 0]))
    p.fill_(0.5)  # caller reuses its buffer
    assert acc.compute()[0]["auc"] == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------
# Distributed gather: one 2-rank launch, then one test per check.
# --------------------------------------------------------------------------------------------

_TASKS = ["click", "save", "hide"]
_SURFACES = ["home", "search", "related"]


def _rank_data(rank: int, n: int):
    g = torch.Generator().manual_seed(1000 + rank)
    true = torch.rand(n, len(_TASKS), generator=g)
    labels = (torch.rand(n, len(_TASKS), generator=g) < true).to(torch.float32)
    probs = (true + 0.3 * torch.randn(n, len(_TASKS), generator=g)).clamp(0, 1)
    probs = (probs * 20).round() / 20  # ties
    surface = torch.randint(0, len(_SURFACES), (n,), generator=g)
    valid = torch.rand(n, generator=g) < 0.9
    users = torch.randint(0, 25, (n,), generator=g) + 2**60  # past 2**53: not exact as float64
    return probs, labels, surface, true, valid, users


_RANK_SIZES = {0: 157, 1: 89}


def _fill(acc: MetricAccumulator, rank: int) -> None:
    probs, labels, surface, true, valid, users = _rank_data(rank, _RANK_SIZES[rank])
    for sl in (slice(0, 40), slice(40, None)):  # two batches per rank
        acc.update(probs[sl], labels[sl], surface[sl], true_probs=true[sl], valid=valid[sl], users=users[sl])


def _gathered_rows(rank: int) -> torch.Tensor:
    """float32 blocks of another length on each rank: 3 rows on rank 0, 1 on rank 1."""
    if rank == 0:
        return torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2) + 0.5
    return torch.tensor([[-1.25, 7.5]])


def _dist_worker(rank: int, world: int, out_dir: str) -> None:
    acc = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    _fill(acc, rank)
    rows = acc.compute()
    # second pass: rank 1 has no examples at all (zero-size contribution)
    acc2 = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    if rank == 0:
        _fill(acc2, 0)
    rows2 = acc2.compute()
    gathered = gather_rows(_gathered_rows(rank), group=None)
    result = {"rows": rows, "rows2": rows2, "gathered": gathered.tolist(), "gathered_dtype": str(gathered.dtype)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's results of _dist_worker, by rank."""
    result_dir = run_ranks(_dist_worker, 2, str(tmp_path_factory.mktemp("metrics_two_ranks")), timeout_s=120)
    return [json.loads(Path(result_dir, f"rank{rank}.json").read_text()) for rank in range(2)]


def test_row_differences_name_what_differs():
    rows = [{"surface": "all", "task": "click", "auc": 0.7}]
    assert row_differences(rows, [dict(rows[0])]) == []
    assert row_differences(rows, [dict(rows[0], auc=0.71)]) == [("all", "click", "auc", 0.7, 0.71)]
    assert row_differences(rows, []) == ["1 rows vs 0"]


@pytest.mark.slow  # the 2-rank launch of two_ranks
@pytest.mark.parametrize("rank", [0, 1])
def test_gathered_metrics_match_single_process(two_ranks, rank):
    ref = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    for r in range(2):
        _fill(ref, r)
    assert row_differences(two_ranks[rank]["rows"], ref.compute()) == []


def test_gathered_metrics_count_every_valid_example():
    ref = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    for r in range(2):
        _fill(ref, r)
    n_all = sum(int(_rank_data(r, n)[4].sum()) for r, n in _RANK_SIZES.items())
    assert sum(r["examples"] for r in ref.compute() if r["surface"] == "all") == n_all * len(_TASKS)


@pytest.mark.slow  # the 2-rank launch of two_ranks
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_without_examples_contributes_nothing(two_ranks, rank):
    ref0 = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    _fill(ref0, 0)
    assert row_differences(two_ranks[rank]["rows2"], ref0.compute()) == []


@pytest.mark.slow  # the 2-rank launch of two_ranks
@pytest.mark.parametrize("rank", [0, 1])
def test_gather_rows_concatenates_variable_lengths_in_rank_order(two_ranks, rank):
    assert two_ranks[rank]["gathered"] == torch.cat([_gathered_rows(0), _gathered_rows(1)]).tolist()


@pytest.mark.slow  # the 2-rank launch of two_ranks
@pytest.mark.parametrize("rank", [0, 1])
def test_gather_rows_keeps_the_dtype(two_ranks, rank):
    assert two_ranks[rank]["gathered_dtype"] == "torch.float32"


def test_gathered_metrics_include_gauc_over_every_ranks_users():
    ref = MetricAccumulator(_TASKS, _SURFACES, has_oracle=True, has_users=True)
    for r in range(2):
        _fill(ref, r)
    rows = ref.compute()
    assert all(0.0 < r["gauc"] < 1.0 and 0.0 < r["gauc_coverage"] <= 1.0 for r in rows)
    assert all(r["gauc"] is None for r in _one_surface_rows(has_users=False))


def _one_surface_rows(has_users: bool):
    acc = MetricAccumulator(["click"], ["home"], has_users=has_users)
    acc.update(
        T([[0.1], [0.9], [0.4], [0.6]]),
        T([[0], [1], [1], [0]]),
        torch.zeros(4, dtype=torch.int64),
        users=T([1, 1, 2, 2]),
    )
    return acc.compute()


def test_gather_rows_without_a_process_group_returns_its_input():
    rows = _gathered_rows(0)
    assert gather_rows(rows) is rows


def test_expected_calibration_error_hand_example():
    # two equal-count bins: {0.1, 0.1} with labels {0, 1} -> |0.2 - 1| = 0.8; {0.9, 0.9} with {1, 1} -> 0.2
    probs = torch.tensor([0.1, 0.9, 0.1, 0.9])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert expected_calibration_error(probs, labels, bins=2) == pytest.approx((0.8 + 0.2) / 4)
    # perfectly calibrated bins give 0, whatever the ranking quality
    assert expected_calibration_error(
        torch.full((10,), 0.3), torch.tensor([1.0] * 3 + [0.0] * 7), bins=1
    ) == pytest.approx(0.0, abs=1e-7)
    assert math.isnan(expected_calibration_error(torch.empty(0), torch.empty(0)))


# --------------------------------------------------------------------------------------------
# GAUC: impression-weighted per-user AUC.
# --------------------------------------------------------------------------------------------


def test_gauc_hand_example():
    # user 1: AUC 1 over 2 rows; user 2: AUC 0 over 2 rows; user 3: one class only, left out.
    scores, labels = T([0.1, 0.9, 0.4, 0.6, 0.5, 0.7]), T([0, 1, 1, 0, 1, 1])
    users = torch.tensor([1, 1, 2, 2, 3, 3])
    assert gauc(scores, labels, users) == (pytest.approx(0.5), pytest.approx(4 / 6))
    weighted = torch.tensor([1, 1, 1, 2, 2, 3])  # user 1: 3 rows AUC 1, user 2: 2 rows AUC 0 (a tie-free pair)
    assert gauc(T([0.1, 0.9, 0.2, 0.6, 0.4, 0.5]), T([0, 1, 0, 0, 1, 1]), weighted)[0] == pytest.approx(3 / 5 * 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gauc_matches_the_per_user_loop_with_ties(seed):
    g = np.random.default_rng(seed)
    n = 3000
    users = g.integers(0, 200, n) * 7919  # unsorted, sparse ids
    scores = np.round(g.random(n), 1)  # many ties within a user
    labels = (g.random(n) < 0.1 + 0.6 * scores).astype(np.float64)
    num = den = 0.0
    for u in np.unique(users):
        m = users == u
        if 0 < labels[m].sum() < m.sum():
            num += m.sum() * _pairwise_auc(scores[m], labels[m])
            den += m.sum()
    value, coverage = gauc(torch.from_numpy(scores), torch.from_numpy(labels), torch.from_numpy(users))
    assert value == pytest.approx(num / den, abs=1e-12)
    assert coverage == pytest.approx(den / n)


def test_gauc_without_a_user_of_both_classes_is_nan():
    value, coverage = gauc(T([0.2, 0.8]), T([1, 0]), torch.tensor([1, 2]))
    assert math.isnan(value) and coverage == 0.0
