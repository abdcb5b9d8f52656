"""bench/lockstep_flops.py: the counted arithmetic of runs in lockstep is R times one run's, and a wide run's
(`run_streams.widen`) is the same R runs' work; the TFLOP/s lines against a hand case."""
import pytest

from bench import lockstep_flops


def test_runs_in_lockstep_and_a_widened_run_count_r_runs_arithmetic(capsys):
    rows = lockstep_flops.count("small", 2, bars=6000, warmup=14, settings=[])
    one, lock, wide = (r["flops"] for r in rows)
    assert [r["how"] for r in rows] == ["one run", "lockstep 2", "wide 2"]
    assert one > 1e8
    assert lock == pytest.approx(2 * one, rel=1e-6)       # vmap over the runs adds no product and drops none
    assert wide == pytest.approx(lock, rel=0.02)          # the widened run does those two runs' products


def test_the_table_and_the_rate_three_times_one_run_needs():
    rows = [{"how": "one run", "runs": 1, "flops": 30e9}, {"how": "lockstep 8", "runs": 8, "flops": 240e9},
            {"how": "wide 8", "runs": 8, "flops": 120e9}]
    out = lockstep_flops.table(rows, (1.0, 5.0), 1000)
    assert "| lockstep 8 | 8 | 240.00 | 30.00 | 8.000 |" in out
    assert "| wide 8 | 8 | 120.00 | 15.00 | 4.000 |" in out
    # one run 30 GFLOP × 1000 in 1 s = 30 TFLOP/s; 8 runs at 3×: 240 TFLOP in 8/3 s = 90 TFLOP/s
    assert "one run: 30.0 TFLOP/s" in out and "lockstep 8: 48.0 TFLOP/s (5 s)" in out
    assert "would need 90.0 TFLOP/s (2.67 s for their iterations)" in out
    assert "TFLOP/s" not in lockstep_flops.table(rows, None, 1000)


def test_one_run_alone_is_refused_with_the_flag_named(capsys):
    with pytest.raises(SystemExit):
        lockstep_flops.main(["--runs", "1"])
    assert "--runs: at least 2 runs" in capsys.readouterr().err
