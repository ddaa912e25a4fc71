"""Early interaction (pinads_rec/modules/early_interaction.py): the cosine features equal a direct
computation, padding stays zero, the extra tokens are the projected representations."""

import torch
import torch.nn.functional as F
from sequence_inputs import L, W
from sequence_inputs import padded as _padded

from pinads_rec.modules.early_interaction import EarlyInteraction


def test_cosine_features_match_a_direct_computation():
    torch.manual_seed(0)
    early = EarlyInteraction(W, {"candidate": 5, "user": 3}, cosine=["candidate", "user"], tokens=["user"]).eval()
    events, mask = _padded([4, 2])
    reps = {"candidate": torch.randn(2, 5), "user": torch.randn(2, 3)}
    out, tokens = early(events, mask, reps)
    for u in range(2):
        cos = torch.stack(
            [
                F.cosine_similarity(events[u], early.cosine_projections[n](reps[n][u]).expand(L, W), dim=1)
                for n in ("candidate", "user")
            ],
            dim=1,
        )  # [L, 2]
        expected = events[u] + early.cosine_attributes(cos) * mask[u].unsqueeze(-1)
        torch.testing.assert_close(out[u], expected, rtol=1e-5, atol=1e-6)
    assert (out[~mask] == 0).all(), "padding stays zero"
    torch.testing.assert_close(tokens[:, 0], early.token_projections["user"](reps["user"]))
