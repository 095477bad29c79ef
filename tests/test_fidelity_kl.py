"""`fidelity.kl_per_position` against values computed by hand.

The profiler and the fidelity harness share this one function, so they cannot catch each other's mistakes in it: these
tests pin its direction (`KL(exact || cache)`, the measure of LoopKV Sec. 2.3 and RIPE Table 4), its units (nats) and
its invariances against closed-form numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_loopcache.fidelity import FidelityReport, kl_per_position


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_is_exact_against_cache_by_hand():
    """p = (1/2, 1/2) exact, q = (9/10, 1/10) cache: KL(p || q) = 1/2 ln(5/9) + 1/2 ln 5 = ln(5/3) = 0.5108 nats,
    while the reversed KL(q || p) = 9/10 ln(9/5) + 1/10 ln(1/5) = 0.3681."""
    kl = kl_per_position(_logits([0.5, 0.5]), _logits([0.9, 0.1]))
    assert kl.dtype == torch.float32 and kl.shape == ()
    assert kl.item() == pytest.approx(math.log(5 / 3), rel=1e-6)
    assert kl.item() != pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), rel=1e-2)


def test_kl_per_position_shapes_and_invariances():
    """Row by row over leading dims, in nats; a constant shift of either row's logits changes nothing; equal rows
    give 0; a one-hot-like reference gives -log q of its token."""
    ref = torch.stack([_logits([0.5, 0.5, 1e-300]), _logits([0.25, 0.25, 0.5]), _logits([1.0, 1e-300, 1e-300])])
    arm = torch.stack([_logits([0.9, 0.1, 1e-300]), _logits([0.25, 0.25, 0.5]), _logits([0.2, 0.3, 0.5])])
    kl = kl_per_position(ref[None] + 3.0, arm[None] - 7.0)  # [1, 3]
    assert kl.shape == (1, 3)
    expected = torch.tensor([[math.log(5 / 3), 0.0, -math.log(0.2)]])
    torch.testing.assert_close(kl.double(), expected.double(), atol=1e-6, rtol=1e-6)


def test_kl_of_a_shifted_two_token_softmax():
    """Two tokens with logit gaps a (exact) and b (cache): p = sigmoid(a), q = sigmoid(b),
    KL = p ln(p/q) + (1-p) ln((1-p)/(1-q))."""
    a, b = 1.3, -0.4
    p, q = 1 / (1 + math.exp(-a)), 1 / (1 + math.exp(-b))
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    kl = kl_per_position(torch.tensor([a, 0.0]), torch.tensor([b, 0.0]))
    assert kl.item() == pytest.approx(expected, rel=1e-5)
    reverse = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    assert abs(expected - reverse) > 1e-2  # the case tells the two directions apart


def test_report_summaries_by_hand():
    kl = torch.tensor([0.0, 0.05, 0.2, 0.5])
    report = FidelityReport(kl, torch.tensor([True, True, False, True]))
    assert report.positions == 4 and report.tail == 2  # KL > 0.1
    assert report.mean_kl == pytest.approx(0.1875) and report.max_kl == pytest.approx(0.5)
    assert report.top1_agreement == pytest.approx(0.75) and report.to_dict()["flips"] == 1
