"""A study's intervals: the bootstrap over (seed, fold) units, Student's t, paired differences and what a
comparison can resolve (the rules `tradeloop.study.stats`'s docstring states). Pure numpy."""
from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

CI_LEVEL = 0.95
GAP_VALID = 0.95
POWER = 0.8
"""The power at which a paired comparison states the difference it can resolve (`detectable`)."""
MOST_UNITS = 100_000
"""`units_to_detect` says None beyond this many units."""


def resample_indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    """B × n unit indices drawn with replacement (`default_rng(seed).integers(0, n, size=(B, n))`)."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p ≥ ½, df ≥ 1): bisection on its CDF, ½ + ∫₀ᵗ of the density by Simpson's rule on
    4 096 intervals (|error| < 1e-9 at the quantiles the intervals use)."""
    if not 0.5 <= p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1 (got p={p}, df={df})")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t: float) -> float:
        x = np.linspace(0.0, t, 4097)
        f = c * (1.0 + x * x / df) ** (-(df + 1) / 2)
        return 0.5 + (t / 4096 / 3) * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=None)
def expanded_tail(n: int, level: float = CI_LEVEL) -> float:
    """α′/2, the tail each side of the expanded percentile interval over n units: 1 − Φ(√(n / (n − 1)) ·
    t_{(1 + level) / 2, n − 1}) (module docstring)."""
    z = math.sqrt(n / (n - 1)) * t_quantile((1.0 + level) / 2.0, n - 1)
    return 1.0 - NormalDist().cdf(z)


def _interval(stats: np.ndarray, n: int, level: float = CI_LEVEL) -> tuple[float, float]:
    a = expanded_tail(n, level)
    lo, hi = np.quantile(stats, [a, 1.0 - a])
    return float(lo), float(hi)


@functools.lru_cache(maxsize=None)
def _t_factor(n: int, level: float) -> float:
    return t_quantile((1.0 + level) / 2.0, n - 1) / math.sqrt(n)


def t_interval(values: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float]:
    """Student's t interval of the mean of n ≥ 2 values: mean ± t_{(1 + level) / 2, n − 1} · s / √n (s: ddof 1)."""
    x = np.asarray(values, dtype=np.float64)
    half = _t_factor(x.size, level) * float(x.std(ddof=1))
    return float(x.mean()) - half, float(x.mean()) + half


def percentile_ci(values: Sequence[float], *, n_boot: int = 10_000, seed: int = 0,
                  level: float = CI_LEVEL) -> tuple[float, float]:
    """The expanded percentile-bootstrap interval of the mean of n ≥ 2 values (module docstring)."""
    x = np.asarray(values, dtype=np.float64)
    return _interval(x[resample_indices(x.size, n_boot, seed)].mean(axis=1), x.size, level)


