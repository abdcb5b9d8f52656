"""Market data in: OHLCV bars (`Bars`), read from CSV or Parquet and validated (`load_bars`, `load_dataset`), with
every problem of a bad file reported at once (`DataError`). `shared.market` re-exports every name here.

- A `Bars` holds T bars in time order: `timestamps` (a `pd.DatetimeIndex`, naive, or UTC when the input carried a
  timezone) and float64 arrays `open, high, low, close, volume` of shape [T]. Volume is all zeros when the input had
  none.
- Bad input raises `DataError`, which lists every problem (file, row, column, rule, message). CSV rows are named by
  their line in the file as an editor shows it (header = line 1); Parquet rows by 0-based index.

ML core: imports only numpy, pandas and the standard library.
"""
from __future__ import annotations

import csv
import hashlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

DATA_DIR = Path(__file__).parent / "data"
BUNDLED = {
    "sp500": DATA_DIR / "sp500_daily_1999_2018.csv",
    "eurusd": DATA_DIR / "eurusd_1h_2017.csv",
}
DATASET_NAMES = ("synthetic", *BUNDLED)
MAX_REPORTED_PROBLEMS = 20

# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataProblem:
    """One problem in an input file. `row` is a 1-based line number (row_label "line", CSV) or a 0-based
    row index (row_label "row", Parquet); None when the problem concerns the whole file."""

    file: str
    row: int | None
    column: str | None
    rule: str
    message: str
    row_label: str = "line"

    def __str__(self) -> str:
        if self.row is None:
            where = f"{self.file}:"
        elif self.row_label == "line":
            where = f"{self.file}:{self.row}:"
        else:
            where = f"{self.file}: row {self.row}:"
        col = f" column '{self.column}':" if self.column else ""
        return f"{where}{col} {self.message} [{self.rule}]"


class DataError(ValueError):
    """Input data that cannot be used. `.problems` lists all of them; str() shows the first
    `MAX_REPORTED_PROBLEMS` one per line and says how many more there are."""

    def __init__(self, problems: list[DataProblem]):
        self.problems = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        n = len(self.problems)
        lines = [f"{n} problem{'s' if n != 1 else ''} in the input data:"]
        lines += [f"  {p}" for p in self.problems[:MAX_REPORTED_PROBLEMS]]
        if n > MAX_REPORTED_PROBLEMS:
            lines.append(f"  ... and {n - MAX_REPORTED_PROBLEMS} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._render()


# ---------------------------------------------------------------------------------------------------------
# Bars
# ---------------------------------------------------------------------------------------------------------

PRICE_COLUMNS = ("open", "high", "low", "close")


@dataclass(frozen=True, eq=False)
class Bars:
    """T OHLCV bars in time order (see the module docstring for conventions)."""

    timestamps: pd.DatetimeIndex
    open: np.ndarray
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    volume: np.ndarray
    name: str = "bars"
    source: str = ""

    def __post_init__(self) -> None:
        ts = pd.DatetimeIndex(self.timestamps)
        object.__setattr__(self, "timestamps", ts.as_unit("ns"))
        n = len(ts)
        for col in (*PRICE_COLUMNS, "volume"):
            arr = np.ascontiguousarray(getattr(self, col), dtype=np.float64)
            if arr.shape != (n,):
                raise ValueError(f"Bars.{col} has shape {arr.shape}, expected ({n},) like the timestamps")
            object.__setattr__(self, col, arr)

    def __len__(self) -> int:
        return len(self.timestamps)

    def __repr__(self) -> str:
        span = f"{self.timestamps[0]} → {self.timestamps[-1]}" if len(self) else "empty"
        return f"Bars(name={self.name!r}, n={len(self)}, {span})"

    @property
    def has_volume(self) -> bool:
        """True when the input carried a volume column with some non-zero value."""
        return bool(np.any(self.volume > 0))

    def slice(self, start: int, stop: int) -> "Bars":
        """Bars [start, stop) as a new `Bars` (copies, so the parent is never aliased)."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"Bars.slice({start}, {stop}) out of range for {len(self)} bars")
        return Bars(
            timestamps=self.timestamps[start:stop],
            **{c: getattr(self, c)[start:stop].copy() for c in (*PRICE_COLUMNS, "volume")},
            name=self.name,
            source=self.source,
        )

    def fingerprint(self) -> str:
        """sha256 hex of the bar contents (timestamps in ns and the five float64 columns); name-independent."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.timestamps.asi8, dtype="<i8").tobytes())
        for col in (*PRICE_COLUMNS, "volume"):
            h.update(np.ascontiguousarray(getattr(self, col), dtype="<f8").tobytes())
        return h.hexdigest()

    def infer_interval(self) -> pd.Timedelta:
        """The median spacing between consecutive timestamps (robust to weekends and holidays)."""
        if len(self) < 2:
            raise ValueError("infer_interval needs at least 2 bars")
        return pd.Timedelta(int(np.median(np.diff(self.timestamps.asi8))), unit="ns")

    def to_frame(self) -> pd.DataFrame:
        """The bars as a DataFrame indexed by timestamp with columns open, high, low, close, volume."""
        return pd.DataFrame({c: getattr(self, c) for c in (*PRICE_COLUMNS, "volume")},
                            index=self.timestamps.rename("timestamp"))


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------

_TIME_NAMES = ("timestamp", "datetime", "date time", "date", "time", "gmt time", "local time", "ts")
_NAN_TOKENS = {"", "nan", "na", "n/a", "null", "none", "-", "#n/a"}
_INF_RE = re.compile(r"^[+-]?(inf|infinity)$", re.IGNORECASE)
_TZ_RE = re.compile(r"\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?\s*(?:z|utc|[+-]\d{2}:?\d{2})$", re.IGNORECASE)
_EPOCH_DIGITS = (9, 19)   # a timestamp column is epoch numbers when every cell has 9–19 integer digits (`_epoch_cells`)
_EPOCH_RE = re.compile(rf"^\d{{{_EPOCH_DIGITS[0]},{_EPOCH_DIGITS[1]}}}(\.\d+)?$")
_NS_RANGE = (pd.Timestamp.min, pd.Timestamp.max)   # what a nanosecond DatetimeIndex (a `Bars`) holds
_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
         (b"\xfe\xff", "utf-16"))
