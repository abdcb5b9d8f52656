"""shared/market.py: loading, Bars, causal volatility/features/regimes (checked against independent loops), splits."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from shared.knobs import N_REGIMES
from shared.market import (
    BUNDLED,
    FEATURE_NAMES,
    FEATURE_WARMUP,
    REGIME_NAMES,
    VOL_FLOOR,
    VOL_SPAN,
    Bars,
    DataError,
    Split,
    chronological_split,
    compute_features,
    load_bars,
    load_dataset,
    regime_labels,
    volatility,
    walk_forward_folds,
)
from shared.market import _adx  # the independent-loop check below needs the raw ADX/DI
from shared.synthetic import generate


def _bars_from_close(close: np.ndarray, start: str = "2021-01-01", freq: str = "h") -> Bars:
    close = np.asarray(close, dtype=float)
    prev = np.r_[close[0], close[:-1]]
    return Bars(timestamps=pd.date_range(start, periods=len(close), freq=freq), open=prev,
                high=np.maximum(prev, close) * 1.001, low=np.minimum(prev, close) * 0.999, close=close,
                volume=np.full(len(close), 1000.0))


def _write(tmp_path, text: str, name: str = "bars.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------ loading


@pytest.mark.parametrize("name", ["sp500", "eurusd"])
def test_bundled_datasets_match_their_files(name):
    bars = load_dataset(name)
    raw = BUNDLED[name].read_text().strip().splitlines()
    first, last = raw[1].split(","), raw[-1].split(",")
    assert len(bars) == len(raw) - 1
    assert bars.timestamps[0] == pd.Timestamp(first[0]) and bars.timestamps[-1] == pd.Timestamp(last[0])
    assert bars.open[0] == float(first[1]) and bars.close[-1] == float(last[4]) and bars.volume[-1] == float(last[5])
    assert bars.infer_interval() == (pd.Timedelta("1D") if name == "sp500" else pd.Timedelta("1h"))
    assert bars.name == name and bars.timestamps.is_monotonic_increasing


def test_column_shapes_case_unnamed_index_and_no_volume(tmp_path):
    p = _write(tmp_path, ",OPEN,high,Low,cLoSe\n"
                         "2020-01-01 00:00,10,11,9,10.5\n"
                         "2020-01-01 01:00,10.5,12,10,11\n")
    bars = load_bars(p)
    assert len(bars) == 2 and bars.high.tolist() == [11.0, 12.0] and bars.low.tolist() == [9.0, 10.0]
    assert bars.volume.tolist() == [0.0, 0.0] and not bars.has_volume
    assert bars.timestamps[1] == pd.Timestamp("2020-01-01 01:00")


@pytest.mark.parametrize("cells,expected", [
    (("2020-03-01T10:00:00+02:00", "2020-03-01T11:00:00+02:00"), pd.Timestamp("2020-03-01 08:00", tz="UTC")),
    (("2020-03-01T08:00:00Z", "2020-03-01T09:00:00Z"), pd.Timestamp("2020-03-01 08:00", tz="UTC")),
    (("2020-03-01 08:00:00 UTC", "2020-03-01 09:00:00 UTC"), pd.Timestamp("2020-03-01 08:00", tz="UTC")),
    (("01-03-2020", "02-03-2020"), pd.Timestamp("2020-03-01")),  # D-M-Y stays naive
    (("03/01/2020", "03/02/2020"), pd.Timestamp("2020-03-01")),          # US M/D/Y
    (("13.03.2020 08:00:00.000", "14.03.2020 08:00:00.000"), pd.Timestamp("2020-03-13 08:00")),  # D.M.Y
    (("1583049600", "1583053200"), pd.Timestamp("2020-03-01 08:00", tz="UTC")),  # unix seconds
])
def test_timestamp_formats(tmp_path, cells, expected):
    p = _write(tmp_path, f"time,open,high,low,close,volume\n{cells[0]},1,2,0.5,1.5,10\n{cells[1]},1.5,2,1,1.2,20\n")
    assert load_bars(p).timestamps[0] == expected


def test_parquet_with_datetime_index(tmp_path):
    idx = pd.date_range("2022-05-01", periods=3, freq="D", tz="America/New_York", name="Date")
    df = pd.DataFrame({"Open": [1.0, 2, 3], "High": [2.0, 3, 4], "Low": [0.5, 1, 2], "Close": [1.5, 2.5, 3.5]}, index=idx)
    df.to_parquet(tmp_path / "x.parquet")
    bars = load_bars(tmp_path / "x.parquet")
    assert bars.timestamps[0] == pd.Timestamp("2022-05-01 04:00", tz="UTC")  # EDT = UTC−4
    assert bars.close.tolist() == [1.5, 2.5, 3.5]


def test_data_error_lists_all_problems_capped(tmp_path):
    rows = "".join(f"2020-01-{d:02d},1,0.5,0.4,1\n" for d in range(1, 31))  # 30 rows with high < open
    with pytest.raises(DataError) as ei:
        load_bars(_write(tmp_path, "date,open,high,low,close\n" + rows))
    err = ei.value
    assert len(err.problems) == 30 and {p.rule for p in err.problems} == {"high_below_open_close"}
    assert [p.row for p in err.problems] == list(range(2, 32))  # header is line 1
    text = str(err)
    assert "bars.csv:21:" in text and "bars.csv:22:" not in text and "... and 10 more" in text


# ------------------------------------------------------------------ Bars


def test_bars_slice_fingerprint_interval():
    bars = _bars_from_close(np.linspace(100, 110, 50))
    s = bars.slice(10, 20)
    assert len(s) == 10 and s.close[0] == bars.close[10] and s.timestamps[-1] == bars.timestamps[19]
    assert s.fingerprint() == bars.slice(10, 20).fingerprint()
    assert s.fingerprint() != bars.slice(11, 21).fingerprint()
    c = bars.close.copy()
    c[5] *= 1.0 + 1e-12
    assert Bars(bars.timestamps, bars.open, bars.high, bars.low, c, bars.volume).fingerprint() != bars.fingerprint()
    with pytest.raises(ValueError):
        bars.slice(40, 60)
    # business days: gaps of 1 day (×4) and 3 days (×1) per week → median 1 day
    days = _bars_from_close(np.linspace(1, 2, 30), start="2021-01-04", freq="B")
    assert days.infer_interval() == pd.Timedelta("1D")


# ------------------------------------------------------------------ volatility / features / regimes


def test_volatility_hand_cases():
    # constant log return r: EWMA(r²) = r² exactly, so σ_t = |r| for t ≥ 1
    r = 0.01
    bars = _bars_from_close(100 * np.exp(r * np.arange(40)))
    np.testing.assert_allclose(volatility(bars)[1:], r, rtol=1e-12)
    # flat prices: σ at the floor, never 0
    flat = _bars_from_close(np.full(30, 50.0))
    assert (volatility(flat)[1:] == VOL_FLOOR).all()


def test_volatility_matches_explicit_ewma():
    bars = generate(400, seed=3).bars
    r = np.diff(np.log(bars.close))
    a = 2.0 / (VOL_SPAN + 1)
    sig = volatility(bars)
    for t in (1, 2, 10, 150, 399):
        w = (1 - a) ** np.arange(t - 1, -1, -1)  # weight of r_1..r_t (adjust=True)
        expect = math.sqrt(np.sum(w * r[:t] ** 2) / np.sum(w))
        assert sig[t] == pytest.approx(max(expect, VOL_FLOOR), rel=1e-10)


def _adx_loop(h, l, c, n=14):
    """Wilder's ADX written as a plain recursion (independent of the pandas version)."""
    a = 1.0 / n
    atr = pdm_s = ndm_s = adx = None
    out = []
    for t in range(len(c)):
        if t == 0:
            tr, pdm, ndm = h[0] - l[0], 0.0, 0.0
        else:
            up, dn = h[t] - h[t - 1], l[t - 1] - l[t]
            pdm = up if (up > dn and up > 0) else 0.0
            ndm = dn if (dn > up and dn > 0) else 0.0
            tr = max(h[t] - l[t], abs(h[t] - c[t - 1]), abs(l[t] - c[t - 1]))
        atr = tr if atr is None else (1 - a) * atr + a * tr
        pdm_s = pdm if pdm_s is None else (1 - a) * pdm_s + a * pdm
        ndm_s = ndm if ndm_s is None else (1 - a) * ndm_s + a * ndm
        pdi, ndi = 100 * pdm_s / atr, 100 * ndm_s / atr
        dx = 100 * abs(pdi - ndi) / (pdi + ndi) if pdi + ndi > 0 else 0.0
        adx = dx if adx is None else (1 - a) * adx + a * dx
        out.append((adx, pdi, ndi))
    return np.array(out)


