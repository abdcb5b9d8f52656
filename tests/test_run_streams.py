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


def test_the_timeline_figures_against_a_hand_case():
    # two replays; kernels [0, 4] and [2, 6] overlap for 2 µs, [8, 10] alone, then a gap, [12, 14]
    t = run_streams.span_stats([(8, 10), (0, 4), (2, 6), (12, 14)], replays=2)
    assert t["kernels"] == 2
    assert t["kernel_us"] == (4 + 4 + 2 + 2) / 4
    assert t["busy"] == (6 + 2 + 2) / 14            # [0, 6], [8, 10], [12, 14] of a 14-µs span
    assert t["overlap"] == 12 / 10                  # 12 µs of kernels while something ran for 10
    assert t["replay_us"] == 7
    assert run_streams.span_stats([], replays=3) == {}


def test_one_graph_rows_need_cuda(capsys):
    import pytest
    with pytest.raises(SystemExit):
        run_streams.main(["--device", "cpu", "--joint", "2", "--runs", "--wide", "--processes"])
    assert "--joint" in capsys.readouterr().err


def test_a_wide_run_does_k_runs_work_in_every_part_of_its_update():
    from services.trainer.config import TrainConfig
    one = TrainConfig.preset("full", 12)
    wide = run_streams.widen(TrainConfig.preset("full", 12), 8)
    assert (wide.batch_size, wide.n_envs) == (8 * one.batch_size, 8 * one.n_envs)
    assert (wide.encoder_batch, wide.iqn_batch) == (8 * one.encoder_batch, 8 * one.iqn_batch) == (2048, 4096)
    assert wide.emb_refresh == one.emb_refresh // 8                  # 8× the bars re-encoded an update
    whole = run_streams.widen(TrainConfig.preset("small", 12), 4)  # 0: the whole batch, which scaled already
    assert (whole.encoder_batch, whole.iqn_batch) == (0, 0) and whole.batch_size == 4 * 128