_DATE_FORMATS = (
    "%m/%d/%Y", "%m/%d/%Y %H:%M", "%m/%d/%Y %H:%M:%S",
    "%d/%m/%Y", "%d/%m/%Y %H:%M", "%d/%m/%Y %H:%M:%S",
    "%d.%m.%Y", "%d.%m.%Y %H:%M", "%d.%m.%Y %H:%M:%S", "%d.%m.%Y %H:%M:%S.%f",
    "%Y/%m/%d", "%Y/%m/%d %H:%M", "%Y/%m/%d %H:%M:%S", "%Y.%m.%d %H:%M", "%Y.%m.%d %H:%M:%S",
    "%Y%m%d", "%Y%m%d %H:%M:%S", "%Y%m%d %H%M%S", "%d-%m-%Y", "%d-%m-%Y %H:%M", "%d-%b-%Y", "%b %d, %Y",
)


class _Collector:
    """Accumulates `DataProblem`s for one file, turning positional row indices into the user's row names."""

    def __init__(self, file: str, row_names: np.ndarray, row_label: str):
        self.file, self.row_names, self.row_label = file, row_names, row_label
        self.problems: list[DataProblem] = []

    def add(self, i: int | None, column: str | None, rule: str, message: str) -> None:
        row = None if i is None else int(self.row_names[i])
        self.problems.append(DataProblem(self.file, row, column, rule, message, self.row_label))

    def fatal(self, column: str | None, rule: str, message: str) -> DataError:
        self.add(None, column, rule, message)
        return DataError(self.problems)