def test_adx_and_regime_labels_match_independent_loops():
    bars = generate(700, seed=5).bars
    ref = _adx_loop(bars.high, bars.low, bars.close)
    adx, pdi, ndi = _adx(bars)
    np.testing.assert_allclose(np.c_[adx, pdi, ndi], ref, rtol=1e-9, atol=1e-9)
    labels = regime_labels(bars)
    assert labels.dtype == np.int64 and labels.min() >= 0 and labels.max() < N_REGIMES
    assert len(REGIME_NAMES) == N_REGIMES and REGIME_NAMES[0] == "low-vol down" and REGIME_NAMES[8] == "high-vol up"
    sig = volatility(bars)
    from shared.market import ADX_TREND, REGIME_VOL_WINDOW
    for t in (25, 300, 699):  # t=699: the window of 500 no longer starts at 0
        win = sig[max(0, t - REGIME_VOL_WINDOW + 1): t + 1]
        q1, q2 = np.quantile(win, [1 / 3, 2 / 3])
        vb = int(sig[t] > q1) + int(sig[t] > q2)
        tb = 1 if ref[t, 0] <= ADX_TREND else (2 if ref[t, 1] > ref[t, 2] else 0)
        assert labels[t] == vb * 3 + tb, t
    assert len(np.unique(labels)) >= 6  # buckets are actually used


