"""Market data: OHLCV bars, their validation, causal features, causal regime labels and splits.

The bars and their loading live in `shared/market_data.py`, the causal volatility, features and regimes in
`shared/features.py`; this module holds the chronological splits and re-exports both, so `shared.market` is the one
import for market data.

Conventions
- Bar ranges are half-open `(start, stop)` index pairs. A split is train | embargo | val | embargo | test.
- Causality, units and input validation: see `shared.features` and `shared.market_data`.

ML core: imports only numpy, pandas and the standard library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.features import (ADX_PERIOD, ADX_TREND, FEATURE_CLIP, FEATURE_NAMES, FEATURE_WARMUP,  # noqa: F401
                             REGIME_NAMES, REGIME_VOL_WINDOW, REGIME_WARMUP, TREND_BUCKETS, VOL_BUCKETS, VOL_FLOOR,
                             VOL_SPAN, _adx, compute_features, regime_labels, volatility)
from shared.market_data import (BUNDLED, DATA_DIR, DATASET_NAMES, MAX_REPORTED_PROBLEMS, PRICE_COLUMNS,  # noqa: F401
                                Bars, DataError, DataProblem, _read_csv_fast, load_bars, load_dataset)


# ---------------------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Half-open bar ranges train | embargo | val | embargo | test. The embargo gaps keep one part's trades and
    multi-bar targets from reaching into the next: training's prices and rewards stop at its own end. They do not
    keep a later part's feature windows off the bars before it (the default embargo, 20 bars or 1 %, is shorter than
    the window and its 60-bar lookbacks): a validation decision reads causal features of training's last bars, past
    data, which is no look-ahead."""

    train: tuple[int, int]
    val: tuple[int, int]
    test: tuple[int, int]
    embargo: int

    def window(self, which: str) -> tuple[int, int]:
        """The (start, stop) range of "train", "val" or "test"."""
        if which not in ("train", "val", "test"):
            raise ValueError(f"split window must be 'train', 'val' or 'test', got {which!r}")
        return getattr(self, which)

    def window_hash(self, bars: Bars, which: str) -> str:
        """sha256 hex of that window's bars (`Bars.fingerprint` of the slice)."""
        return bars.slice(*self.window(which)).fingerprint()

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return {"train": list(self.train), "val": list(self.val), "test": list(self.test), "embargo": self.embargo}

    @classmethod
    def from_dict(cls, d: dict) -> "Split":
        """Inverse of `to_dict`."""
        return cls(tuple(d["train"]), tuple(d["val"]), tuple(d["test"]), int(d["embargo"]))


def default_embargo(n_bars: int) -> int:
    """max(20, 1% of n_bars) bars."""
    return max(20, math.ceil(0.01 * n_bars))


def chronological_split(n_bars: int, *, train: float = 0.6, val: float = 0.2, embargo: int | None = None) -> Split:
    """Split n_bars into train | embargo | val | embargo | test. `train` and `val` are fractions of the bars
    left after the two embargoes; test gets the rest. Raises ValueError when a part would be empty."""
    if not (isinstance(n_bars, (int, np.integer)) and n_bars > 0):
        raise ValueError(f"chronological_split: n_bars must be a positive integer, got {n_bars!r}")
    if not (0 < train < 1 and 0 < val < 1 and train + val < 1):
        raise ValueError(f"chronological_split: need 0 < train, 0 < val, train + val < 1 (got train={train}, val={val})")
    emb = default_embargo(n_bars) if embargo is None else int(embargo)
    if emb < 0:
        raise ValueError(f"chronological_split: embargo must be ≥ 0, got {embargo}")
    usable = n_bars - 2 * emb
    n_train, n_val = int(round(train * usable)), int(round(val * usable))
    n_test = usable - n_train - n_val
    if min(n_train, n_val, n_test) < 1:
        raise ValueError(f"chronological_split: {n_bars} bars with embargo {emb} leave train={n_train}, val={n_val}, "
                         f"test={n_test} bars; every part needs at least 1 (use more bars or a smaller embargo)")
    v0 = n_train + emb
    t0 = v0 + n_val + emb
    return Split(train=(0, n_train), val=(v0, v0 + n_val), test=(t0, n_bars), embargo=emb)


def walk_forward_folds(n_bars: int, *, n_folds: int, train_bars: int | None = None, val_bars: int | None = None,
                       test_bars: int | None = None, embargo: int | None = None, step: int | None = None) -> list[Split]:
    """Rolling walk-forward folds: fold k is train | embargo | val | embargo | test starting at bar k·step.

    Defaults: step = test_bars, and test_bars = step where only `step` is given (the folds' test windows abut and
    never overlap: each fold's OOS is its own bars); sizes not given share what is left in the ratio
    train:val:test = 3:1:1 so that the last fold ends at (or just before) n_bars. Raises ValueError on arguments
    that do not fit."""
    if not (isinstance(n_folds, (int, np.integer)) and n_folds >= 1):
        raise ValueError(f"walk_forward_folds: n_folds must be an integer ≥ 1, got {n_folds!r}")
    if not (isinstance(n_bars, (int, np.integer)) and n_bars > 0):
        raise ValueError(f"walk_forward_folds: n_bars must be a positive integer, got {n_bars!r}")
    emb = default_embargo(n_bars) if embargo is None else int(embargo)
    for nm, v in (("train_bars", train_bars), ("val_bars", val_bars), ("test_bars", test_bars), ("step", step)):
        if v is not None and int(v) < 1:
            raise ValueError(f"walk_forward_folds: {nm} must be ≥ 1, got {v}")
    if emb < 0:
        raise ValueError(f"walk_forward_folds: embargo must be ≥ 0, got {embargo}")
    if step is not None and test_bars is None:
        test_bars = int(step)
    if train_bars is None or val_bars is None or test_bars is None:
        # n_bars − 2·emb = train + val + test + (n_folds − 1)·step, with step = test unless given
        weights = {"train": 3, "val": 1, "test": 1}
        given = {"train": train_bars, "val": val_bars, "test": test_bars}
        free = n_bars - 2 * emb - sum(v for v in given.values() if v is not None)
        if step is not None:
            free -= (n_folds - 1) * step
        units = sum(w for k, w in weights.items() if given[k] is None)
        if given["test"] is None and step is None:
            units += n_folds - 1
        elif given["test"] is not None and step is None:
            free -= (n_folds - 1) * given["test"]
        u = free // units if units else 0
        sizes = {k: (given[k] if given[k] is not None else weights[k] * u) for k in weights}
        train_bars, val_bars, test_bars = sizes["train"], sizes["val"], sizes["test"]
        if min(train_bars, val_bars, test_bars) < 1:
            raise ValueError(f"walk_forward_folds: {n_bars} bars are too few for {n_folds} folds with embargo {emb}")
    step = test_bars if step is None else int(step)
    span = train_bars + val_bars + test_bars + 2 * emb
    need = span + (n_folds - 1) * step
    if need > n_bars:
        raise ValueError(f"walk_forward_folds: {n_folds} folds of train={train_bars}, val={val_bars}, test={test_bars}, "
                         f"embargo={emb}, step={step} need {need} bars, but there are only {n_bars}")
    folds = []
    for k in range(n_folds):
        s = k * step
        v0 = s + train_bars + emb
        t0 = v0 + val_bars + emb
        folds.append(Split(train=(s, s + train_bars), val=(v0, v0 + val_bars), test=(t0, t0 + test_bars), embargo=emb))
    return folds