def _csv_line_numbers(path: Path, n_rows: int, encoding: str = "utf-8") -> np.ndarray:
    """1-based line numbers of the data rows as an editor shows them (blank lines skipped like pandas)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if encoding.startswith(("utf-16", "utf-32")):
            raw = raw.decode(encoding).encode("utf-8")
        lines = [i + 1 for i, line in enumerate(raw.split(b"\n")) if line.strip()]
    except (OSError, UnicodeDecodeError):
        lines = []
    data_lines = np.asarray(lines[1:], dtype=np.int64)
    if len(data_lines) != n_rows:  # quoted newlines or a compressed file: fall back to "header + i"
        data_lines = np.arange(n_rows, dtype=np.int64) + 2
    return data_lines


def _check_field_counts(path: Path, encoding: str) -> list[DataProblem]:
    """Rows whose number of fields differs from the header's (pandas would shift or pad them silently)."""
    problems: list[DataProblem] = []
    with open(path, encoding=encoding, newline="") as f:
        reader = csv.reader(f)
        n_header = None
        for fields in reader:
            if not fields or all(not x.strip() for x in fields):
                continue
            if n_header is None:
                n_header = len(fields)
            elif len(fields) != n_header:
                problems.append(DataProblem(str(path), reader.line_num, None, "wrong_field_count",
                                            f"{len(fields)} fields, but the header has {n_header}"))
    return problems


def _text_encoding(raw: bytes, f: str) -> str:
    """The encoding of an uncompressed CSV's bytes: UTF-16/UTF-32 by their byte-order mark, else UTF-8, else Latin-1
    (so that a bad byte is reported in its cell). NUL bytes without a byte-order mark are refused by name."""
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            try:
                raw.decode(enc)
            except UnicodeDecodeError as exc:
                raise DataError([DataProblem(f, None, None, "unreadable_file", f"starts with a {enc.upper()} "
                                             f"byte-order mark but is not {enc.upper()} text ({exc.reason} at byte "
                                             f"{exc.start}); save it as UTF-8 CSV")]) from None
            return enc
    if b"\x00" in raw:
        line = raw.count(b"\n", 0, raw.index(b"\x00")) + 1
        raise DataError([DataProblem(f, line, None, "unsupported_encoding",
                                     "contains NUL bytes (UTF-16 or UTF-32 text without a byte-order mark, or not a "
                                     "text file); save it as UTF-8 CSV")])
    try:
        raw.decode("utf-8")
        return "utf-8-sig"
    except UnicodeDecodeError:
        return "latin-1"


def _read_table(path: Path) -> tuple[pd.DataFrame, np.ndarray, str]:
    """Read a CSV (all cells as strings) or Parquet file; returns (frame, row names, row label)."""
    f = str(path)
    if not path.exists():
        raise DataError([DataProblem(f, None, None, "file_not_found",
                                     f"no such file (dataset names: {', '.join(DATASET_NAMES)})")])
    if path.is_dir():
        raise DataError([DataProblem(f, None, None, "unreadable_file", "is a directory, not a CSV or Parquet file")])
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".parquet", ".pq"):
        try:
            df = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises many types; all mean "not a readable Parquet file"
            raise DataError([DataProblem(f, None, None, "unreadable_file",
                                         f"cannot read as Parquet: {type(exc).__name__}: {exc}")]) from None
        if isinstance(df.index, pd.DatetimeIndex) or df.index.name is not None:
            df = df.reset_index()
        if len(df.columns) == 0:
            raise DataError([DataProblem(f, None, None, "empty_file", "the Parquet file has no columns")])
        return df, np.arange(len(df), dtype=np.int64), "row"
    try:
        with open(path, "rb") as fb:
            raw = fb.read()
        compressed = suffixes and suffixes[-1] in (".gz", ".bz2", ".zip", ".xz", ".zst")
        if compressed:
            try:
                raw.decode("utf-8")
                encoding = "utf-8-sig"
            except UnicodeDecodeError:
                encoding = "latin-1"
        else:
            encoding = _text_encoding(raw, f)
        ragged = [] if compressed else _check_field_counts(path, encoding)
        if not ragged:
            df = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True, encoding=encoding,
                             index_col=False)
    except DataError:
        raise
    except pd.errors.EmptyDataError:
        raise DataError([DataProblem(f, None, None, "empty_file", "the file is empty (no header, no rows)")]) from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, ValueError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        m = re.search(r"line (\d+)", msg)
        row = int(m.group(1)) if m else None
        raise DataError([DataProblem(f, row, None, "unreadable_file", f"cannot parse as CSV: {msg}")]) from None
    if ragged:
        raise DataError(ragged)
    return df, _csv_line_numbers(path, len(df), encoding), "line"


