"""Baseline policies as target positions (`tradeloop evaluate --policy …`, the dashboard's buy-and-hold benchmark),
replayed through the one simulator (`shared.execution.run_positions`) like any policy:
  oracle        synthetic only: the generator's hidden-regime positions (`shared.synthetic.oracle_positions`);
  random        seeded: a random side in {−1, 0, +1}, redrawn with probability 1/20 per bar (trades of ~20 bars);
  flat          never trades;
  buy-and-hold  long from the first bar to the last.

ML core: numpy only.
"""
from __future__ import annotations

BASELINES = ("oracle", "random", "flat", "buy-and-hold")


def baseline_targets(policy: str, dataset: str, bars, start: int, stop: int, seed: int):
    """Target positions [stop − start] of a baseline policy on bars [start, stop)."""
    import numpy as np

    T = stop - start
    if policy == "flat":
        return np.zeros(T)
    if policy == "buy-and-hold":
        return np.ones(T)
    if policy == "random":
        rng = np.random.default_rng(seed)
        redraw = rng.random(T) < 1.0 / 20.0
        redraw[0] = True
        sides = rng.integers(-1, 2, size=T).astype(np.float64)
        idx = np.maximum.accumulate(np.where(redraw, np.arange(T), 0))
        return sides[idx]
    if policy == "oracle":
        if dataset.strip().lower() != "synthetic":
            raise ValueError("the oracle policy exists only for --dataset synthetic (its hidden regimes are known)")
        from shared.synthetic import generate, oracle_positions

        return oracle_positions(generate(len(bars), seed=seed))[start:stop]
    raise ValueError(f"unknown policy {policy!r}")
