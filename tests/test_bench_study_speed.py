"""bench/study_speed.py's steady rate: the sum of each run's own rate inside the span every run shares, the run that
ran ahead left out, and its table again from a finished case's records (`--from`)."""
import json

import pytest

from bench import study_speed as bench


def test_runs_in_step_sum_their_rates_whatever_the_span_edges():
    runs = [[10.0 + d, 20.0 + d, 30.0 + d, 40.0 + d] for d in (0.0, 0.05, 0.1)]
    rate, in_span, span = bench.steady_rate(runs)
    assert rate == pytest.approx(3 * 0.1) and in_span == 3 and span == pytest.approx(29.9)


def test_a_run_done_before_the_others_began_is_left_out():
    ahead = [1.0, 2.0, 3.0, 4.0]                 # the run that warmed the cache and ran alone
    rate, in_span, _ = bench.steady_rate([ahead, [10.0, 20.0, 30.0, 40.0], [11.0, 21.0, 31.0, 41.0]])
    assert in_span == 2 and rate == pytest.approx(0.2)


def test_starts_spread_over_every_epoch_give_no_steady_rate():
    assert bench.steady_rate([[0.0, 10.0, 20.0], [19.0, 21.0, 40.0]])[0] is None


def _case(root, name, finish, rollback_at=None, stopped=False, peak=None):
    d = root / name
    (d / "runs").mkdir(parents=True)
    if stopped:                                  # stopped at --case-limit: no results.json, the marker instead
        (d / bench.STOPPED).write_text(json.dumps({"wall_s": 120.0, "limit_s": 120.0}))
        if peak is not None:                     # the study's status.json: the most runs it had going at once
            (d / "status.json").write_text(json.dumps({"state": "running", "peak_running": peak}))
    else:
        (d / "results.json").write_text(json.dumps({"timing": {"mps": name.startswith("p2-mps-on"), "wall_s": 99.0,
                                                               "gpu_busy_pct": {"0": 50.0}}}))
    for i, f in enumerate(finish):
        loop = d / "runs" / f"on-s{i}-f0" / "loop"
        loop.mkdir(parents=True)
        for e, t in enumerate(f, 1):      # the first epoch compiles; (run, epoch) `rollback_at` begins from a rollback
            rec = {"finished_at": t, "seconds": {"rollback": 0.75 if (i, e) == rollback_at else None, "setup": 0.125,
                                                    "train": 30.0 if e == 1 else 2.0, "save": 0.25, "eval": 0.5,
                                                    "feedback": 0.0}}
            (loop / f"epoch-{e:04d}.json").write_text(json.dumps(rec))


def test_from_reads_the_cases_back(tmp_path, capsys):
    _case(tmp_path, "p2-mps-on-sm100", [[10.0, 20.0, 30.0, 40.0], [10.5, 20.5, 30.5, 40.5]], rollback_at=(0, 3))
    _case(tmp_path, "p1-mps-off-sm100", [[5.0, 10.0, 15.0, 20.0]])
    _case(tmp_path, "p2-mps-on-sm100-it40", [[10.0, 15.0, 20.0, 25.0], [10.5, 15.5, 20.5, 25.5]])
    _case(tmp_path, "p1-mps-off-sm100-ls4", [[10.0, 20.0, 30.0, 40.0]] * 4)      # four runs of one worker, in step
    (tmp_path / "cache").mkdir()
    rows = bench.read_cases(tmp_path)
    assert [(r["P"], r["lockstep"], r["mps"], r["iteration_sms"]) for r in rows] == [
        (1, 1, False, 0), (1, 4, False, 0), (2, 1, True, 0), (2, 1, True, 40)]
    assert rows[0]["epochs_per_s"] == pytest.approx(0.2) and rows[2]["epochs_per_s"] == pytest.approx(0.2)
    assert rows[3]["epochs_per_s"] == pytest.approx(0.4) and rows[1]["epochs_per_s"] == pytest.approx(0.4)
    bench.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| 2 | 1 | on | 100 | all | 0.200 | 2 | 1.00 | 10.0 | 0.75 | 0.12 | 2.00 | 0.50 | 0.25 | 50 | 99 |" in out
    assert "| 2 | 1 | on | 100 | 40 | 0.400 | 2 | 2.00 | 5.0 |" in out
    assert "| 1 | 1 | off | 100 | all | 0.200 | 1 | 1.00 | 5.0 | n/a | 0.12 | 2.00 | 0.50 | 0.25 | 50 | 99 |" in out
    assert "| 1 | 4 | off | 100 | all | 0.400 | 4 | 2.00 | 10.0 |" in out
    # the lockstep group's ceiling: 4 epochs in its iterations' 2 s, 10× the lone run's 0.2; 3× leaves 4/0.6 s
    assert ("- 1 × 4 (no MPS): the 4 runs' iterations alone take 2.00 s an epoch: with every other part hidden at "
            "most 2.000 epochs/s, 10.00× one run; 3× one run leaves 6.67 s for their 4 epochs") in out
    assert out.count("iterations alone take") == 1                 # none for a run alone or for processes