def _normalise_columns(df: pd.DataFrame, col: _Collector) -> dict[str, str]:
    """Map canonical names (timestamp, open, high, low, close, volume) to the frame's own column names."""
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    for raw in df.columns:
        key = str(raw).strip().lower().replace("_", " ")
        key = "volume" if key == "vol" else key
        mangled = re.fullmatch(r"(.+)\.\d+", key)  # pandas renames a repeated CSV column "open" to "open.1"
        if mangled and mangled.group(1) in seen:
            key = mangled.group(1)
        if key in seen and key in (*PRICE_COLUMNS, "volume", *_TIME_NAMES):
            col.add(None, seen[key], "duplicate_column",
                    f"column '{seen[key]}' appears more than once (column names are case-insensitive)")
        seen.setdefault(key, str(raw))
        if key in (*PRICE_COLUMNS, "volume"):
            mapping.setdefault(key, raw)
    for name in _TIME_NAMES:
        if name in seen:
            mapping["timestamp"] = seen[name]
            break
    else:
        first = str(df.columns[0]) if len(df.columns) else ""
        if first == "" or first.lower().startswith("unnamed") or first.lower() == "index":
            mapping["timestamp"] = df.columns[0]
    missing = [c for c in ("timestamp", *PRICE_COLUMNS) if c not in mapping]
    for c in missing:
        hint = (" (expected a 'timestamp', 'date' or 'time' column, or an unnamed first index column)"
                if c == "timestamp" else "")
        col.add(None, c, "missing_column",
                f"missing column '{c}'{hint}; found columns: {', '.join(map(str, df.columns))}")
    if col.problems:
        raise DataError(col.problems)
    return mapping


def _parse_numbers(s: pd.Series, name: str, col: _Collector) -> np.ndarray:
    """Cells → float64, recording NaN / infinite / non-numeric cells as problems (those cells become NaN)."""
    if pd.api.types.is_bool_dtype(s) or not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_object_dtype(s)
                                              or pd.api.types.is_string_dtype(s)):
        col.add(None, name, "non_numeric", f"column '{name}' has type {s.dtype}, expected numbers")
        return np.full(len(s), np.nan)
    if pd.api.types.is_numeric_dtype(s):
        vals = np.array(s.to_numpy(dtype=np.float64, na_value=np.nan), dtype=np.float64)
        for i in np.flatnonzero(np.isnan(vals)):
            col.add(int(i), name, "nan", "missing value (NaN)")
        for i in np.flatnonzero(np.isinf(vals)):
            col.add(int(i), name, "infinite", f"infinite value ({vals[i]})")
        vals[~np.isfinite(vals)] = np.nan
        return vals
    text = s.astype(object).where(s.notna(), "").astype(str).str.strip()
    vals = np.array(pd.to_numeric(text, errors="coerce"), dtype=np.float64)  # strict: "1,5" is not a number
    for i in np.flatnonzero(~np.isfinite(vals)):
        cell = text.iat[i]
        if cell.lower() in _NAN_TOKENS:
            col.add(int(i), name, "nan", f"missing value (NaN){'' if cell == '' else f' {cell!r}'}")
        elif _INF_RE.match(cell) or np.isinf(vals[i]):
            col.add(int(i), name, "infinite", f"infinite value {cell!r}")
        else:
            col.add(int(i), name, "non_numeric", f"non-numeric value {cell!r}")
    vals[~np.isfinite(vals)] = np.nan
    return vals


