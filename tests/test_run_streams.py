"""bench/run_streams.py: the threads' rows and the wide run's row print for a tiny CPU config, each run's epoch is
the product's `train_epoch` (it advances the states' epochs), and K threads time K states (its GPU figures come from
the device machine)."""
import json

from bench import run_streams


def test_the_bench_times_k_states_and_a_wider_run(capsys):
    run_streams.main(["--device", "cpu", "--preset", "small", "--runs", "1", "2", "--wide", "2", "--processes",
                      "--iterations", "4", "--warmup", "14", "--bars", "6000", "--set", "iterations=4"])
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [(r["how"], r["runs"]) for r in rows] == [("threads", 1), ("threads", 2),
                                                     ("one run, batch and envs ×2", 2)]
    assert all(r["iter_per_s"] > 0 and r["wall_s"] > 0 for r in rows)
    table = [line for line in out.splitlines() if line.startswith("| threads | 1 |")]
    assert len(table) == 1 and "| 1.00 |" in table[0]


def test_each_thread_runs_a_whole_epoch_of_its_own_state():
    import argparse
    args = argparse.Namespace(bars=6000, preset="small", set=["iterations=3"], device="cpu", warmup=14,
                              iterations=3)
    states = run_streams.make_states(args, [0, 1])
    assert [st.epoch for st in states] == [1, 1]          # the warm-up epoch
    steps = [st.update_step for st in states]
    run_streams.timed_threads(states)
    assert [st.epoch for st in states] == [2, 2]
    per_epoch = states[0].cfg.iterations * states[0].cfg.updates_per_iter
    assert [st.update_step - s for st, s in zip(states, steps)] == [per_epoch, per_epoch]
