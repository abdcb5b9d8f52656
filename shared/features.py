"""Causal volatility, features and regime labels of `Bars` (`volatility`, `compute_features`, `regime_labels`).
`shared.market` re-exports every name here.

Everything computed here is *causal*: row t of `compute_features`, `volatility` and `regime_labels` depends on bars
0..t only (pandas `ewm`/`rolling` look backwards by construction; no `bfill`, no centred windows, no whole-series
statistics). `tests/test_market.py` perturbs future bars and checks that nothing at or before t moves. Returns are
log returns; "vol units" means divided by `volatility(bars)`, the causal EWMA standard deviation of per-bar log
returns.

ML core: imports only numpy, pandas and the standard library.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from shared.knobs import N_REGIMES
from shared.market_data import Bars

# ---------------------------------------------------------------------------------------------------------
# Causal volatility, features, regimes
# ---------------------------------------------------------------------------------------------------------

VOL_SPAN = 32          # EWMA span (bars) of the per-bar volatility
VOL_FLOOR = 1e-5       # 0.1 bp: volatility() is never below this
FEATURE_WARMUP = 64    # feature rows t < FEATURE_WARMUP are all 0
FEATURE_CLIP = 8.0     # features are clipped to ±FEATURE_CLIP
ADX_PERIOD = 14
ADX_TREND = 22.0       # ADX above this: trending (up/down by the sign of +DI − −DI)
REGIME_VOL_WINDOW = 500  # rolling window (bars) of the causal volatility terciles
REGIME_WARMUP = 20     # before this many bars the vol bucket is "mid"

FEATURE_NAMES: tuple[str, ...] = (
    "ret_1", "ret_5", "ret_20", "ret_60",  # log returns over k bars / (vol·√k)
    "gap",            # log(open_t / close_{t-1}) / vol
    "vol_ratio",      # log(EWMA vol span 8 / EWMA vol span 128)
    "range_pos_20",   # position of close in the 20-bar high-low range, in [-1, 1]
    "bar_range",      # log(high / low) / vol − 1
    "rsi_14",         # (Wilder RSI − 50) / 25
    "adx_14",         # ADX / 25 − 1
    "di_diff_14",     # (+DI − −DI) / 25
    "dist_ema_20",    # log(close / EMA20(close)) / (vol·√20)
    "dist_ema_100",   # log(close / EMA100(close)) / (vol·√100)
    "volume_z",       # z-score of log(1 + volume) over 50 bars (0 without volume)
)
VOL_BUCKETS = ("low-vol", "mid-vol", "high-vol")
TREND_BUCKETS = ("down", "range", "up")
REGIME_NAMES: tuple[str, ...] = tuple(f"{v} {t}" for v in VOL_BUCKETS for t in TREND_BUCKETS)
assert len(REGIME_NAMES) == N_REGIMES


def _log_returns(bars: Bars) -> pd.Series:
    """r_t = log(close_t / close_{t-1}); r_0 = NaN."""
    return np.log(pd.Series(bars.close)).diff()


def _ewm_vol(r: pd.Series, span: int, bars: Bars) -> np.ndarray:
    """σ_t = sqrt(EWMA_t(r²)) (zero-mean, RiskMetrics-style; adjust=True so early rows average what exists).
    Bar 0 has no return: its σ is the Parkinson estimate log(high/low)/sqrt(4 ln 2) of bar 0 itself."""
    var = (r * r).ewm(span=span, adjust=True, ignore_na=True).mean().to_numpy()
    park = np.log(bars.high / bars.low) / math.sqrt(4.0 * math.log(2.0))
    sig = np.where(np.isfinite(var), np.sqrt(np.where(np.isfinite(var), var, 0.0)), park)
    return np.maximum(sig, VOL_FLOOR)


def _derived(bars: Bars, name: str, compute) -> np.ndarray:
    """A per-bar array derived from `bars`, computed once per `Bars` object and kept on it, read-only (a `Bars` is
    immutable: the evaluator keeps a loaded series between evaluations and reuses its volatility and regimes)."""
    cache = bars.__dict__.setdefault("_derived", {})
    if name not in cache:
        arr = compute()
        arr.flags.writeable = False
        cache[name] = arr
    return cache[name]


def volatility(bars: Bars) -> np.ndarray:
    """Causal per-bar volatility of log returns, float64 [T], ≥ VOL_FLOOR: σ_t = sqrt(EWMA_{span=32}(r²)).
    Computed once per `Bars` (read-only)."""
    return _derived(bars, "volatility", lambda: _ewm_vol(_log_returns(bars), VOL_SPAN, bars))


def _adx(bars: Bars, period: int = ADX_PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wilder's ADX, +DI, −DI (smoothing α = 1/period, adjust=False: a recursive, causal filter).
    +DM_t = up if up > down and up > 0 (up = high_t − high_{t−1}, down = low_{t−1} − low_t), likewise −DM;
    TR_t = max(high − low, |high − close_{t−1}|, |low − close_{t−1}|); DI = 100·EMA(DM)/EMA(TR);
    DX = 100·|+DI − −DI| / (+DI + −DI); ADX = EMA(DX)."""
    h, l, c = pd.Series(bars.high), pd.Series(bars.low), pd.Series(bars.close)
    up, down = h.diff().fillna(0.0), (-l.diff()).fillna(0.0)
    pdm = up.where((up > down) & (up > 0), 0.0)
    ndm = down.where((down > up) & (down > 0), 0.0)
    pc = c.shift(1)
    tr = pd.concat([h - l, (h - pc).abs(), (l - pc).abs()], axis=1).max(axis=1)  # row 0: high − low
    alpha = 1.0 / period
    atr = tr.ewm(alpha=alpha, adjust=False).mean()
    atr = atr.where(atr > 0, np.nan)
    pdi = (100.0 * pdm.ewm(alpha=alpha, adjust=False).mean() / atr).fillna(0.0)
    ndi = (100.0 * ndm.ewm(alpha=alpha, adjust=False).mean() / atr).fillna(0.0)
    s = pdi + ndi
    dx = (100.0 * (pdi - ndi).abs() / s.where(s > 0, np.nan)).fillna(0.0)
    adx = dx.ewm(alpha=alpha, adjust=False).mean()
    return adx.to_numpy(), pdi.to_numpy(), ndi.to_numpy()