def _parse_timestamps(s: pd.Series, name: str, col: _Collector) -> pd.DatetimeIndex:
    """Parse a timestamp column (datetime dtype, epoch numbers, ISO strings or a common date format).
    Timezone-aware input is converted to UTC; naive input stays naive. Cells that do not parse, or fall outside the
    nanosecond range (`_NS_RANGE`), are problems and become NaT; the result is in ns, as a `Bars` holds it."""
    if isinstance(s.dtype, pd.DatetimeTZDtype):
        out = pd.DatetimeIndex(s).tz_convert("UTC")
    elif pd.api.types.is_datetime64_dtype(s):
        out = pd.DatetimeIndex(s)
    elif (epoch := _epoch_cells(s)) is not None:
        out = epoch
    else:   # text, or numbers that are not epoch stamps (20200101 is a %Y%m%d date)
        text = s.astype(object).where(s.notna(), "").astype(str).str.strip()
        text = text.str.replace(r"\s*(?:UTC|GMT)$", "Z", regex=True, case=False)  # "10:00 UTC" → "10:00Z"
        nonempty = text[text != ""]
        aware = bool(len(nonempty)) and nonempty.str.contains(_TZ_RE).mean() > 0.5
        best = pd.DatetimeIndex(pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True))
        if best.isna().any():
            for fmt in _DATE_FORMATS:
                cand = pd.DatetimeIndex(pd.to_datetime(text, format=fmt, errors="coerce", utc=True))
                if cand.notna().sum() > best.notna().sum():
                    best = cand
        out = best if aware else best.tz_localize(None)
    out = pd.DatetimeIndex(out)
    for i in np.flatnonzero(out.isna()):
        cell = s.iat[i]
        col.add(int(i), name, "unparseable_timestamp", f"cannot parse timestamp {str(cell)!r}"
                if not (isinstance(cell, str) and cell.strip() == "") and not pd.isna(cell)
                else "missing timestamp")
    outside = _out_of_range(out)
    for i in np.flatnonzero(outside):
        cell, read = str(s.iat[i]).strip(), str(out[i])
        col.add(int(i), name, "timestamp_out_of_range",
                f"timestamp {cell!r}{'' if read.startswith(cell) else f' ({read})'} is outside "
                f"{_NS_RANGE[0].ceil('s')} … {_NS_RANGE[1].floor('s')}, the range of nanosecond timestamps")
    return out.where(~outside).as_unit("ns")