def bootstrap_ci(values: Sequence[float], *, n_boot: int = 10_000, seed: int = 0,
                 level: float = CI_LEVEL, bounds: tuple[float | None, float | None] = (None, None)) -> dict:
    """Mean of `values` and its CI (module docstring): the expanded percentile-bootstrap interval, widened on either
    side to Student's t interval (`t_interval`) where that reaches further, and held within `bounds` (the values
    the quantity can take: (0, 1) for a DSR, (0, None) for a count). {"mean", "lo", "hi", "n"} (lo = hi = mean for
    n = 1, which `describe` prints as one unit's, no interval; all None for n = 0)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    if x.size == 1:
        return {"mean": float(x[0]), "lo": float(x[0]), "hi": float(x[0]), "n": 1}
    lo, hi = percentile_ci(x, n_boot=n_boot, seed=seed, level=level)
    t_lo, t_hi = t_interval(x, level)
    lo, hi = min(lo, t_lo), max(hi, t_hi)
    floor, ceil = bounds            # the t interval knows no bounds: a DSR stays in [0, 1], a count ≥ 0
    lo, hi = (lo if floor is None else max(lo, floor)), (hi if ceil is None else min(hi, ceil))
    return {"mean": float(x.mean()), "lo": lo, "hi": hi, "n": int(x.size)}


def gap_ci(val: Sequence[float], oos: Sequence[float], *, n_boot: int = 10_000, seed: int = 0) -> dict:
    """The gap of the means 1 − mean(oos) / mean(val) and its bootstrap CI over units (the same resamples for both);
    None where mean val ≤ 0 (and the CI None when fewer than 95 % of the resamples have mean val > 0)."""
    v, o = np.asarray(val, dtype=np.float64), np.asarray(oos, dtype=np.float64)
    out: dict = {"mean": None, "lo": None, "hi": None, "n": int(v.size)}
    if v.size == 0 or not v.mean() > 0:
        return out
    out["mean"] = float(1.0 - o.mean() / v.mean())
    if v.size == 1:
        out["lo"] = out["hi"] = out["mean"]
        return out
    idx = resample_indices(v.size, n_boot, seed)
    mv, mo = v[idx].mean(axis=1), o[idx].mean(axis=1)
    ok = mv > 0
    if ok.mean() >= GAP_VALID:
        out["lo"], out["hi"] = _interval(1.0 - mo[ok] / mv[ok], v.size)
    return out


def family_level(m: int, level: float = CI_LEVEL) -> float:
    """The level of each of `m` intervals that cover their m differences together with probability ≥ `level`
    (Bonferroni): 1 − (1 − level) / m."""
    return 1.0 - (1.0 - level) / max(1, m)


def paired(a: dict, b: dict, *, n_boot: int = 10_000, seed: int = 0, family: int = 1,
           bounds: tuple[float | None, float | None] = (None, None)) -> dict:
    """a − b on the units both have (dicts unit → value): {"mean", "lo", "hi", "n", "wins", "sd", "detectable",
    "units_to_detect"} (wins: units with a > b; sd: the differences' standard deviation; `detectable` over these
    units, and `units_to_detect` the observed mean: None below 2 units). `family` m > 1: one of m comparisons made
    together; "family" adds {"m", "level", "lo", "hi"}, the interval at `family_level(m)` from the same resamples."""
    units = sorted(set(a) & set(b))
    d = [a[u] - b[u] for u in units]
    out = bootstrap_ci(d, n_boot=n_boot, seed=seed, bounds=bounds)
    if family > 1 and len(d) >= 2:
        fw = bootstrap_ci(d, n_boot=n_boot, seed=seed, level=family_level(family), bounds=bounds)
        out["family"] = {"m": family, "level": family_level(family), "lo": fw["lo"], "hi": fw["hi"]}
    out["wins"] = int(sum(x > 0 for x in d))
    sd = float(np.std(d, ddof=1)) if len(d) >= 2 else None
    out["sd"] = sd
    out["detectable"] = None if sd is None else detectable(sd, len(d))
    out["units_to_detect"] = None if sd is None else units_to_detect(out["mean"], sd)
    return out


@functools.lru_cache(maxsize=None)
def _t_sum(n: int, power: float, level: float) -> float:
    return t_quantile((1.0 + level) / 2.0, n - 1) + t_quantile(power, n - 1)


def detectable(sd: float, n: int, power: float = POWER, level: float = CI_LEVEL) -> float:
    """The smallest true mean difference a paired comparison of n ≥ 2 units, whose differences have standard
    deviation `sd`, tells from 0 with probability `power` (two-sided t-test at 1 − level): (t_{(1 + level) / 2, n − 1}
    + t_{power, n − 1}) · sd / √n."""
    if n < 2:
        raise ValueError(f"detectable needs n >= 2 units (got {n})")
    return _t_sum(n, power, level) * sd / math.sqrt(n)


def units_to_detect(delta: float, sd: float, power: float = POWER, level: float = CI_LEVEL) -> int | None:
    """The fewest units (≥ 2) whose `detectable` difference is at most |delta|, for differences of standard deviation
    `sd`; None where delta is 0 or more than `MOST_UNITS` would be needed."""
    if delta == 0.0:
        return None
    z = NormalDist().inv_cdf((1.0 + level) / 2.0) + NormalDist().inv_cdf(power)
    n = max(2, math.ceil((z * sd / abs(delta)) ** 2))          # the normal's answer: the t's is never fewer
    if n > MOST_UNITS:
        return None
    while detectable(sd, n, power, level) > abs(delta):
        n += 1
        if n > MOST_UNITS:
            return None
    return n
