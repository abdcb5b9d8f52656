"""bench/entry_gate.py's choice and its statistics: the level is chosen on validation only (OOS would pick another),
a level keeping too few validation trades is never chosen, ties go to the looser gate, and the differences are taken
per (seed, fold) unit over its runs."""
import pytest

from bench import entry_gate


def level(q, val, val_trades, oos, oos_trades=100, bar=0.1):
    return {"q": q, "val_sharpe": val, "val_trades": val_trades, "oos_sharpe": oos, "oos_trades": oos_trades,
            "oos_bar_sharpe": bar}


def test_the_level_is_chosen_on_validation_only():
    lv = [level(0.1, 0.9, 150, 2.0), level(0.3, 0.7, 400, 0.1), level(0.5, 0.6, 500, 1.5), level(None, 0.5, 600, 1.0)]
    # 0.1 validates highest but keeps 150 < 200 trades; 0.3 is next on validation, though OOS would pick 0.1 or 0.5
    assert entry_gate.choose_level(lv, 200)["q"] == 0.3
    assert entry_gate.choose_level(lv, 100)["q"] == 0.1


def test_ties_go_to_the_looser_gate_and_no_gate_is_always_a_candidate():
    lv = [level(0.1, 0.5, 900, 0.0), level(0.5, 0.5, 900, 0.0), level(None, 0.5, 10, 0.0)]
    assert entry_gate.choose_level(lv, 200)["q"] is None          # no gate: the loosest, kept whatever its trades
    assert entry_gate.choose_level(lv[:2], 200)["q"] == 0.5


def test_differences_are_unit_means_of_chosen_minus_no_gate():
    def row(seed, fold, chosen, ungated):
        return {"data_seed": seed, "fold": fold, "chosen": chosen, "ungated": ungated}
    rows = [row(0, 0, level(0.1, 0, 0, 0.9, 50, 0.05), level(None, 0, 0, 0.5, 100, 0.10)),
            row(0, 0, level(None, 0, 0, 0.7, 80, 0.20), level(None, 0, 0, 0.7, 80, 0.20)),
            row(1, 0, level(0.3, 0, 0, 0.4, 30, 0.02), level(None, 0, 0, 0.6, 60, 0.04))]
    d = entry_gate.unit_deltas(rows)
    # unit (0, 0): mean of (+0.4, 0) and of (−0.05, 0), trades (0.5, 1); unit (1, 0): −0.2, −0.02, 0.5
    assert d["oos_sharpe"] == pytest.approx([0.2, -0.2])
    assert d["oos_bar_sharpe"] == pytest.approx([-0.025, -0.02])
    assert d["oos_trades"] == pytest.approx([0.75, 0.5])


def test_bad_levels_are_named(capsys):
    with pytest.raises(SystemExit, match="--levels"):
        entry_gate.main(["runs/none", "--levels", "0.2,1.5"])
