"""shared/metrics.py pinned to independent formulas: plain loops, the statistics module, math.erf, hand cases,
and the published numerical example of Bailey & López de Prado (2014)."""
from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from shared import metrics as M


# ---------------------------------------------------------------- independent reference implementations
def ref_phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def ref_phi_inv(p: float) -> float:
    lo, hi = -40.0, 40.0
    for _ in range(200):  # bisection on the erf-based CDF
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ref_phi(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def ref_sharpe(xs: list[float]) -> float:
    if len(xs) < 2 or statistics.stdev(xs) == 0:
        return 0.0
    return statistics.mean(xs) / statistics.stdev(xs)


def ref_max_drawdown(rs: list[float]) -> float:
    eq, peak, worst = 1.0, 1.0, 0.0
    for r in rs:
        eq *= 1.0 + r
        peak = max(peak, eq)
        worst = max(worst, (peak - eq) / peak)
    return worst


def ref_skew_kurt(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mu = sum(xs) / n
    m2 = sum((x - mu) ** 2 for x in xs) / n
    m3 = sum((x - mu) ** 3 for x in xs) / n
    m4 = sum((x - mu) ** 4 for x in xs) / n
    return m3 / m2 ** 1.5, m4 / m2 ** 2


def ref_psr(xs: list[float], sr_star: float) -> float:
    sr = ref_sharpe(xs)
    g3, g4 = ref_skew_kurt(xs)
    return ref_phi((sr - sr_star) * math.sqrt(len(xs) - 1) / math.sqrt(1 - g3 * sr + (g4 - 1) / 4 * sr ** 2))


def ref_sr0(n_trials: int, var: float) -> float:
    g = 0.5772156649015329
    return math.sqrt(var) * ((1 - g) * ref_phi_inv(1 - 1 / n_trials) + g * ref_phi_inv(1 - 1 / (n_trials * math.e)))


@pytest.fixture
def sample():
    rng = random.Random(7)
    trades = [rng.gauss(0.002, 0.01) + (0.03 if rng.random() < 0.1 else 0.0) for _ in range(60)]
    bars = [rng.gauss(0.0002, 0.004) for _ in range(400)]
    positions = [rng.choice([-1.0, -0.5, 0.0, 0.0, 1.0]) for _ in range(400)]
    durations = [rng.randint(1, 30) for _ in range(60)]
    return trades, bars, positions, durations


# ---------------------------------------------------------------- against independent formulas
def test_all_metrics_match_reference_loops(sample):
    trades, bars, positions, durations = sample
    m = M.compute_metrics(np.array(trades), np.array(bars), np.array(positions), np.array(durations),
                          n_trials=20, sharpe_var_trials=0.01)
    assert set(m) == set(M.METRIC_KEYS)
    assert all(type(v) is float for v in m.values())

    eq = 1.0
    for r in bars:
        eq *= 1 + r
    wins = [t for t in trades if t > 0]
    losses = [t for t in trades if t < 0]
    downside = math.sqrt(sum(min(r, 0.0) ** 2 for r in bars) / len(bars))
    prev, moved = 0.0, 0.0
    for p in positions:
        moved += abs(p - prev)
        prev = p
    expected = {
        "per_trade_sharpe": statistics.mean(trades) / statistics.stdev(trades),
        "per_bar_sharpe": statistics.mean(bars) / statistics.stdev(bars),
        "total_return": eq - 1,
        "max_drawdown": ref_max_drawdown(bars),
        "profit_factor": sum(wins) / -sum(losses),
        "win_rate": len(wins) / len(trades),
        "n_trades": 60.0,
        "mean_bars_held": statistics.mean(durations),
        "exposure": sum(p != 0 for p in positions) / len(positions),
        "turnover": moved / len(positions),
        "sortino": statistics.mean(bars) / downside,
        "psr": ref_psr(trades, 0.0),
        "dsr": ref_psr(trades, ref_sr0(20, 0.01)),
    }
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert 0.0 < m["dsr"] < m["psr"] < 1.0  # deflation by 20 trials lowers the PSR


def test_dsr_default_variance_is_null_variance_of_sharpe(sample):
    trades = sample[0]
    n = len(trades)
    assert M.dsr(trades, n_trials=50) == pytest.approx(ref_psr(trades, ref_sr0(50, 1 / (n - 1))), rel=1e-9)
    assert M.dsr(trades, n_trials=1) == pytest.approx(M.psr(trades), rel=1e-12)  # no selection: SR0 = 0


def test_dsr_published_example_bailey_lopez_de_prado_2014():
    # "The Deflated Sharpe Ratio" (2014), numerical example: annualized SR 2.5 over 5 years of daily returns
    # (T = 1250), N = 100 trials with annualized Sharpe variance 1/2, skewness −3, kurtosis 10 →
    # SR0 ≈ 0.1132 (daily) and DSR ≈ 0.9004.
    sr0 = M.expected_max_sharpe(100, 0.5 / 250)
    assert sr0 == pytest.approx(0.1132, abs=5e-5)
    assert M.psr_from_stats(2.5 / math.sqrt(250), 1250, -3.0, 10.0, sr0) == pytest.approx(0.9004, abs=5e-5)


def test_expected_max_sharpe_grows_with_trials():
    vals = [M.expected_max_sharpe(n, 1.0) for n in (1, 2, 10, 100, 1000)]
    assert vals[0] == 0.0
    assert all(a < b for a, b in zip(vals, vals[1:]))
    # for large N it approaches the expected maximum of N standard normals (≈ 3.24 for N = 1000)
    assert vals[-1] == pytest.approx(ref_sr0(1000, 1.0), rel=1e-9)
    assert 3.1 < vals[-1] < 3.35


def test_psr_normal_returns_equals_plain_z_test():
    # with γ3 = 0, γ4 = 3 the PSR is Φ(SR·sqrt(n−1)/sqrt(1 + SR²/2))
    sr, n = 0.2, 101
    assert M.psr_from_stats(sr, n, 0.0, 3.0) == pytest.approx(ref_phi(sr * 10 / math.sqrt(1 + sr * sr / 2)), rel=1e-12)
    assert M.psr_from_stats(0.3, n, 0.0, 3.0, sr_star=0.3) == pytest.approx(0.5)


# ---------------------------------------------------------------- hand cases
def test_sharpe_se_is_the_spread_of_sharpes_estimated_from_n_returns():
    """The SE formula against simulation: the std of per-trade Sharpes of 20 000 normal samples of n returns, and
    against the PSR it is the denominator of (PSR = Φ(SR / SE))."""
    rng = np.random.default_rng(0)
    for n, sr in ((30, 0.0), (60, 0.3), (200, 1.0)):          # asymptotic: ~6 % low at n = 12
        x = rng.normal(sr, 1.0, (20_000, n))
        est = x.mean(1) / x.std(1, ddof=1)
        assert M.sharpe_se_from_stats(sr, n) == pytest.approx(math.sqrt((1 + sr * sr / 2) / (n - 1)))
        assert est.std() == pytest.approx(M.sharpe_se_from_stats(sr, n), rel=0.06)
    r = list(rng.standard_t(4, 60) * 0.01 + 0.003)
    sr, (g3, g4) = M.per_trade_sharpe(r), M.moments(r)
    assert M.psr(r) == pytest.approx(ref_phi(sr / M.sharpe_se_from_stats(sr, 60, g3, g4)), rel=1e-9)
    # the noise level never goes below the normal-moment SE: a positive skew does not shrink it
    skewed = [0.05] * 3 + [-0.004] * 27                                  # γ3 ≈ 2.7, SR ≈ 0.08
    sr, (g3, g4) = M.per_trade_sharpe(skewed), M.moments(skewed)
    assert g3 > 2 and M.sharpe_se_from_stats(sr, 30, g3, g4) < M.sharpe_se_from_stats(sr, 30)
    assert M.sharpe_se(skewed) == pytest.approx(M.sharpe_se_from_stats(sr, 30))
    assert M.sharpe_se(r) == pytest.approx(max(M.sharpe_se_from_stats(M.per_trade_sharpe(r), 60, *M.moments(r)),
                                               M.sharpe_se_from_stats(M.per_trade_sharpe(r), 60)))
    assert M.sharpe_se([0.01]) == math.inf and M.sharpe_se([]) == math.inf   # one trade tells nothing


def test_no_trade_no_bar():
    m = M.compute_metrics([], [], [], [])
    assert m == {k: 0.0 for k in M.METRIC_KEYS}


def test_one_trade():
    m = M.compute_metrics([0.05], [0.0, 0.05, 0.0], [0.0, 1.0, 0.0], [1])
    assert m["per_trade_sharpe"] == 0.0  # undefined with n < 2
    assert m["psr"] == 0.0 and m["dsr"] == 0.0
    assert m["n_trades"] == 1.0 and m["win_rate"] == 1.0 and m["mean_bars_held"] == 1.0
    assert m["profit_factor"] == M.PROFIT_FACTOR_CAP
    assert m["total_return"] == pytest.approx(0.05)
    assert m["max_drawdown"] == 0.0
    assert m["exposure"] == pytest.approx(1 / 3)
    assert m["turnover"] == pytest.approx(2 / 3)  # in (|1 − 0|) and out (|0 − 1|) over 3 bars
    assert m["sortino"] == 0.0  # no downside


def test_all_winners_is_valid_json():
    m = M.compute_metrics([0.01, 0.02, 0.03], [0.01, 0.02, 0.03], [1.0, 1.0, 1.0], [1, 1, 1])
    json.loads(json.dumps(m, allow_nan=False))
    assert m["profit_factor"] == M.PROFIT_FACTOR_CAP
    assert m["win_rate"] == 1.0
    assert m["per_trade_sharpe"] == pytest.approx(2.0)  # mean 0.02, stdev 0.01


def test_identical_trades_have_zero_sharpe_not_nan():
    m = M.compute_metrics([0.01] * 4, [0.0] * 4, [0.0] * 4, [2] * 4)
    assert m["per_trade_sharpe"] == 0.0 and m["psr"] == 0.0 and m["per_bar_sharpe"] == 0.0


def test_hand_drawdown_and_profit_factor():
    # equity 1 → 1.1 → 0.88 → 0.968: peak 1.1, trough 0.88 → drawdown 0.2
    assert M.max_drawdown([0.1, -0.2, 0.1]) == pytest.approx(0.2)
    # a loss from the very start counts against the initial equity 1.0
    assert M.max_drawdown([-0.5, 0.5]) == pytest.approx(0.5)
    assert M.profit_factor([0.03, -0.01, 0.01, -0.02]) == pytest.approx(0.04 / 0.03)
    assert M.profit_factor([-0.01, -0.02]) == 0.0
    assert M.win_rate([0.0, 0.01, -0.01, 0.02]) == 0.5  # a zero return is not a win


def test_hand_sortino_and_turnover():
    # r = [0.03, -0.01]: mean 0.01, downside deviation sqrt((0² + 0.01²) / 2)
    assert M.sortino([0.03, -0.01]) == pytest.approx(0.01 / math.sqrt(0.0001 / 2))
    assert M.turnover([1.0, -1.0, -1.0, 0.5]) == pytest.approx((1 + 2 + 0 + 1.5) / 4)


def test_val_oos_gap():
    assert M.val_oos_gap(0.2, 0.1) == pytest.approx(0.5)
    assert M.val_oos_gap(0.2, 0.2) == 0.0
    assert M.val_oos_gap(0.2, -0.1) == pytest.approx(1.5)
    assert M.val_oos_gap(0.0, 0.3) == 0.0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="bar_returns"):
        M.compute_metrics([0.1], [float("nan")], [0.0], [1])
    with pytest.raises(ValueError, match="trade_bars"):
        M.compute_metrics([0.1, 0.2], [0.0], [0.0], [1])
    with pytest.raises(ValueError, match="n_trials"):
        M.dsr([0.1, 0.2], n_trials=0)
