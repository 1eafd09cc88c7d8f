"""Agreement and intervals against published values: Krippendorff (2011) reliability data,
Fleiss (1971) as worked on Wikipedia, Newcombe's (1998) Wilson interval for 81 of 263."""

import math

import numpy as np
import pytest

from scratchllm.evaluate.agreement import fleiss_kappa, ordinal_alpha, wilson

NAN = math.nan
# Krippendorff, "Computing Krippendorff's Alpha-Reliability" (2011): 4 observers x 12 units, values 1..5.
KRIPPENDORFF_2011 = [
    [1, 2, 3, 3, 2, 1, 4, 1, 2, NAN, NAN, NAN],
    [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, NAN, 3],
    [NAN, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, NAN],
    [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, NAN],
]


def test_krippendorff_published_ordinal_value():
    assert round(ordinal_alpha(KRIPPENDORFF_2011, value_domain=(1, 2, 3, 4, 5)), 3) == 0.815  # the paper's ordinal
    import krippendorff

    nominal = krippendorff.alpha(reliability_data=KRIPPENDORFF_2011, level_of_measurement="nominal")
    assert round(nominal, 3) == 0.743  # and its nominal value, from the package directly


def test_alpha_perfect_and_undefined():
    assert ordinal_alpha([[1, 0, -1, 1], [1, 0, -1, 1], [1, 0, -1, 1]]) == pytest.approx(1.0)
    assert ordinal_alpha([[1, 1], [1, 1]]) is None  # one value only: no variation to agree on
    assert ordinal_alpha([[1, NAN], [NAN, 0]]) is None  # no unit scored twice


# Fleiss' kappa on Wikipedia: 10 subjects, 14 raters, 5 categories; P = 0.378, Pe = 0.213, kappa = 0.210.
FLEISS_WIKIPEDIA = [
    [0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
    [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7],
]


def test_fleiss_kappa_worked_example():
    assert round(fleiss_kappa(FLEISS_WIKIPEDIA), 3) == 0.210
    assert fleiss_kappa([[3, 0, 0], [0, 3, 0], [0, 0, 3]]) == pytest.approx(1.0)
    assert fleiss_kappa([[3, 0, 0], [3, 0, 0]]) is None
    with pytest.raises(AssertionError, match="same number"):
        fleiss_kappa([[3, 0, 0], [1, 1, 0]])


def test_wilson_against_published_and_scipy():
    lo, hi = wilson(81, 263)  # Newcombe (1998), table I: 0.2553 to 0.3662
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(0, 20)[0] == 0.0 and round(wilson(0, 20)[1], 4) == 0.1611  # Newcombe: 0 to 0.1611
    stats = pytest.importorskip("scipy.stats")
    for k, n in ((1, 29), (15, 148), (50, 50), (7, 9)):
        ci = stats.binomtest(k, n).proportion_ci(method="wilson")
        assert np.allclose(wilson(k, n), (ci.low, ci.high), atol=1e-12)
