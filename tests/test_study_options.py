"""`tradeloop study`'s options: the study file's keys and the values `build_spec` reads come from the command's
parameters, and each option's flag is its key with '-' for '_'."""
import inspect
import json
from pathlib import Path

import pytest

from tradeloop.cmd_study import CLI_ONLY, TOML_KEYS, _options, build_spec, study
from tradeloop.study.spec import StudyError


def test_every_option_but_the_command_line_only_ones_is_a_study_file_key_spelled_as_its_flag():
    params = inspect.signature(study).parameters
    flags = {name: p.default.param_decls[0].split("/")[0] for name, p in params.items()}
    assert {name.rstrip("_") for name in params} == set(TOML_KEYS) | set(CLI_ONLY)
    for name, flag in flags.items():
        assert flag == "--" + name.rstrip("_").replace("_", "-"), (name, flag)


def test_options_gives_build_spec_every_key_and_config(tmp_path: Path):
    values = {name: None for name in inspect.signature(study).parameters}
    values.update(dataset="synthetic", epochs=1, out=tmp_path / "o", folds=1, set_=["gamma=0.95"], redis="x",
                  report_only=False, unrelated=1)
    cli = _options(values)
    assert set(cli) == set(TOML_KEYS) | {"config"} and cli["set"] == ["gamma=0.95"]
    spec, out = build_spec(cli)
    assert out == tmp_path / "o" and spec.settings == [("schedule.gamma", 0.95)] and spec.folds == 1


def test_a_study_file_key_outside_the_options_is_refused_listing_them(tmp_path: Path):
    f = tmp_path / "s.toml"
    f.write_text('dataset = "synthetic"\nepochs = 1\nout = "o"\nredis = "redis://x"\n')
    with pytest.raises(StudyError, match=r"unknown keys redis \(known: dataset, variants, seeds"):
        build_spec({**{k: None for k in TOML_KEYS}, "config": f})


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.toml")),
                         ids=lambda p: p.name)
