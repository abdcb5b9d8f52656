"""`tradeloop study`: the closed loop over variants × seeds × walk-forward folds, with confidence intervals.

    spec.py    variants (the loop with settings changed), seeds, folds, data; the command line and TOML forms
    loop.py    one run: the closed loop in-process through the functions the services call, resumable
    runner.py  the study process: the out directory, resume, progress from the workers' events, status.json
    worker.py  a worker process (one GPU each, round-robin): its source of runs, one run to its end, the run lock
    remote.py  the runs through a Redis stream, for `tradeloop study-worker` on other hosts
    stats.py   selection on validation, bootstrap CIs, paired differences, the study-wide DSR
    report.py  baselines.json, results.json, report.md, report.png
"""