def _out_of_range(ts: pd.DatetimeIndex) -> np.ndarray:
    """True where a parsed timestamp lies outside what a nanosecond `DatetimeIndex` (a `Bars`) can hold."""
    per = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[ts.unit]
    v = ts.asi8
    return ~np.asarray(ts.isna()) & ((v < -(-_NS_RANGE[0].value // per)) | (v > _NS_RANGE[1].value // per))


def _epoch_cells(s: pd.Series) -> pd.DatetimeIndex | None:
    """The epoch rule, the one both readers apply: a column is Unix epoch numbers when every non-empty cell is a
    non-negative number with `_EPOCH_DIGITS` integer digits (as text: `_EPOCH_RE`); None when it is not."""
    if pd.api.types.is_bool_dtype(s) or not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_object_dtype(s)
                                              or pd.api.types.is_string_dtype(s)):
        return None
    if pd.api.types.is_numeric_dtype(s):    # Parquet numbers: the same rule on their value
        x = s.to_numpy(dtype=np.float64, na_value=np.nan)
        ok = np.isnan(x) | ((x >= 10.0 ** (_EPOCH_DIGITS[0] - 1)) & (x < 10.0 ** _EPOCH_DIGITS[1]))
        return _epoch(x) if ok.all() and not np.isnan(x).all() else None
    text = s.fillna("").astype(str).str.strip()
    empty = np.asarray(text == "")
    if empty.all() or not text[~empty].str.match(_EPOCH_RE).all():
        return None
    return _epoch(text.mask(empty).astype(np.float64).to_numpy(dtype=np.float64, na_value=np.nan))


def _epoch(x: np.ndarray) -> pd.DatetimeIndex:
    """Unix epoch numbers → DatetimeIndex (UTC), unit guessed from the magnitude (s, ms, µs or ns)."""
    mag = np.nanmedian(np.abs(x)) if np.isfinite(x).any() else 0.0
    unit = "ns" if mag > 1e17 else "us" if mag > 1e14 else "ms" if mag > 1e11 else "s"
    return pd.DatetimeIndex(pd.to_datetime(x, unit=unit, errors="coerce", utc=True))


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def _check_rows(ts: pd.DatetimeIndex, px: dict[str, np.ndarray], col: _Collector, tname: str) -> None:
    """The row rules: sorted unique timestamps, positive prices, low ≤ min(open, close) ≤ max(open, close) ≤ high,
    non-negative volume. Rows with unparsed cells are skipped by the rules that need those cells."""
    t = ts.asi8.astype(np.int64)
    ok_t = ~ts.isna()
    idx = np.flatnonzero(ok_t)
    if len(idx) == len(t) and bool((np.diff(t) > 0).all()):
        idx = idx[:0]                       # every timestamp parsed and strictly increasing: nothing to report
    if len(idx) > 1:
        prev, cur = idx[:-1], idx[1:]
        for p, c in zip(prev[t[cur] < t[prev]], cur[t[cur] < t[prev]]):
            col.add(int(c), tname, "unsorted_timestamp",
                    f"timestamp {ts[c]} is earlier than the previous row's {ts[p]} (timestamps must increase)")
    first_seen: dict[int, int] = {}
    for i in idx:
        j = first_seen.setdefault(int(t[i]), int(i))
        if j != i:
            col.add(int(i), tname, "duplicate_timestamp",
                    f"duplicate timestamp {ts[i]} (same as {col.row_label} {int(col.row_names[j])})")
    for name in PRICE_COLUMNS:
        for i in np.flatnonzero(px[name] <= 0):
            col.add(int(i), name, "non_positive_price", f"{name} must be > 0 (got {name}={_fmt(px[name][i])})")
    o, h, l, c = px["open"], px["high"], px["low"], px["close"]
    with np.errstate(invalid="ignore"):    # fmax/fmin: a missing open or close hides none of these rules
        top, bottom = np.fmax(o, c), np.fmin(o, c)
        for i in np.flatnonzero(h < top):
            col.add(int(i), "high", "high_below_open_close",
                    f"high below max(open, close) (high={_fmt(h[i])}, open={_fmt(o[i])}, close={_fmt(c[i])})")
        for i in np.flatnonzero(l > bottom):
            col.add(int(i), "low", "low_above_open_close",
                    f"low above min(open, close) (low={_fmt(l[i])}, open={_fmt(o[i])}, close={_fmt(c[i])})")
        for i in np.flatnonzero((h < l) & np.isnan(top)):   # with an open or a close, one of the two above holds it
            col.add(int(i), "high", "high_below_low", f"high below low (high={_fmt(h[i])}, low={_fmt(l[i])})")
        if "volume" in px:
            v = px["volume"]
            for i in np.flatnonzero(v < 0):
                col.add(int(i), "volume", "negative_volume", f"volume must be ≥ 0 (got volume={_fmt(v[i])})")


def _read_csv_fast(path: Path, name: str | None) -> Bars | None:
    """The common case at the C parser's speed: a plain UTF-8 `.csv` with numeric price columns and ISO-8601 or
    epoch timestamps, every row valid under the same rules. None on anything else, and `load_bars` then reads the
    file again with the validating reader, which names every problem with its line: this path only accepts.
    Bit-identical to the validating reader on what it accepts (tests/test_market.py); 5·10^6 rows: ~70 s → ~s."""
    if path.suffix.lower() != ".csv" or not path.is_file():
        return None
    opts = dict(skipinitialspace=True, index_col=False, encoding="utf-8-sig", engine="c")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)   # a row longer than the header
            # the timestamp column as text: the epoch rule is about the cells as written ("1.6e9", "+1600000000"
            # and 20200101 are not epochs); the header alone says which column it is
            head = pd.read_csv(path, nrows=0, **opts)
            stamp = _normalise_columns(head, _Collector(str(path), np.zeros(0, dtype=np.int64), "row"))["timestamp"]
            df = pd.read_csv(path, low_memory=False, dtype={stamp: str}, **opts)
    except Exception:  # noqa: BLE001 — any trouble: the validating reader says what it is
        return None
    if bool(df.isna().to_numpy().any()):    # an empty or NaN cell, or a row shorter than the header
        return None
    col = _Collector(str(path), np.arange(len(df), dtype=np.int64), "row")
    try:
        mapping = _normalise_columns(df, col)
    except DataError:
        return None
    if len(df) == 0 or col.problems or len(df.columns) != len(set(map(str, df.columns))):
        return None
    px = {}
    for c in (*PRICE_COLUMNS, "volume"):
        if c in mapping:
            v = df[mapping[c]]
            if not pd.api.types.is_numeric_dtype(v) or pd.api.types.is_bool_dtype(v):
                return None
            px[c] = v.to_numpy(dtype=np.float64, na_value=np.nan)
            if not np.isfinite(px[c]).all():
                return None
    t = df[mapping["timestamp"]]
    if not (pd.api.types.is_object_dtype(t) or pd.api.types.is_string_dtype(t)) or not isinstance(t.iat[0], str):
        return None
    if _EPOCH_RE.match(t.iat[0].strip()):
        ts = _epoch_cells(t)                # None unless every cell is an epoch number: the validating reader decides
        if ts is None:
            return None
    else:
        aware = bool(_TZ_RE.search(t.iat[0]))
        if aware and not t.str.contains(_TZ_RE).all():
            return None                     # naive and zoned stamps mixed: the validating reader's rule decides
        try:
            ts = pd.DatetimeIndex(pd.to_datetime(t, format="ISO8601", utc=aware))
        except (ValueError, TypeError, OverflowError):
            return None
        if (ts.tz is not None) != aware:
            return None
    if ts.isna().any() or _out_of_range(ts).any():
        return None
    _check_rows(ts, px, col, str(mapping["timestamp"]) or "timestamp")
    if col.problems:
        return None
    return Bars(timestamps=ts, **{c: px[c] for c in PRICE_COLUMNS}, volume=px.get("volume", np.zeros(len(df))),
                name=name or path.name.split(".")[0], source=str(path))


def load_bars(path: str | Path, *, name: str | None = None, fast: bool = True) -> Bars:
    """Load OHLCV bars from a CSV or Parquet file, validating every row.

    Accepts a `timestamp`/`date`/`time`/`datetime` column (or an unnamed first index column), columns
    open/high/low/close in any case, and an optional volume. Raises `DataError` listing every problem
    (row ordering is checked on the timestamps as given: the file is never silently re-sorted).
    fast: try the C parser first (`_read_csv_fast`); the validating reader reads whatever it does not accept."""
    path = Path(path)
    if fast:
        bars = _read_csv_fast(path, name)
        if bars is not None:
            return bars
    df, row_names, row_label = _read_table(path)
    col = _Collector(str(path), row_names, row_label)
    mapping = _normalise_columns(df, col)
    if len(df) == 0:
        raise col.fatal(None, "no_rows", "the file has a header but no data rows")
    tname = str(mapping["timestamp"]) or "timestamp"
    ts = _parse_timestamps(df[mapping["timestamp"]], tname, col)
    px = {c: _parse_numbers(df[mapping[c]], c, col) for c in (*PRICE_COLUMNS, "volume") if c in mapping}
    _check_rows(ts, px, col, tname)
    if col.problems:
        order = sorted(range(len(col.problems)), key=lambda k: (col.problems[k].row is not None,
                                                               col.problems[k].row or 0, k))
        raise DataError([col.problems[k] for k in order])
    volume = px.get("volume", np.zeros(len(df)))
    return Bars(timestamps=ts, **{c: px[c] for c in PRICE_COLUMNS}, volume=volume,
                name=name or path.name.split(".")[0], source=str(path))


def load_dataset(name_or_path: str, *, seed: int = 0, n_bars: int | None = None) -> Bars:
    """A dataset by name — "synthetic" (seeded generator, `shared/synthetic.py`; `n_bars` of them, 6 000 by default:
    a market of its own for each length, hourly up to 2·10^6 bars, by the minute beyond), "sp500", "eurusd"
    (bundled, see `shared/data/SOURCES.md`) — or else a CSV/Parquet file path. Raises `DataError`."""
    key = str(name_or_path).strip()
    if key.lower() == "synthetic":
        from shared.synthetic import generate  # local import: synthetic builds on this module

        if n_bars is None:
            return generate(seed=seed).bars
        return generate(n_bars, seed=seed, freq="h" if n_bars < 2_000_000 else "min").bars
    if key.lower() in BUNDLED:
        return load_bars(BUNDLED[key.lower()], name=key.lower())
    return load_bars(key)
