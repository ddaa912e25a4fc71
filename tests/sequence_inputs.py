"""Padded sequence inputs shared by the sequence modules' tests: ``W``-wide events, ``L`` slots."""

import torch

W, L = 8, 6


def padded(lengths, seed=0):
    """[U, L, W] events (zeros past each unit's length) and their [U, L] mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    events = torch.randn(len(lengths), L, W, generator=g) * mask.unsqueeze(-1)
    return events, mask


def perturb_padding(events, mask, value=1e3):
    """``events`` with every padding slot set to ``value``."""
    out = events.clone()
    out[~mask] = value
    return out