def test_features_shape_scale_and_hand_values():
    bars = generate(1500, seed=1).bars
    x = compute_features(bars)
    assert x.dtype == np.float32 and x.shape == (1500, len(FEATURE_NAMES)) and 12 <= x.shape[1] <= 16
    assert np.isfinite(x).all() and (x[:FEATURE_WARMUP] == 0).all()
    body = x[FEATURE_WARMUP:]
    assert (body.std(axis=0) > 0.05).all(), "every feature varies after warm-up"
    assert (np.abs(body).mean(axis=0) < 3).all(), "roughly unit scale"
    sig = volatility(bars)
    t = 900
    j = FEATURE_NAMES.index
    assert x[t, j("ret_1")] == pytest.approx(math.log(bars.close[t] / bars.close[t - 1]) / sig[t], rel=1e-5)
    assert x[t, j("ret_20")] == pytest.approx(
        math.log(bars.close[t] / bars.close[t - 20]) / (sig[t] * math.sqrt(20)), rel=1e-5)
    hh, ll = bars.high[t - 19: t + 1].max(), bars.low[t - 19: t + 1].min()
    assert x[t, j("range_pos_20")] == pytest.approx(2 * (bars.close[t] - ll) / (hh - ll) - 1, rel=1e-5)


def test_features_without_volume_and_on_short_input():
    b = generate(300, seed=2).bars
    nov = Bars(b.timestamps, b.open, b.high, b.low, b.close, np.zeros(len(b)))
    x = compute_features(nov)
    assert (x[:, FEATURE_NAMES.index("volume_z")] == 0).all()
    short = compute_features(b.slice(0, 10))
    assert short.shape == (10, len(FEATURE_NAMES)) and (short == 0).all()
    assert regime_labels(b.slice(0, 3)).shape == (3,)


@pytest.mark.parametrize("dataset", ["synthetic", "sp500"])
def test_causality_future_bars_move_nothing_at_or_before_t(dataset):
    bars = load_dataset(dataset, seed=7).slice(0, 1600)
    base = (compute_features(bars), volatility(bars), regime_labels(bars))
    rng = np.random.default_rng(0)
    for t in (70, 400, 1100, 1598):
        k = np.arange(len(bars)) > t
        scale = np.where(k, np.exp(0.05 * rng.standard_normal(len(bars))) * 1.3, 1.0)
        wick = np.where(k, 1 + 0.02 * rng.random(len(bars)), 1.0)
        pert = Bars(bars.timestamps, bars.open * scale, bars.high * scale * wick, bars.low * scale / wick,
                    bars.close * scale, np.where(k, bars.volume * 5 + 1, bars.volume))
        new = (compute_features(pert), volatility(pert), regime_labels(pert))
        for a, b in zip(base, new):
            np.testing.assert_array_equal(a[: t + 1], b[: t + 1])
        # ...and the perturbation does reach the bars after t (the test can fail)
        assert not np.array_equal(base[0][t + 1:], new[0][t + 1:])


