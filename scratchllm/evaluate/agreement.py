"""Statistics of the scores: Wilson intervals for rates, and agreement between annotators
(Krippendorff's alpha, ordinal, by the `krippendorff` package; Fleiss' kappa)."""

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from scratchllm.extras import need

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n. (0, 1) when n == 0: nothing is known."""
    assert 0 <= k <= n
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def fleiss_kappa(counts: ArrayLike) -> float | None:
    """Fleiss' kappa of an [items, categories] table of how many raters put each item in each
    category; every item needs the same number n >= 2 of raters. None if chance agreement is
    total (every rating in one category): kappa is undefined there."""
    table = np.asarray(counts, dtype=np.float64)
    assert table.ndim == 2 and table.shape[0] >= 1
    n = table.sum(axis=1)
    assert np.all(n == n[0]) and n[0] >= 2, "Fleiss' kappa needs the same number (>= 2) of raters per item"
    n = n[0]
    p_item = ((table**2).sum(axis=1) - n) / (n * (n - 1))  # agreement within each item
    p_cat = table.sum(axis=0) / table.sum()
    p_bar, p_e = p_item.mean(), float((p_cat**2).sum())
    if math.isclose(p_e, 1.0):
        return None
    return float((p_bar - p_e) / (1 - p_e))


def ordinal_alpha(matrix: ArrayLike, value_domain: Sequence[float] = (-1, 0, 1)) -> float | None:
    """Krippendorff's alpha, ordinal, of a [coders, units] matrix with NaN where a coder did not
    score a unit. None when it is undefined (fewer than two pairable values, or one value only)."""
    krippendorff = need("krippendorff", "eval report's agreement (Krippendorff's alpha)")
    data = np.asarray(matrix, dtype=np.float64)
    pairable = (np.sum(~np.isnan(data), axis=0) >= 2).sum()
    values = np.unique(data[~np.isnan(data)])
    if data.size == 0 or pairable == 0 or len(values) < 2:
        return None
    return float(krippendorff.alpha(reliability_data=data, value_domain=list(value_domain),
                                    level_of_measurement="ordinal"))
