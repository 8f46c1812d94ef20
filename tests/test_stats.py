"""Wilson intervals, exact McNemar and Holm against values computed by hand (worked in the comments)."""

import math

import pytest

from mla_eval.evals.stats import PairedCounts, holm_reject, mcnemar_exact, wilson_interval


def test_wilson_half():
    # 5/10: z^2 = 3.841459; denom = 1.3841459; centre = 0.5;
    # half = 1.959964 / 1.3841459 * sqrt(0.025 + 3.841459 / 400) = 1.4160101 * 0.1860206 = 0.263407
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.236593, abs=2e-6)
    assert hi == pytest.approx(0.763407, abs=2e-6)


def test_wilson_zero_and_all():
    # 0/10: lo = 0, hi = (z^2 / n) / (1 + z^2 / n) = 0.3841459 / 1.3841459 = 0.277533
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.277533, abs=2e-6))
    # 50/50: symmetric: lo = 1 - 0.0713476 (= 3.841459/50 / (1 + 3.841459/50)), hi = 1
    lo, hi = wilson_interval(50, 50)
    assert hi == 1.0 and lo == pytest.approx(1 - 0.076829 / 1.076829, abs=2e-6)


def test_wilson_asymmetric_case():
    # 45/50: p = 0.9, z^2/n = 0.0768292, denom = 1.0768292, centre = (0.9 + 0.0384146) / denom = 0.871461
    # half = 1.959964 / 1.0768292 * sqrt(0.0018 + 3.841459 / 10000) = 1.820125 * 0.0467349 = 0.085063
    lo, hi = wilson_interval(45, 50)
    assert lo == pytest.approx(0.786398, abs=3e-6)
    assert hi == pytest.approx(0.956524, abs=3e-6)
    # both bounds solve the score equation (p_hat - pi)^2 = z^2 pi (1 - pi) / n
    for pi in (lo, hi):
        assert (0.9 - pi) ** 2 == pytest.approx(1.959963984540054**2 * pi * (1 - pi) / 50, rel=1e-9)


def test_wilson_no_samples_and_bad_counts():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_mcnemar_exact_hand_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * 0.5^5 = 0.0625: 5 one-sided pairs are not enough
    assert mcnemar_exact(6, 0) == pytest.approx(2 / 64)  # 0.03125 < 0.05
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 0.021484375
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(3, 3) == 1.0  # 2 * P(X <= 3 | n = 6) = 2 * 42/64 > 1 -> 1
    # n = 20, k = 5: sum C(20, 0..5) = 1 + 20 + 190 + 1140 + 4845 + 15504 = 21700
    assert mcnemar_exact(15, 5) == pytest.approx(2 * 21700 / 2**20)
    assert not math.isnan(mcnemar_exact(200, 180))


def test_holm_step_down():
    # m = 3, alpha 0.05: thresholds 0.0167, 0.025, 0.05 in p order
    assert holm_reject([0.01, 0.02, 0.04]) == [True, True, True]
    assert holm_reject([0.01, 0.03, 0.04]) == [True, False, False]  # 0.03 > 0.025 stops the procedure
    assert holm_reject([0.04, 0.001, 0.2]) == [False, True, False]  # 0.04 > 0.025
    assert holm_reject([]) == []
    # Bonferroni would reject only the first; Holm rejects both
    assert holm_reject([0.02, 0.024]) == [True, True]


def test_paired_counts():
    pairs = [(True, True)] * 4 + [(True, False)] * 6 + [(False, True)] * 1 + [(False, False)] * 2
    pc = PairedCounts.from_pairs(pairs)
    assert (pc.both, pc.base_only, pc.format_only, pc.neither) == (4, 6, 1, 2)
    assert pc.p_value == pytest.approx(2 * (1 + 7) / 128)  # b=6, c=1: n=7