# ------------------------------------------------------------------ splits


def test_chronological_split_layout():
    s = chronological_split(1000)  # embargo = max(20, 10) = 20; usable 960 → 576 / 192 / 192
    assert s == Split(train=(0, 576), val=(596, 788), test=(808, 1000), embargo=20)
    big = chronological_split(5031)
    assert big.embargo == 51  # ceil(1% of 5031)
    assert big.val[0] - big.train[1] == 51 and big.test[0] - big.val[1] == 51 and big.test[1] == 5031
    assert Split.from_dict(big.to_dict()) == big
    custom = chronological_split(100, train=0.5, val=0.25, embargo=0)
    assert custom == Split((0, 50), (50, 75), (75, 100), 0)
    with pytest.raises(ValueError, match="train \\+ val < 1"):
        chronological_split(1000, train=0.8, val=0.3)
    with pytest.raises(ValueError, match="at least 1"):
        chronological_split(40)


def test_window_hash_is_the_window_fingerprint():
    bars = generate(600, seed=0).bars
    s = chronological_split(len(bars))
    assert s.window_hash(bars, "val") == bars.slice(*s.val).fingerprint()
    assert len({s.window_hash(bars, w) for w in ("train", "val", "test")}) == 3
    with pytest.raises(ValueError, match="'train', 'val' or 'test'"):
        s.window_hash(bars, "oos")


def test_walk_forward_folds():
    folds = walk_forward_folds(1000, n_folds=4)  # emb 20; 960 = 5u + 3u → u = 120: train 360, val/test 120
    assert len(folds) == 4
    for k, f in enumerate(folds):
        assert f.train == (120 * k, 120 * k + 360)
        assert f.val[0] - f.train[1] == 20 and f.test[0] - f.val[1] == 20
        assert f.val[1] - f.val[0] == 120 and f.test[1] - f.test[0] == 120
    assert folds[-1].test[1] == 1000
    # test windows tile the tail without overlap
    assert all(a.test[1] == b.test[0] for a, b in zip(folds, folds[1:]))
    explicit = walk_forward_folds(500, n_folds=3, train_bars=200, val_bars=50, test_bars=50, embargo=10, step=25)
    assert explicit[2] == Split((50, 250), (260, 310), (320, 370), 10)
    # `step` alone: the test windows take its length, so they abut (10 007 bars, step 100 gave windows of 1 921 bars
    # that overlapped by 95 %)
    stepped = walk_forward_folds(10_007, n_folds=3, step=100)
    assert all(f.test[1] - f.test[0] == 100 for f in stepped)
    assert all(a.test[1] <= b.test[0] for a, b in zip(stepped, stepped[1:]))
    with pytest.raises(ValueError, match="need 1040 bars, but there are only 1000"):
        walk_forward_folds(1000, n_folds=3, train_bars=600, val_bars=100, test_bars=100)
    with pytest.raises(ValueError, match="n_folds"):
        walk_forward_folds(1000, n_folds=0)
    with pytest.raises(ValueError, match="too few"):
        walk_forward_folds(45, n_folds=5)  # 45 − 2·20 = 5 bars for 9 units


def _same_bars(a, b) -> bool:
    return a.timestamps.equals(b.timestamps) and all(
        np.array_equal(getattr(a, c), getattr(b, c)) for c in ("open", "high", "low", "close", "volume"))


@pytest.mark.parametrize("kind", ["bundled_eurusd", "bundled_sp500", "synthetic", "aware", "epoch"])
def test_fast_csv_reader_accepts_clean_files_bit_identical_to_the_validating_reader(tmp_path, kind):
    from pathlib import Path

    from shared.market import _read_csv_fast

    data = Path(__file__).resolve().parents[1] / "shared" / "data"
    if kind.startswith("bundled"):
        p = data / ("eurusd_1h_2017.csv" if kind.endswith("eurusd") else "sp500_daily_1999_2018.csv")
    else:
        frame = generate(n_bars=3000, seed=3).bars.to_frame().rename_axis("timestamp")
        if kind == "aware":
            frame.index = frame.index.tz_localize("UTC").tz_convert("America/New_York")
        if kind == "epoch":
            frame.index = frame.index.asi8 // 10**9
        p = tmp_path / "bars.csv"
        frame.to_csv(p)
    fast = _read_csv_fast(p, None)
    assert fast is not None, "the fast reader should accept this clean file"
    assert _same_bars(fast, load_bars(p, fast=False)) and _same_bars(fast, load_bars(p))
    if kind == "aware":
        assert str(fast.timestamps.tz) == "UTC"


