"""Surface calibration (pinads_rec/modules/calibration.py): a map per surface x task (or one shared
per task), the fit recovering planted maps, and the guard on a fit that leaves the scale range or
collapses the predictions."""

import pytest
import torch

from pinads_rec.modules.calibration import SCALE_RANGE, Calibration, guarded_maps


def test_calibration_maps_each_surface_and_task_separately():
    cal = Calibration(num_surfaces=3, num_tasks=2, mode="surface")
    with torch.no_grad():
        cal.scale.copy_(torch.tensor([[1.0, 2.0], [0.5, 1.0], [1.0, 1.0]]))
        cal.bias.copy_(torch.tensor([[0.0, 0.0], [-1.0, 0.0], [0.0, 3.0]]))
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    out = cal.eval()(logits, torch.tensor([0, 1, 2]))
    assert out.tolist() == [[1.0, 2.0], [-0.5, 1.0], [1.0, 4.0]]
    shared = Calibration(3, 2, mode="global").eval()
    with torch.no_grad():
        shared.scale.copy_(torch.tensor([[2.0, 1.0]] * 3))
    assert shared(logits, torch.tensor([0, 1, 2])).tolist() == [[2.0, 1.0]] * 3
    assert Calibration(3, 2, mode="none")(logits, torch.tensor([0, 1, 2])) is logits


@pytest.mark.slow
def test_calibration_fit_recovers_planted_maps():
    g = torch.Generator().manual_seed(0)
    n = 200_000
    surface = torch.randint(0, 3, (n,), generator=g)
    z = torch.randn(n, 2, generator=g) * 1.5 - 3.0  # rare positives, like engagement labels
    true_a = torch.tensor([[0.7, 1.0], [1.0, 1.3], [1.2, 0.9]])
    true_b = torch.tensor([[-0.4, 0.0], [0.3, -0.2], [0.0, 0.5]])
    labels = torch.bernoulli(torch.sigmoid(z * true_a[surface] + true_b[surface]), generator=g)
    cal = Calibration(3, 2, mode="surface")
    cal.fit(z, labels, surface)
    assert (cal.scale - true_a).abs().max() < 0.1 and (cal.bias - true_b).abs().max() < 0.25
    with torch.no_grad():
        p = torch.sigmoid(cal(z, surface))
    for s in range(3):  # the fit's own calibration ratio is 1 on every surface and task
        ratio = p[surface == s].sum(0) / labels[surface == s].sum(0)
        assert torch.allclose(ratio, torch.ones(2), atol=1e-3)
    shared = Calibration(3, 2, mode="global")
    shared.fit(z, labels, surface)
    assert (shared.scale == shared.scale[0]).all() and (shared.bias == shared.bias[0]).all()
    with torch.no_grad():
        p = torch.sigmoid(shared(z, surface))
    assert torch.allclose(p.sum(0) / labels.sum(0), torch.ones(2), atol=1e-3)  # right on average only
    cal.reset()
    assert torch.equal(cal(z, surface), z)


def nearly_constant(centre, rate, n=5000, spread=1e-3, seed=0):
    """Raw logits of a cell where the backbone learned nothing (``centre`` +- ``spread`` noise) and
    labels of rate ``rate`` unrelated to them."""
    g = torch.Generator().manual_seed(seed)
    return centre + spread * torch.randn(n, 1, generator=g), (torch.rand(n, 1, generator=g) < rate).float()


def predictions(cal, z, surface=None):
    with torch.no_grad():
        return torch.sigmoid(cal(z, torch.zeros(z.shape[0], dtype=torch.long) if surface is None else surface))


def test_calibration_of_nearly_constant_logits_converges_to_the_label_rate(caplog):
    # Undamped Newton sent this fit to scale 21,361, bias -3,560: every prediction 0 (the
    # MovieLens collapse). The damped one reaches the optimum: nearly constant, at the rate.
    z, y = nearly_constant(-6.0, 0.3)
    cal = Calibration(1, 1)
    with caplog.at_level("WARNING", logger="pinads_rec.modules.calibration"):
        assert cal.fit(z, y, torch.zeros(len(z), dtype=torch.long)) == []
    assert not caplog.records
    assert SCALE_RANGE[0] <= float(cal.scale) <= SCALE_RANGE[1]
    p = predictions(cal, z)
    assert abs(float(p.mean()) - float(y.mean())) < 0.02 and float(p.std()) < 1e-3
    assert torch.unique(p).numel() > 1000