def test_the_shipped_study_files_build(path: Path, tmp_path: Path):
    """studies/*.toml (the studies the README names) build into a valid study whose variants' feedback configs
    switch off (or set) what their names say."""
    spec, _ = build_spec({**{k: None for k in TOML_KEYS}, "config": path, "out": tmp_path / "o"})
    offs = {v.name: spec.configs(v, 14)[1] for v in spec.variants}
    signals = {f"E{i}" for i in range(1, 10)}
    assert not offs["off"].enabled
    if "on" in offs or "pop" in offs:
        assert set(offs.get("on", offs.get("pop")).off) == signals
    # variants of the fixed schedule: feedback off
    schedule_only = ("ema", "fresh", "recent", "lowlr", "lr", "decay", "fewer", "dropout", "ratio", "gamma",
                     "cosine", "swa", "sp", "feasible")
    assert all(fb.enabled for n, fb in offs.items() if n != "off" and not n.startswith(schedule_only))

    for name, fb in offs.items():
        if name.startswith("no"):
            assert set(fb.off) == {name[2:]} and fb.enabled
        elif name in signals:
            assert set(fb.off) == signals - {name} and fb.enabled
    assert spec.preset == "full" and spec.device == "cuda" and spec.epochs >= 8
    if path.name.startswith("signals-"):
        assert len(spec.variants) >= 11
    elif path.name == "fresh-epochs.toml":   # a fresh learner on a fresh replay every epoch, the schedule fixed
        cfg = spec.configs(next(v for v in spec.variants if v.name == "fresh"), 14)[0]
        assert (cfg.restart_every, cfg.restart_replay, offs["fresh"].enabled) == (1, True, False)
        cfg = spec.configs(next(v for v in spec.variants if v.name == "restart"), 14)[0]   # the loop, a fresh answer
        assert (cfg.restart_every, cfg.restart_replay, offs["restart"].rollback_restart) == (0, True, True)
        assert offs["restart"].enabled and set(offs["restart"].off) == signals
    elif path.name == "population.toml":     # the exploit across runs, its seeds on one market
        assert offs["pop"].population and not offs["off"].population and spec.populations() == ["pop"]
        k = spec.seeds_per_market
        assert k >= 5 and len(spec.seeds) >= 2 * k                     # several independent populations a fold
        assert [r.run_id for r in spec.peers(spec.run("pop-s0-f1"))] == [f"pop-s{s}-f1" for s in spec.seeds[1:k]]
    elif path.name == "policy-ema.toml":     # the checkpoint as a moving average, with the fixed schedule and the loop
        ema = {v.name: spec.configs(v, 14)[0].policy_ema for v in spec.variants}
        assert ema == {"off": 0.0, "ema": 0.999, "ema-short": 0.99}
        assert not offs["ema"].enabled and not offs["ema-short"].enabled
    elif path.name == "learning-later-epochs.toml":   # the fixed schedule with a one-epoch replay, a third of the LR
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert not any(fb.enabled for fb in offs.values())
        assert (cfgs["off"].replay_capacity, cfgs["recent"].replay_capacity) == (2_000_000, 500_000)
        assert (cfgs["off"].lr, cfgs["lowlr"].lr) == (3e-4, 1e-4) and cfgs["lowlr"].replay_capacity == 2_000_000
    elif path.name == "generalization.toml":   # weight decay, dropout, fewer updates against overfitting
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert not any(fb.enabled for fb in offs.values()) and spec.reference == "off"
        assert {n: (c.weight_decay, c.dropout, c.updates_per_iter) for n, c in cfgs.items()} == {
            "off": (1e-4, 0.0, 2), "decay": (0.1, 0.0, 2), "dropout": (1e-4, 0.1, 2), "fewer-updates": (1e-4, 0.0, 1)}
    elif path.name == "fewer-updates.toml":   # one update an iteration on new seeds, and the loop on that learner
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.updates_per_iter for n, c in cfgs.items()} == {"off": 2, "fewer-updates": 1, "on-fewer": 1}
        assert not offs["fewer-updates"].enabled and offs["on-fewer"].enabled and set(offs["on-fewer"].off) == signals
        assert spec.reference == "off" and spec.seeds == [5, 6, 7, 8, 9] and spec.folds == 2
    elif path.name == "replay-ratio.toml":   # each transition sampled about once: half the batch, twice the steps
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: (c.batch_size, c.env_steps_per_iter, c.updates_per_iter, c.n_envs) for n, c in cfgs.items()} == {
            "off": (1024, 2, 1, 256), "ratio1-batch": (512, 2, 1, 256), "ratio1-steps": (1024, 4, 1, 256)}
        assert not any(fb.enabled for fb in offs.values()) and spec.seeds == [10, 11, 12, 13, 14]
    elif path.name == "replay-ratio-replicate.toml":   # half the batch again, on seeds no other study file uses
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.batch_size for n, c in cfgs.items()} == {"off": 1024, "ratio1-batch": 512}
        assert not any(fb.enabled for fb in offs.values()) and spec.seeds == [15, 16, 17, 18, 19]
        assert spec.folds == 3 and spec.reference == "off"
    elif path.name == "shorter-epochs.toml":   # the on/off study's training in 16 epochs of half the iterations
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {(c.iterations, c.schedule.eps_decay_epochs, c.updates_per_iter) for c in cfgs.values()} == {(500, 16, 1)}
        assert offs["on"].enabled and not offs["off"].enabled and spec.epochs == 16
        onoff = json.loads((path.parents[1] / "docs/study-h200-onoff-one-update/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (onoff["seeds"], onoff["folds"], onoff["bars"])   # it pairs
    elif path.name == "gamma-from-holding.toml":   # E3 with and without the rollback, and a fixed γ of 0.98
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.schedule.gamma for n, c in cfgs.items()} == {"on": 0.99, "off": 0.99, "E3": 0.99,
                                                                   "E3-alone": 0.99, "gamma98": 0.98}
        assert {n: offs[n].schedule.gamma for n in offs} == {n: c.schedule.gamma for n, c in cfgs.items()}
        assert set(offs["E3-alone"].off) == (signals - {"E3"}) | {"rollback"} and offs["E3-alone"].enabled
        assert offs["E3"].is_on("rollback") and not offs["E3-alone"].is_on("rollback")
        assert not offs["gamma98"].enabled and {c.updates_per_iter for c in cfgs.values()} == {1}
    elif path.name == "after-gamma.toml":   # the acts at γ 0.98: the rollback (z 2, z 10), E3, and γ 0.95
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.schedule.gamma for n, c in cfgs.items()} == {"off": 0.98, "rollback": 0.98, "rollback-z10": 0.98,
                                                                   "E3-alone": 0.98, "gamma95": 0.95}
        assert {n: offs[n].schedule.gamma for n in offs} == {n: c.schedule.gamma for n, c in cfgs.items()}
        for rb in ("rollback", "rollback-z10"):
            assert set(offs[rb].off) == signals and offs[rb].is_on("rollback") and offs[rb].enabled
        assert (offs["rollback"].rollback_z, offs["rollback-z10"].rollback_z) == (2.0, 10.0)
        assert set(offs["E3-alone"].off) == (signals - {"E3"}) | {"rollback"} and offs["E3-alone"].enabled
        assert not offs["gamma95"].enabled
        gamma = json.loads((path.parents[1] / "docs/study-h200-gamma/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (gamma["seeds"], gamma["folds"], gamma["bars"])   # it pairs
    elif path.name == "lr-decay.toml":      # the learning rates decayed across epochs at γ 0.98
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        want = {"off": 1.0, "lr70": 0.7, "cosine-run": 1.0}
        assert {n: c.cosine_period for n, c in cfgs.items()} == {**{n: 1000 for n in want}, "cosine-run": 8000}
        assert 8 * cfgs["off"].iterations * cfgs["off"].updates_per_iter == 8000     # one cycle over the run
        assert {n: c.schedule.lr_epoch_factor for n, c in cfgs.items()} == want
        assert {n: fb.schedule.lr_epoch_factor for n, fb in offs.items()} == want      # feedback off's knobs alike
        assert {c.schedule.gamma for c in cfgs.values()} == {0.98} and not any(fb.enabled for fb in offs.values())
        assert cfgs["lr70"].schedule.knobs(8).lr_decay == pytest.approx(0.7 ** 7)
        ran = json.loads((path.parents[1] / "docs/study-h200-lr-decay/results.json").read_text())["study"]
        assert spec.to_dict()["variants"] == ran["variants"]            # the file is the study that was run
        assert [[k, v] for k, v in spec.settings] == ran["settings"]
        gamma = json.loads((path.parents[1] / "docs/study-h200-gamma/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (gamma["seeds"], gamma["folds"], gamma["bars"])   # it pairs
    elif path.name == "gamma-low.toml":     # the fixed schedule's γ below 0.98
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.schedule.gamma for n, c in cfgs.items()} == {"off": 0.98, "gamma97": 0.97, "E3k2": 0.98}
        assert {n: fb.schedule.gamma for n, fb in offs.items()} == {n: c.schedule.gamma for n, c in cfgs.items()}
        assert not any(fb.enabled for n, fb in offs.items() if n != "E3k2")
        assert set(offs["E3k2"].off) == (signals - {"E3"}) | {"rollback"} and offs["E3k2"].enabled
        assert {n: fb.gamma_k for n, fb in offs.items()} == {"off": 5.0, "gamma97": 5.0, "E3k2": 2.0}
        gamma = json.loads((path.parents[1] / "docs/study-h200-gamma/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (gamma["seeds"], gamma["folds"], gamma["bars"])   # it pairs
    elif path.name == "swa.toml":           # the policy as the mean of the epochs' ends, and the fixed γ 0.97
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: (c.policy_swa, c.policy_ema, c.schedule.gamma) for n, c in cfgs.items()} == {
            "off": (0, 0.0, 0.98), "swa1": (1, 0.0, 0.98), "swa3": (3, 0.0, 0.98), "gamma97": (0, 0.0, 0.97)}
        assert {n: fb.schedule.gamma for n, fb in offs.items()} == {n: c.schedule.gamma for n, c in cfgs.items()}
        assert not any(fb.enabled for fb in offs.values()) and spec.reference == "off"
        ran = json.loads((path.parents[1] / "docs/study-h200-swa/results.json").read_text())["study"]
        assert spec.to_dict()["variants"] == ran["variants"]            # the file is the study that was run
        gamma = json.loads((path.parents[1] / "docs/study-h200-gamma/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (gamma["seeds"], gamma["folds"], gamma["bars"])   # it pairs
    elif path.name == "shrink-perturb.toml":   # the online network shrunk toward a fresh one before each epoch
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: (c.shrink_perturb, c.restart_every, c.schedule.gamma) for n, c in cfgs.items()} == {
            "off": (0.0, 0, 0.98), "sp30": (0.3, 0, 0.98), "sp50": (0.5, 0, 0.98)}
        assert not any(fb.enabled for fb in offs.values()) and spec.reference == "off"
        swa = json.loads((path.parents[1] / "docs/study-h200-swa/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (swa["seeds"], swa["folds"], swa["bars"])   # it pairs
        ran = json.loads((path.parents[1] / "docs/study-h100-shrink-perturb/results.json").read_text())["study"]
        assert spec.to_dict()["variants"] == ran["variants"]            # the file is the study that was run
    elif path.name == "targets.toml":       # the update's target and priority corrections, on fresh seeds
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: (c.feasible_targets, c.kl_priority, c.cut_episodes, c.schedule.gamma)
                for n, c in cfgs.items()} == {"off": (False, False, False, 0.98),
                                              "feasible-kl": (True, True, True, 0.98)}
        assert spec.seeds == [20, 21, 22, 23, 24]
    elif path.name == "regularise.toml":    # weight decay and dropout together against the widening gap
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: (c.weight_decay, c.dropout, c.schedule.gamma, c.updates_per_iter) for n, c in cfgs.items()} == {
            "off": (cfgs["off"].weight_decay, 0.0, 0.98, 1), "decay-dropout": (0.1, 0.1, 0.98, 1)}
        assert cfgs["off"].weight_decay < 0.1
        assert not any(fb.enabled for fb in offs.values()) and spec.reference == "off"
        sp = json.loads((path.parents[1] / "docs/study-h100-shrink-perturb/results.json").read_text())["study"]
        assert (spec.seeds, spec.folds, spec.bars) == (sp["seeds"], sp["folds"], sp["bars"])   # it pairs
    elif path.name == "recent-replay.toml":   # the one-epoch replay on new seeds, and the loop as shipped on it
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.replay_capacity for n, c in cfgs.items()} == {"off": 2_000_000, "recent": 500_000,
                                                                    "on-recent": 500_000}
        assert not offs["recent"].enabled and offs["on-recent"].enabled and set(offs["on-recent"].off) == signals
        assert spec.reference == "recent" and spec.seeds == [5, 6, 7, 8, 9]
    elif path.name == "gamma-confirm.toml":   # the fixed γ 0.98 against 0.99 on seeds no γ study used
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert {n: c.schedule.gamma for n, c in cfgs.items()} == {"off": 0.98, "gamma99": 0.99}
        assert {n: fb.schedule.gamma for n, fb in offs.items()} == {"off": 0.98, "gamma99": 0.99}
        assert not any(fb.enabled for fb in offs.values()) and spec.reference == "off"
        gamma = json.loads((path.parents[1] / "docs/study-h200-gamma/results.json").read_text())["study"]
        assert (spec.folds, spec.bars, spec.epochs) == (gamma["folds"], gamma["bars"], gamma["epochs"])
        assert not set(spec.seeds) & set(gamma["seeds"]) and len(spec.seeds) == 5      # new units, as many
    elif path.name == "real-series.toml":   # the fixed schedule and the rollback alone on a bundled real series
        cfgs = {v.name: spec.configs(v, 14)[0] for v in spec.variants}
        assert spec.dataset == "sp500" and spec.bars is None and len(spec.seeds) >= 5 and spec.folds >= 3
        assert not offs["off"].enabled and offs["rollback"].enabled and set(offs["rollback"].off) == signals
        assert cfgs["off"] == cfgs["rollback"] and spec.reference == "off"
    else:                                    # rollback-settings.toml: the rollback's z, learning-rate decay, blend
        want = {"on": (2.0, 1.0, 0.0), "z1": (1.0, 1.0, 0.0), "anneal": (2.0, 0.5, 0.0), "keep": (2.0, 1.0, 0.5)}
        assert {n: (fb.rollback_z, fb.rollback_lr_factor, fb.rollback_keep)
                for n, fb in offs.items() if n != "off"} == want
        assert all(set(offs[n].off) == signals for n in want)


def test_seeds_are_a_count_of_at_least_one_or_a_list():
    from tradeloop.cmd_study import parse_seeds

    assert parse_seeds("3") == parse_seeds(3) == [0, 1, 2]
    assert parse_seeds("0,") == [0] and parse_seeds([4, 2]) == [4, 2]
    with pytest.raises(StudyError, match=r"--seeds: a count N \(seeds 0 … N−1\) must be ≥ 1, got 0 \(seed 0"):
        parse_seeds("0")
    with pytest.raises(StudyError, match="must be ≥ 1, got -2$"):
        parse_seeds(-2)
    with pytest.raises(StudyError, match="expected a count N"):
        parse_seeds("three")


def _cli(**given):
    return {**{k: None for k in TOML_KEYS}, "config": None, "dataset": "synthetic", "epochs": 1, "out": "o", **given}


@pytest.mark.parametrize("given, message", [
    (dict(bars="auto", window_trades=0), r"^--window-trades must be an integer ≥ 1, got 0$"),
    (dict(bars="auto", window_trades="many"), r"^--window-trades must be an integer ≥ 1, got 'many'$"),
    (dict(bars=5000, window_trades=300), r"^--window-trades sizes the data with --bars auto only"),
    (dict(window_trades=300), r"^--window-trades sizes the data with --bars auto only"),
    (dict(seeds="-1"), r"^--seeds: a count N"),
    (dict(parallel="zero"), r"^--parallel must be"),
])
def test_a_bad_option_on_the_command_line_is_named_as_given(given, message):
    """Without --config, a bad value is named by its option alone (no '--config:' before it), and --window-trades,
    which sizes --bars auto, is neither ignored beside a number of bars nor taken below 1."""
    with pytest.raises(StudyError, match=message):
        build_spec(_cli(**given))


def test_window_trades_sizes_bars_auto():
    small, _ = build_spec(_cli(bars="auto", window_trades=50, folds=2))
    large, _ = build_spec(_cli(bars="auto", window_trades=400, folds=2))
    assert small.bars < large.bars


@pytest.mark.parametrize("body, message", [
    ('folds = "x"', r"--config .*s\.toml: folds must be an integer, got 'x'$"),
    ("folds = true", r"--config .*s\.toml: folds must be an integer, got True$"),
    ("epochs = 2.9", r"--config .*s\.toml: epochs must be an integer, got 2\.9$"),
    ('deterministic = "false"', r"--config .*s\.toml: deterministic must be true or false, got 'false'$"),
    ("seeds = 2.5", r"--config .*s\.toml: seeds: expected a count N \(seeds 0 … N−1\) or a list like 0,3,7; got 2\.5$"),
    ('variants = { g = { "schedule.gama" = 0.9 } }', r"--config .*s\.toml g: setting 'schedule\.gama': FixedSchedule "
                                                    r"has no field 'gama' \(did you mean schedule\.gamma\?\)$"),
    ("lockstep = 1.5", r"--config .*s\.toml: lockstep must be a count of runs from 1 to 64 or auto, got 1\.5$"),
    ("set = 3", r"--config .*s\.toml: set must be a list of \"KEY=VALUE\" strings or a table, got 3$"),
])
def test_a_study_file_value_of_the_wrong_type_is_refused_not_turned_into_another(tmp_path: Path, body, message):
    """int() and bool() would take these (folds 1, epochs 2, deterministic True): the file's key is named instead."""
    keys = {"dataset": '"synthetic"', "out": '"o"', "epochs": "1"}
    key, value = body.split(" = ", 1)
    keys[key] = value
    f = tmp_path / "s.toml"
    f.write_text("".join(f"{k} = {v}\n" for k, v in keys.items()))
    with pytest.raises(StudyError, match=message):
        build_spec({**{k: None for k in TOML_KEYS}, "config": f})


def test_a_study_file_takes_a_lone_setting_and_integers_as_strings(tmp_path: Path):
    f = tmp_path / "s.toml"
    f.write_text('dataset = "synthetic"\nout = "o"\nepochs = "2"\nfolds = 2\nset = "iterations=30"\n'
                 "deterministic = true\n")
    spec, _ = build_spec({**{k: None for k in TOML_KEYS}, "config": f})
    assert (spec.epochs, spec.folds, spec.deterministic) == (2, 2, True)
    assert spec.settings == [("train.iterations", 30)]
    cli, _ = build_spec({**{k: None for k in TOML_KEYS}, "config": f, "epochs": 3})   # the command line wins
    assert cli.epochs == 3


def test_the_banner_counts_in_the_singular():
    from tradeloop.study.report import counted

    assert (counted(1, "run"), counted(2, "run"), counted(0, "seed")) == ("1 run", "2 runs", "0 seeds")


def test_lockstep_auto_pairs_runs_on_cuda_only_where_a_local_worker_trains_them():
    """`--lockstep auto` (the default): two runs of one market a worker on CUDA, with `--parallel auto` still counting
    runs at once (half as many workers); one on a CPU and where the runs go through Redis; a count as given."""
    from tradeloop.study.capacity import AUTO_LOCKSTEP_CUDA, parse_parallel

    runs = parse_parallel("auto", "cuda")
    cuda, _ = build_spec(_cli(device="cuda"))
    assert (cuda.lockstep, cuda.parallel) == (AUTO_LOCKSTEP_CUDA, -(-runs // AUTO_LOCKSTEP_CUDA)) == (2, -(-runs // 2))
    remote, _ = build_spec(_cli(device="cuda"), remote=True)
    assert (remote.lockstep, remote.parallel) == (1, runs)
    cpu, _ = build_spec(_cli())
    assert (cpu.lockstep, cpu.parallel) == (1, parse_parallel("auto", "cpu"))
    given, _ = build_spec(_cli(device="cuda", lockstep="1", parallel="3"))
    assert (given.lockstep, given.parallel) == (1, 3)
    workers, _ = build_spec(_cli(device="cuda", lockstep="4", parallel="3"))   # a count of workers, as given
    assert (workers.lockstep, workers.parallel) == (4, 3)
    # runs that pair with none (another trainer config on each market) take a worker each: as many runs at once
    apart, _ = build_spec(_cli(device="cuda", variants="off,wd:train.weight_decay=0.1"))
    assert (apart.lockstep, apart.parallel) == (2, runs)
    with pytest.raises(StudyError, match=r"^--lockstep must be a count of runs from 1 to 64 or auto, got 0$"):
        build_spec(_cli(lockstep="0"))


def test_the_command_lines_set_wins_over_the_files_key_by_key_not_list_by_list(tmp_path: Path):
    """`--set iterations=30` beside a study file's `set` dropped every other setting of the file, and so turned its
    study into another (studies/fewer-updates.toml lost updates_per_iter, gamma and its variant's rollback)."""
    f = tmp_path / "s.toml"
    f.write_text('dataset = "synthetic"\nout = "o"\nepochs = 1\nset = ["iterations=1000", "updates_per_iter=2"]\n')
    spec, _ = build_spec({**{k: None for k in TOML_KEYS}, "config": f, "set": ["iterations=30", "gamma=0.95"]})
    assert spec.settings == [("train.iterations", 30), ("train.updates_per_iter", 2), ("schedule.gamma", 0.95)]


def test_an_out_directory_that_cannot_be_written_is_one_line_naming_it(tmp_path: Path):
    """--out under a regular file: an OSError's traceback before; one line naming --out, the file and the reason."""
    from typer.testing import CliRunner

    from tradeloop.cli import app

    a_file = tmp_path / "afile"
    a_file.write_text("")
    out = a_file / "study"
    r = CliRunner().invoke(app, ["study", "--dataset", "synthetic", "--epochs", "1", "--seeds", "1", "--folds", "1",
                                 "--out", str(out)])
    assert r.exit_code == 2 and f"error: --out {out}: cannot write the study's files" in r.stderr, r.output
    assert "Traceback" not in r.output