def test_fast_csv_reader_leaves_every_problem_to_the_validating_reader(tmp_path):
    """A bad cell anywhere: the fast reader declines, and load_bars names the file line and the column."""
    from shared.market import _read_csv_fast

    rows = "".join(f"2020-01-0{d} 00:00:00,1,2,0.5,1.5,10\n" for d in range(1, 6))
    for bad, where in ((rows.replace(",0.5,", ",abc,", 1), "csv:2: column 'low'"),
                       (rows.replace("2020-01-04", "2020-01-02"), "csv:5: column 'timestamp'"),
                       (rows.replace(",2,0.5,1.5,10\n2020-01-05", ",2,0.5,1.5\n2020-01-05"), "csv:5:"),
                       (rows.replace(",2,0.5", ",0.9,0.5", 1), "csv:2: column 'high'"),
                       (rows.replace("1.5,10\n", "1.5,10,7\n", 1), "csv:2: 7 fields, but the header has 6")):
        p = _write(tmp_path, "timestamp,open,high,low,close,volume\n" + bad)
        assert _read_csv_fast(p, None) is None
        with pytest.raises(DataError, match=where):
            load_bars(p)


def _fast_agrees_with_reference(p):
    """The fast reader's property: it accepts only what the validating reader accepts, with the same bars."""
    from shared.market import _read_csv_fast

    fast = _read_csv_fast(p, None)
    try:
        ref = load_bars(p, fast=False)
    except DataError as exc:
        assert fast is None, f"the fast reader accepted what the validating reader refuses: {exc}"
        return None
    assert fast is None or _same_bars(fast, ref)
    return ref


@pytest.mark.parametrize("cells,expected", [
    (("20200101", "20200102"), pd.Timestamp("2020-01-01")),                  # %Y%m%d dates, not epoch seconds
    (("1583049600.5", "1583053200.5"), pd.Timestamp("2020-03-01 08:00:00.5", tz="UTC")),
    (("0001583049600", "0001583053200"), pd.Timestamp("2020-03-01 08:00", tz="UTC")),   # 13 digits: epoch
    (("1", "2"), None),                             # too few digits for the epoch rule, and no date: refused
    (("1.5830496e9", "1.5830532e9"), None),         # numbers, but not as the epoch rule writes them
    (("+1583049600", "+1583053200"), None),
])
def test_numeric_timestamps_follow_the_epoch_rule_in_both_readers(tmp_path, cells, expected):
    p = _write(tmp_path, f"date,open,high,low,close\n{cells[0]},1,2,0.5,1.5\n{cells[1]},1.5,2,1,1.2\n")
    ref = _fast_agrees_with_reference(p)
    if expected is None:
        assert ref is None
        with pytest.raises(DataError, match=r"bars.csv:2: column 'date': cannot parse timestamp .*unparseable"):
            load_bars(p)
    else:
        assert load_bars(p).timestamps[0] == ref.timestamps[0] == expected


def test_parquet_numbers_follow_the_same_epoch_rule(tmp_path):
    df = pd.DataFrame({"date": [20200101, 20200102], "open": [1.0, 1], "high": [2.0, 2], "low": [0.5, 0.5],
                       "close": [1.0, 1]})
    df.to_parquet(tmp_path / "ymd.parquet")
    assert load_bars(tmp_path / "ymd.parquet").timestamps[0] == pd.Timestamp("2020-01-01")
    df.assign(date=[1583049600, 1583053200]).to_parquet(tmp_path / "epoch.parquet")
    assert load_bars(tmp_path / "epoch.parquet").timestamps[0] == pd.Timestamp("2020-03-01 08:00", tz="UTC")
    df.assign(date=[1, 2]).to_parquet(tmp_path / "tiny.parquet")
    with pytest.raises(DataError, match=r"row 0: column 'date': cannot parse timestamp '1' \[unparseable_timestamp\]"):
        load_bars(tmp_path / "tiny.parquet")