def test_from_a_directory_without_cases_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no finished or stopped case"):
        bench.read_cases(tmp_path)


def test_a_case_stopped_at_its_limit_is_read_from_the_epochs_its_runs_finished(tmp_path, capsys):
    """`--case-limit`: the stopped case's rate comes from the epochs its runs finished (a run that finished none is
    left out), its wall says stopped, and it has no GPU busy % (the study wrote no results)."""
    _case(tmp_path, "p1-mps-off-sm100", [[5.0, 10.0, 15.0, 20.0]])
    _case(tmp_path, "p3-mps-on-sm100", [[10.0, 20.0, 30.0], [10.5, 20.5, 30.5], []], stopped=True, peak=2)
    rows = bench.read_cases(tmp_path)
    stopped = rows[1]
    assert stopped["stopped"] and not rows[0]["stopped"] and stopped["runs"] == 2 and stopped["mps"]
    assert stopped["at_once"] == 2 and rows[0]["at_once"] is None
    assert stopped["epochs_per_s"] == pytest.approx(0.2) and stopped["busy_pct"] is None
    bench.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    assert ("| 3 (2 at most) | 1 | on | 100 | all | 0.200 | 2 | 1.00 | 10.0 | n/a | 0.12 | 2.00 | 0.50 | 0.25 | n/a "
            "| 120 (stopped) |") in out
    assert "- 3 × 1 (MPS): no epoch stored by 1 run(s): on-s2-f0" in out
    assert rows[0]["notes"] == []


def test_a_cases_notes_say_what_its_study_logged_beside_the_epochs(tmp_path, capsys):
    """Under the table: a failed run's first error line, a worker that stood down with the memory one group holds,
    a lockstep group that trained rounds alone, from the case study's events.jsonl."""
    _case(tmp_path, "p1-mps-off-sm100", [[5.0, 10.0, 15.0, 20.0]])
    _case(tmp_path, "p2-mps-on-sm100-ls8", [[10.0, 20.0, 30.0]] * 2, stopped=True, peak=8)
    events = [{"type": "done", "run": "on-s0-f0"},
              {"type": "error", "run": "off-s3-f0", "error": "RuntimeError: CUDA error: misaligned address\nmore"},
              {"type": "stand-down", "worker": "worker 1", "gpu": "0", "fit": 1, "run_bytes": 40 * 2 ** 30,
               "total_bytes": 80 * 2 ** 30},
              {"type": "lockstep", "worker": "worker 0", "runs": ["a", "b"], "rounds": {"lockstep": 5, "alone": 2}},
              {"type": "lockstep", "worker": "worker 2", "runs": ["c", "d"], "rounds": {"lockstep": 7, "alone": 0}}]
    (tmp_path / "p2-mps-on-sm100-ls8" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    bench.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("- ")]
    assert notes == ["- 2 × 8 (MPS): off-s3-f0 failed: RuntimeError: CUDA error: misaligned address",
                     "- 2 × 8 (MPS): worker 1 stood down: 1 at once fit GPU 0 (one holds 40.0 GiB of 80.0)",
                     "- 2 × 8 (MPS): worker 0: 2 runs in lockstep, 5 epochs together, 2 rounds alone"]


def test_mps_cases_are_run_on_cuda_alone():
    from types import SimpleNamespace

    def cases(device):
        return bench.case_list(SimpleNamespace(parallel=[2, 1], mps=["off", "on"], mps_share=[100, 50],
                                               iteration_sms=[0], lockstep=[1], device=device))

    assert cases("cpu") == [(1, "off", 100, 0, 1), (2, "off", 100, 0, 1)]
    assert cases("cuda") == [(1, "off", 100, 0, 1), (2, "off", 100, 0, 1), (2, "on", 100, 0, 1), (2, "on", 50, 0, 1)]
