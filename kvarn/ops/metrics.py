"""Divergences between next-token distributions, in float64: what the core's checks and the lab's analyses share.

    log_probs(z)            = log_softmax(z) over the last axis, in float64
    KL(p_ref || p)          = sum_v exp(lp_ref[v]) (lp_ref[v] - lp[v])
"""

from __future__ import annotations

import torch


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) over the last axis, in float64, per position."""
    return kl_from_log_probs(log_probs(ref_logits), log_probs(logits))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, in float64."""
    return torch.log_softmax(logits.double(), dim=-1)


def kl_from_log_probs(lp_ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) = sum exp(lp_ref) (lp_ref - lp) over the last axis, from float64 log-probabilities (lets a
    caller comparing many runs with one reference compute each log softmax once)."""
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1)
