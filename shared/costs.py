"""What trading costs (`CostModel`: bps of the traded notional per fill, slippage, a fixed fee per fill, borrow on
shorts held at a close), the closed form of a trade's net return at one size (`held_return`) and why a trade
closes (`EXIT_REASONS`, shared by the simulator's ledger and the report's trade table).

The simulator (`shared.execution`) charges these costs; `shared.execution`'s module docstring states where and when.
ML core: imports only the standard library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BPS = 1e-4
"""One basis point, as a fraction."""
EXIT_REASONS: tuple[str, ...] = ("signal", "flip", "stop", "target", "end")
"""Why a trade closed: the ledger's exit-reason code is the index into this tuple (`shared.execution`), as a trade
table's is (`shared.trade_table`)."""


@dataclass(frozen=True)
class CostModel:
    """What a fill and a held short cost (the rules: `shared.execution`). The defaults: 1 bp of traded notional.

    cost_bps       commission and spread, in basis points of the traded notional, per fill;
    slippage_bps   extra basis points of the traded notional for slippage, per fill;
    fee            fixed fee per fill, in units of the account's starting equity (1): 1e-5 is $1 on $100 000;
    borrow_bps     borrow cost of a short, basis points a year of its notional, charged at each close it is held;
    bars_per_year  bars in a year: turns `borrow_bps` into a rate per bar (252 for daily equities, ~6 200 for
                   hourly FX).
    """

    cost_bps: float = 1.0
    slippage_bps: float = 0.0
    fee: float = 0.0
    borrow_bps: float = 0.0
    bars_per_year: float = 252.0

    def __post_init__(self) -> None:
        for name in ("cost_bps", "slippage_bps", "fee", "borrow_bps", "bars_per_year"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if name == "bars_per_year" else v >= 0)
            if not ok:
                raise ValueError(f"CostModel.{name} must be a finite number {'>' if name == 'bars_per_year' else '>='}"
                                 f" 0, got {v!r}")

    @property
    def rate(self) -> float:
        """Fraction of the traded notional a fill costs (besides the fixed fee)."""
        return (self.cost_bps + self.slippage_bps) * BPS

    @property
    def borrow_rate(self) -> float:
        """Fraction of a short's notional charged at each close it is held."""
        return self.borrow_bps * BPS / self.bars_per_year

    @property
    def proportional(self) -> bool:
        """Only costs proportional to the traded notional (no fixed fee, no borrow): a trade's net return then
        does not depend on the equity level, which the vectorised replay relies on."""
        return self.fee == 0 and self.borrow_bps == 0


def held_return(side, size, entry_price, exit_price, rate: float = 0.0):
    """Net return of a trade held at one size (no resize) from `entry_price` to `exit_price`, with proportional
    costs `rate` (`CostModel.rate`) on its two fills: units = size / entry_price per unit of entry equity, so
        net = side · size · (exit / entry − 1) − rate · size · (1 + exit / entry).
    Works on floats and numpy arrays alike."""
    ratio = exit_price / entry_price
    return side * size * (ratio - 1.0) - rate * size * (1.0 + ratio)