def test_a_fit_whose_scale_leaves_the_range_is_clamped_and_says_so(caplog):
    # Positive logits that do not rank, on a 5% rate: the prior's pull gives a negative scale (the
    # cell's ranking inverted). Clamped to 0.05, the bias refit: the rate is kept.
    z, y = nearly_constant(2.0, 0.05)
    cal = Calibration(3, 1)
    surface = torch.full((len(z),), 1, dtype=torch.long)
    with caplog.at_level("WARNING", logger="pinads_rec.modules.calibration"):
        (refused,) = cal.fit(z, y, surface, ["home_feed", "related_pins", "search"], ["click"])
    assert (
        refused.rules == ("scale",)
        and refused.fitted[0] < 0
        and cal.scale[1, 0].item() == pytest.approx(SCALE_RANGE[0])
    )
    assert cal.scale[[0, 2], 0].tolist() == [1.0, 1.0]  # cells without rows keep the identity
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert message.startswith(f"calibration related_pins x click: refused scale {refused.fitted[0]:.6g}")
    assert "scale outside [0.05, 20]; raw logits std 0.000" in message and "range [1.99" in message
    assert "used scale 0.05, bias " in message and "instead (scale clamped, bias refit;" in message
    p = predictions(cal, z, surface)
    assert abs(float(p.mean()) / float(y.mean()) - 1) < 0.02
    # Nearly constant logits whose noise happens to separate the labels: stretched past 20.
    g = torch.Generator().manual_seed(1)
    z = -2.0 + 0.03 * torch.randn(20000, 1, generator=g)
    shared = Calibration(3, 1, mode="global")
    with caplog.at_level("WARNING", logger="pinads_rec.modules.calibration"):
        (refused,) = shared.fit(z, (z > -2.0).float(), torch.randint(0, 3, (20000,), generator=g), None, ["save"])
    assert refused.fitted[0] > SCALE_RANGE[1] and shared.scale[:, 0].tolist() == [SCALE_RANGE[1]] * 3
    assert caplog.records[-1].getMessage().startswith("calibration all surfaces x save: refused scale 26.")


def test_a_map_that_collapses_the_predictions_falls_back_to_bias_only():
    # A scale in range that saturates every row to 0 or 1: two distinct predictions of 4000.
    g = torch.Generator().manual_seed(0)
    z = torch.where(torch.rand(4000, generator=g) < 0.5, 6.0, -6.0) + 0.01 * torch.randn(4000, generator=g)
    y, groups = (z > 0).float(), torch.zeros(4000, dtype=torch.long)
    scale, bias, (refused,) = guarded_maps(z, y, groups, 1, maps=(torch.tensor([20.0]), torch.tensor([0.0])))
    assert refused.rules == ("resolution",) and refused.distinct_refused == 2 and refused.distinct_raw > 2000
    assert float(scale) == 1.0 and refused.distinct_used > 2000
    assert "keeps 2 distinct predictions of the raw logits'" in refused.describe("search", "click")
    assert abs(float(torch.sigmoid(z + bias).mean()) - float(y.mean())) < 0.01
    # The collapsed fit of the nearly constant logits above, had it been returned: refused too.
    z, y = nearly_constant(-6.0, 0.3)
    maps = (torch.tensor([21361.0]), torch.tensor([-3560.0]))
    scale, bias, (refused,) = guarded_maps(z[:, 0], y[:, 0], groups[:1].expand(len(z)), 1, maps=maps)
    assert refused.rules == ("scale",) and refused.distinct_refused < 10 and float(scale) == SCALE_RANGE[1]
    assert abs(float(torch.sigmoid(z[:, 0] * scale + bias).mean()) - float(y.mean())) < 0.02
