"""core.methods.stats against independent computations: numpy's corrcoef for
Pearson, and Spearman from ranks averaged by hand over each tie."""

import numpy as np
import pytest

from core.methods.stats import pearson, ranks, spearman


def _mean_ranks_by_hand(x):
    """Rank of each value: the mean of the 0-based places its copies occupy once sorted."""
    ordered = sorted(x)
    return np.array([np.mean([i for i, v in enumerate(ordered) if v == value]) for value in x])


def test_pearson_is_numpys_corrcoef():
    rng = np.random.default_rng(0)
    for n in (3, 7, 50):
        x, y = rng.normal(size=n), rng.normal(size=n)
        assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12, abs=1e-15)


def test_ties_get_their_mean_rank():
    x = [3.0, 1.0, 3.0, 2.0, 3.0, 1.0]
    assert ranks(x).tolist() == _mean_ranks_by_hand(x).tolist() == [4.0, 0.5, 4.0, 2.0, 4.0, 0.5]


def test_spearman_is_pearson_of_mean_ranks():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=30).astype(float)  # many ties
    y = x + rng.integers(0, 3, size=30)
    expected = np.corrcoef(_mean_ranks_by_hand(x), _mean_ranks_by_hand(y))[0, 1]
    assert spearman(x, y) == pytest.approx(expected, rel=1e-12)
    # monotone maps do not change it; reversing one side flips its sign
    assert spearman(x, np.exp(y)) == pytest.approx(expected, rel=1e-12)
    assert spearman(x, -y) == pytest.approx(-expected, rel=1e-12)


def test_undefined_cases_are_none():
    assert pearson([1.0, 2.0], [2.0, 1.0]) is None  # fewer than three pairs
    assert spearman([1.0, 2.0], [2.0, 1.0]) is None
    assert pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # a constant side
    assert spearman([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) is None


def test_vectors_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="one length"):
        pearson([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="one length"):
        spearman([[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0]])
