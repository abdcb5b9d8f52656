"""Numbers the feedback signals are bounded and weighed by: the clamp, the per-epoch step limit, the shrinkage weight
w(n), the noise threshold `beyond_noise` and the mean-one projection of per-regime weights (`project_weights`).
Pure functions of floats (numpy for the projection); `services/feedback/signals.py` uses them."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _ratio_limit(x: float, prev: float, step: float) -> float:
    """x limited to [prev / step, prev · step] (prev > 0)."""
    return _clamp(x, prev / step, prev * step)


def beyond_noise(x: float, se: float, z: float) -> float:
    """The part of x beyond z standard errors, sign(x)·max(0, |x| − z·se) (a soft threshold); 0 when se is not
    finite (too few observations to tell anything from noise)."""
    if not math.isfinite(se):
        return 0.0
    return math.copysign(max(0.0, abs(x) - z * se), x)


def _w(n: float, n0: float) -> float:
    """Shrinkage weight n / (n + n0)."""
    return n / (n + n0) if n + n0 > 0 else 0.0


def _fin(x: float) -> float | None:
    """x, or None where it is not finite (signal inputs are JSON without inf)."""
    return x if math.isfinite(x) else None


def project_weights(target: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """clip(c·target, lo, hi) with the scale c > 0 chosen (bisection) so the mean is 1: a normalisation that
    never breaks a bound. Needs mean(lo) ≤ 1 ≤ mean(hi) to reach mean 1 exactly."""
    t, lo_, hi_ = (np.asarray(a, dtype=np.float64) for a in (target, lo, hi))
    f = lambda c: float(np.clip(c * t, lo_, hi_).mean())  # noqa: E731 — monotone non-decreasing in c
    a, b = 0.0, 1.0
    while f(b) < 1.0 and b < 1e12:
        b *= 2.0
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (m, b) if f(m) < 1.0 else (a, m)
    return [float(v) for v in np.clip(b * t, lo_, hi_)]