def compute_features(bars: Bars) -> np.ndarray:
    """Causal features, float32 [T, F] with F = len(FEATURE_NAMES); finite everywhere, roughly unit scale,
    clipped to ±FEATURE_CLIP; rows t < FEATURE_WARMUP are 0. Row t uses bars 0..t only."""
    T = len(bars)
    logc = np.log(pd.Series(bars.close))
    r = logc.diff()
    sig = volatility(bars)  # [T]
    feats: dict[str, pd.Series | np.ndarray] = {}
    for k in (1, 5, 20, 60):
        feats[f"ret_{k}"] = (logc - logc.shift(k)).to_numpy() / (sig * math.sqrt(k))
    feats["gap"] = np.log(bars.open / np.r_[np.nan, bars.close[:-1]]) / sig
    feats["vol_ratio"] = np.log(_ewm_vol(r, 8, bars) / _ewm_vol(r, 128, bars))
    hh = pd.Series(bars.high).rolling(20, min_periods=1).max().to_numpy()
    ll = pd.Series(bars.low).rolling(20, min_periods=1).min().to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        feats["range_pos_20"] = np.where(hh > ll, 2.0 * (bars.close - ll) / (hh - ll) - 1.0, 0.0)
    feats["bar_range"] = np.log(bars.high / bars.low) / sig - 1.0
    gain = r.clip(lower=0).ewm(alpha=1 / 14, adjust=False).mean()
    loss = (-r).clip(lower=0).ewm(alpha=1 / 14, adjust=False).mean()
    tot = (gain + loss).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rsi = np.where(tot > 0, 100.0 * gain.to_numpy() / tot, 50.0)  # RSI = 100·gain/(gain+loss)
    feats["rsi_14"] = (rsi - 50.0) / 25.0
    adx, pdi, ndi = _adx(bars)
    feats["adx_14"] = adx / 25.0 - 1.0
    feats["di_diff_14"] = (pdi - ndi) / 25.0
    for n in (20, 100):
        ema = logc.ewm(span=n, adjust=False).mean()
        feats[f"dist_ema_{n}"] = (logc - ema).to_numpy() / (sig * math.sqrt(n))
    if bars.has_volume:
        lv = np.log1p(pd.Series(bars.volume))
        m, s = lv.rolling(50, min_periods=10).mean(), lv.rolling(50, min_periods=10).std()
        feats["volume_z"] = ((lv - m) / s.where(s > 1e-12, np.nan)).to_numpy()
    else:
        feats["volume_z"] = np.zeros(T)
    assert tuple(feats) == FEATURE_NAMES
    x = np.stack([np.asarray(feats[n], dtype=np.float64) for n in FEATURE_NAMES], axis=1)  # T × F
    x = np.nan_to_num(x, nan=0.0, posinf=FEATURE_CLIP, neginf=-FEATURE_CLIP)
    x = np.clip(x, -FEATURE_CLIP, FEATURE_CLIP)
    x[:FEATURE_WARMUP] = 0.0
    return x.astype(np.float32)


def regime_labels(bars: Bars) -> np.ndarray:
    """Causal regime label per bar, int64 [T] in [0, N_REGIMES): label = vol_bucket·3 + trend_bucket.

    vol_bucket: where σ_t falls among the terciles of σ over the last REGIME_VOL_WINDOW bars (t included):
    0 low, 1 mid, 2 high (1 during the first REGIME_WARMUP bars). trend_bucket: 1 (range) when ADX(14) ≤
    ADX_TREND, else 2 (up) if +DI > −DI, 0 (down) otherwise. Names: REGIME_NAMES[label]. Computed once per
    `Bars` (read-only)."""
    return _derived(bars, "regime_labels", lambda: _regime_labels(bars))


def _regime_labels(bars: Bars) -> np.ndarray:
    sig = pd.Series(volatility(bars))
    roll = sig.rolling(REGIME_VOL_WINDOW, min_periods=1)
    q1, q2 = roll.quantile(1 / 3).to_numpy(), roll.quantile(2 / 3).to_numpy()
    s = sig.to_numpy()
    vol_bucket = (s > q1).astype(np.int64) + (s > q2).astype(np.int64)
    vol_bucket[:REGIME_WARMUP] = 1
    adx, pdi, ndi = _adx(bars)
    trend = np.where(adx > ADX_TREND, np.where(pdi > ndi, 2, 0), 1).astype(np.int64)
    return vol_bucket * 3 + trend