@pytest.mark.parametrize("cell,shown", [
    ("9999-12-31", "'9999-12-31'"),
    ("1600-01-01 10:00", "'1600-01-01 10:00'"),
    ("2262-04-12T00:00:00Z", "'2262-04-12T00:00:00Z'"),
])
@pytest.mark.parametrize("fast", [True, False])
def test_timestamp_outside_the_nanosecond_range_is_a_data_problem(tmp_path, cell, shown, fast):
    rows = ["2020-01-01T00:00:00Z", "2020-01-02T00:00:00Z"] if cell.endswith("Z") else ["2020-01-01", "2020-01-02"]
    rows = [rows[0], cell, rows[1]] if cell < "2020" else [*rows, cell]
    line = rows.index(cell) + 2
    p = _write(tmp_path, "timestamp,open,high,low,close\n" + "".join(f"{r},1,2,0.5,1\n" for r in rows))
    with pytest.raises(DataError) as ei:
        load_bars(p, fast=fast)
    probs = [x for x in ei.value.problems if x.rule == "timestamp_out_of_range"]
    assert [(x.row, x.column) for x in probs] == [(line, "timestamp")], str(ei.value)
    assert f"timestamp {shown}" in str(probs[0]) and "1677-09-21 00:12:44 … 2262-04-11 23:47:16" in str(probs[0])


def test_epoch_and_parquet_timestamps_out_of_range(tmp_path):
    p = _write(tmp_path, "timestamp,open,high,low,close\n1583049600,1,2,0.5,1\n99999999999,1,2,0.5,1\n")
    for fast in (True, False):
        with pytest.raises(DataError, match=r"bars.csv:3: column 'timestamp': timestamp '99999999999' "
                                            r"\(5138-11-16 09:46:39\+00:00\) is outside .*timestamp_out_of_range"):
            load_bars(p, fast=fast)
    df = pd.DataFrame({"date": np.array(["2020-01-01", "9999-01-01"], dtype="datetime64[s]"), "open": [1.0, 1],
                       "high": [2.0, 2], "low": [0.5, 0.5], "close": [1.0, 1]})
    df.to_parquet(tmp_path / "far.parquet")
    with pytest.raises(DataError, match=r"row 1: column 'date': timestamp '9999-01-01 00:00:00' is outside"):
        load_bars(tmp_path / "far.parquet")
    df["date"] = np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[s]")    # in range: read, in ns
    df.to_parquet(tmp_path / "ok.parquet")
    assert load_bars(tmp_path / "ok.parquet").timestamps.unit == "ns"


@pytest.mark.parametrize("encoding,bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff"),
                                          ("utf-32-le", b"\xff\xfe\x00\x00"), ("utf-32-be", b"\x00\x00\xfe\xff")])
def test_utf16_and_utf32_with_a_byte_order_mark_are_decoded(tmp_path, encoding, bom):
    text = "Date,Open,High,Low,Close\r\n2020-01-01,1,2,0.5,1.5\r\n2020-01-02,1.5,2,1,1.2\r\n"
    good = load_bars(_write(tmp_path, text.replace("\r\n", "\n"), "u8.csv"))
    p = tmp_path / "u.csv"
    p.write_bytes(bom + text.encode(encoding))
    assert _same_bars(load_bars(p), good)
    p.write_bytes(bom + (text + "\r\n2020-01-03,1.2,2,1,abc\r\n").encode(encoding))   # a blank line, then a bad cell
    with pytest.raises(DataError, match=r"u.csv:5: column 'close': non-numeric value 'abc' \[non_numeric\]"):
        load_bars(p)


def test_nul_bytes_without_a_byte_order_mark_are_named(tmp_path):
    p = tmp_path / "u.csv"
    p.write_bytes("Date,Open,High,Low,Close\n2020-01-01,1,2,0.5,1.5\n".encode("utf-16-le"))
    with pytest.raises(DataError) as ei:
        load_bars(p)
    (prob,) = ei.value.problems
    assert (prob.rule, prob.row) == ("unsupported_encoding", 1) and "save it as UTF-8" in prob.message
    p.write_bytes(b"\xff\xfe" + "Date,Open\n".encode("utf-16-le") + b"\x00\xd8")   # a BOM, then not UTF-16
    with pytest.raises(DataError, match=r"starts with a UTF-16 byte-order mark but is not UTF-16 text"):
        load_bars(p)
