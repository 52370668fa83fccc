"""The per-layer prediction benchmark (``python -m benchmarks.prediction``, docs/results/prediction.md)
on its smallest models: the analysis' per-layer numbers against one measured float32 step."""

from __future__ import annotations

import math

import pytest

from benchmarks.prediction import agreement, compare, markdown, models, spearman, within


def test_rank_correlation_and_tolerances() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)  # ties at their average rank
    assert math.isnan(spearman([1, 2], [1, 2])) and math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert within("grad_max", 1.9, 1.0) and not within("grad_max", 2.1, 1.0) and not within("grad_max", 0.0, 1e-9)
    assert within("grad_underflow", 0.35, 0.3) and not within("grad_underflow", 0.45, 0.3)
    a = agreement([("a", 1.0, 1.0), ("b", None, 2.0), ("c", 9.0, 3.0)], "grad_max")
    assert (a.measured, a.compared, a.unknown, a.within) == (3, 2, 1, 0.5)
    assert a.outliers == (("c", 9.0, 3.0),)


def test_test_models_layers_rank_as_measured() -> None:
    """The test MLP and transformer (a causal SDPA attention and a written-out masked one): every
    layer predicted, the magnitudes ranked as measured, within 2x."""
    available = models()
    for name in ("mlp", "transformer"):
        r = compare(available[name])
        for quantity in ("grad_max", "forward_max"):
            a = agreement(r.pairs(quantity), quantity)
            assert a.unknown == 0, (name, quantity)
            assert a.rank_correlation >= 0.8, (name, quantity, a)
            assert a.within >= 0.9, (name, quantity, a.outliers)
    assert "| transformer |" in markdown([r], machine="test", minutes=0.0)


def test_gpt2_attention_layers_are_predicted() -> None:
    """Issue 21's GPT-2: its attention projections are ``torch.addmm`` and its SDPA attention is
    causal, and it returns its KV cache beside its logits. Every layer's numbers are predicted
    (``c_attn``'s weight underflow was unknown and reported as 1), c_attn's weight-gradient
    underflow within 0.1 of the measured share, the incoming gradients' maxima ranked as measured."""
    pytest.importorskip("transformers", reason="the zoo's models come from transformers: pip install -e '.[zoo]'")
    r = compare(models()["gpt2"])
    for layer in ("0:transformer.h.0.attn.c_attn", "0:transformer.h.1.attn.c_attn"):
        predicted, measured = r.predicted[layer].weight_underflow, r.measured[layer].weight_underflow
        assert predicted is not None and measured is not None
        assert abs(predicted - measured) <= 0.1, (layer, predicted, measured)
    for quantity in ("weight_grad_max", "grad_max"):
        a = agreement(r.pairs(quantity), quantity)
        assert a.unknown == 0 and a.rank_correlation >= 0.9 and a.within >= 0.6, (quantity, a)
