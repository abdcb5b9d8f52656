"""A study's worker processes: each takes run ids from its source (the study process's queue, or a Redis stream
through `tradeloop.study.remote`) and runs them to their end (`execute_run`), reporting progress as events.

Worker i is pinned to GPU i mod G of the G visible ones (`CUDA_VISIBLE_DEVICES` set before it loads CUDA), compiles
into the compile cache every run of the user's uses (`shared.graphs.compile_cache_dir`: `TORCHINDUCTOR_CACHE_DIR`
when set, else `~/.cache/tradeloop/inductor`, Triton's kernels under it unless `TRITON_CACHE_DIR` is set), so a
study of a configuration already compiled on this machine loads its kernels instead of compiling them (compiling and
capturing `full` on a fresh H200: 133 s, bench/README.md 2026-12-03 · 799ab21), and dies with the study process
(`PR_SET_PDEATHSIG`). With a compiled `--accel` (auto on CUDA) or on a GPU the workers after the first start
once the first has finished an epoch (`WARM_FILE`: its compiled kernels are then in the shared cache, and the GPU
memory of one run is measured, `RUN_MEMORY_FILE`: a worker past the runs that fit its GPU stands down; `--stagger
SECONDS`: worker i starts i × SECONDS later instead), and the workers sharing a GPU then start `SPREAD_S` apart,
so that their runs' epochs do not stay in step. A run holds an exclusive lock on its directory while it runs,
so no run is ever done by two processes; a run killed half done resumes from its latest epoch
(`tradeloop.study.loop`).
"""
from __future__ import annotations

import gc
import hashlib
import itertools
import json
import multiprocessing.util
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Callable

from shared.redis_server import die_with_parent
from services.trainer.sm_partition import ENV_SLOT, ENV_SMS
from tradeloop.locks import FileLock, Locked, describe_holder
from tradeloop.study.guard import code_fingerprint
from tradeloop.study.loop import PARTS, write_json_atomic
from tradeloop.study.remote import RunHandedOver
from tradeloop.study.spec import RunSpec, StudyError, StudySpec

WARM_FILE = ".cache/warm"
"""Under the out directory: written when the first epoch of any run is done (the shared compile cache is warm)."""
RUN_MEMORY_FILE = ".cache/gpu-memory.json"
"""Under the out directory: the GPU memory one run holds ({"run_bytes", "total_bytes", "gpu"}), read on the device
once the first epoch of the first run is done, while it runs alone there (the other workers wait for `WARM_FILE`);
it caps the runs at once on each GPU (`runs_that_fit`)."""
SPREAD_S = 1.0
"""With `--stagger auto`, the k-th worker of a GPU starts k × SPREAD_S after the compile cache is warm. Runs started
at one moment stay in step, and each epoch's write of its weights and trainer state (≈ 1.1 s with ten runs at once
on an H200, bench/README.md 2026-12-04 · 55afb1c) then leaves the GPU idle for all of them together; runs spread by
about one write keep their writes apart, each overlapping the others' training."""
MEMORY_HEADROOM = 0.95
"""The share of a GPU's memory the study's runs may fill together."""


def runs_that_fit(total_bytes: int, run_bytes: int, headroom: float = MEMORY_HEADROOM) -> int:
    """How many runs of `run_bytes` one GPU of `total_bytes` holds at once within `headroom` of it (at least one)."""
    return max(1, int(headroom * total_bytes) // max(int(run_bytes), 1))


def record_run_memory(out: Path, gpu: str | None) -> None:
    """Write `RUN_MEMORY_FILE` from this process's device, unless a run has already measured it."""
    import torch

    if not (out / RUN_MEMORY_FILE).exists():
        free, total = torch.cuda.mem_get_info()
        write_json_atomic(out / RUN_MEMORY_FILE, {"run_bytes": int(total - free), "total_bytes": int(total),
                                                  "gpu": gpu})


def gpu_slots(out: Path) -> tuple[int, dict] | None:
    """(runs at once that fit one GPU, `RUN_MEMORY_FILE`'s record), or None before any run has measured it."""
    path = out / RUN_MEMORY_FILE
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    return runs_that_fit(doc["total_bytes"], doc["run_bytes"]), doc


class DataCache:
    """Bars, features and folds per data seed, built once per worker process (the last `keep` seeds kept)."""

    def __init__(self, spec: StudySpec, keep: int = 3):
        self.spec, self.keep, self._cache = spec, keep, {}

    def get(self, data_seed: int):
        if data_seed not in self._cache:
            from shared.market import compute_features
            from tradeloop.study.spec import load_study_bars, study_folds

            bars = load_study_bars(self.spec, data_seed)
            while len(self._cache) >= self.keep:
                self._cache.pop(next(iter(self._cache)))
            self._cache[data_seed] = (bars, compute_features(bars), study_folds(self.spec, len(bars)))
        return self._cache[data_seed]


def short_key(doc) -> str:
    """A short hash of a JSON-able document (its keys sorted): equal documents, equal keys."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def first_epoch_key(cfg, knobs) -> str:
    """Runs whose first epoch trains under the same config and knobs (and seed and data) must agree there."""
    return short_key([cfg.to_dict(), knobs.to_dict()])


def knobs_key(knobs: dict) -> str:
    """An epoch's knobs (a record's `knobs`) as a short key: epochs under equal keys trained under the same knobs."""
    return short_key(knobs)


def insample_sharpe(record: dict) -> float | None:
    """An epoch record's in-sample per-trade Sharpe (the greedy policy on the training split's last bars), 0 where it
    is undefined, as validation's (`SplitReport.metric`); None where the record has no in-sample window (written
    before it was kept, or a training split too short for one)."""
    m = record.get("insample")
    if not m:
        return None
    return 0.0 if m.get("per_trade_sharpe") is None else float(m["per_trade_sharpe"])


def execute_run(spec: StudySpec, out: Path, rs: RunSpec, data: DataCache,
                on_epoch: Callable[[dict], None] | None = None, train_fn: Callable | None = None) -> dict:
    """Run (or resume) one run of the study to its end; returns its summary (also written to summary.json).
    `train_fn`: how its epochs train (a lockstep group's member; None: alone)."""
    import torch

    from shared.metrics import selection_dsr
    from tradeloop.study.loop import evaluate_selected, first_knobs, prune_checkpoints, run_closed_loop
    from tradeloop.study.stats import select_epoch

    t0 = time.perf_counter()
    run_dir = out / "runs" / rs.run_id
    bars, feats, folds = data.get(spec.data_seed_of(rs.seed))
    split = folds[rs.fold]
    cfg, fb = spec.configs(spec.variant(rs.variant), feats.shape[1])
    peers = spec.peers(rs)                    # the other runs of its population (none outside one)
    trained_before = len(list((run_dir / "loop").glob("epoch-*.json"))) if run_dir.exists() else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "attempts.jsonl", "a") as f:   # one line per start: a resume shows its starting epoch
        f.write(json.dumps({"pid": os.getpid(), "from_epoch": trained_before, "t": time.time()}) + "\n")
    records = run_closed_loop(bars, spec.dataset, run_dir, spec.epochs, config=cfg, feedback=fb, split=split,
                              seed=rs.seed, device=spec.device, accel=spec.accel, features=feats,
                              run_id=rs.run_id, on_epoch=on_epoch, peers=[out / "runs" / r.run_id for r in peers],
                              train_fn=train_fn)
    vals = [float(r["history"]["val_sharpe"]) for r in records]
    trades = [int(r["history"]["val_n_trades"]) for r in records]
    sel, selectable = select_epoch(vals, trades, spec.min_val_trades)
    chosen = evaluate_selected(run_dir, sel, records, bars=bars, split=split, dataset=spec.dataset,
                               device=spec.device, features=feats, run_id=rs.run_id)
    val_tr = records[sel - 1]["val_trade_returns"]
    om, vm, plain = chosen["oos"], records[sel - 1]["val"], chosen["unshaped"]
    sharpe = lambda m: float(m["per_trade_sharpe"] or 0.0)  # noqa: E731 — a backtest's metrics → its per-trade Sharpe
    summary = {
        "run_id": rs.run_id, "variant": rs.variant, "seed": rs.seed, "fold": rs.fold,
        "data_seed": spec.data_seed_of(rs.seed), "split": split.to_dict(), "n_bars": len(bars),
        "epochs": [{"epoch": r["epoch"], "val_sharpe": vals[i], "val_trades": trades[i],
                    **{f"{k}_s": r["seconds"].get(k) for k in PARTS},
                    "compile_s": (r.get("train") or {}).get("compile_s"),   # of train_s: compiling, capturing
                    "insample_sharpe": insample_sharpe(r),
                    "epsilon": r["knobs"]["epsilon"], "gamma": r["knobs"]["gamma"],
                    "lr_decay": r["knobs"].get("lr_decay", 1.0),
                    "rollback": r["bundle"]["rollback"], "reason": r["bundle"]["reason"],
                    "rollback_to": r["bundle"].get("rollback_to_epoch") if r["bundle"]["rollback"] else None,
                    "exploit": r["bundle"].get("exploit"), "knobs_key": knobs_key(r["knobs"]),
                    "checkpoint_sha256": r["checkpoint_sha256"]} for i, r in enumerate(records)],
        "selected_epoch": sel, "selectable": selectable,
        "val_sharpe": vals[sel - 1], "val_trades": trades[sel - 1],
        "oos_sharpe": sharpe(om), "oos_trades": int(om["n_trades"]),
        "val_metrics": vm, "oos_metrics": om,
        "val_recheck": sharpe(chosen["val"]) - vals[sel - 1],
        # the policy as learned, without the E5/E9 knobs that shape the greedy policy (equal where none does)
        "shaped": chosen["unshaped"] is not None,
        "val_sharpe_unshaped": vals[sel - 1] if plain is None else sharpe(plain["val"]),
        "oos_sharpe_unshaped": sharpe(om if plain is None else plain["oos"]),
        "selected_val_trade_returns": val_tr,
        "run_dsr": selection_dsr(val_tr, vals, trades, spec.min_val_trades),
        "first_epoch_key": first_epoch_key(cfg, first_knobs(cfg)), "config_hash": cfg.hash(),
        "feedback": fb.to_dict(),
        "epochs_trained_here": spec.epochs - trained_before, "wall_s": time.perf_counter() - t0,
        "device": spec.device, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES") if spec.device != "cpu" else None,
        "pid": os.getpid(), "host": socket.gethostname(), "code": code_fingerprint(),
        # torch's threads in this run: on a CPU a run's numbers depend on them (a float sum's order), so a study
        # resumed or shared across hosts with another --parallel or --threads pairs runs trained alike only where
        # these agree
        "threads": torch.get_num_threads(),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    prune_checkpoints(run_dir, {sel}, keep_state=bool(peers))   # a population's later runs may exploit it
    return summary


class RunBusy(StudyError):
    """The run's directory is locked by another live process (`lock_run`)."""


def lock_run(run_dir: Path) -> FileLock:
    """The exclusive lock on a run directory's .lock (`tradeloop.locks.FileLock`), held while this process trains
    the run, released when it ends (even killed); RunBusy naming the holder when another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return FileLock.acquire(run_dir / ".lock", mode=0o644)
    except Locked as exc:
        raise RunBusy(f"{run_dir} is being run by another process ({describe_holder(exc.holder)})") from None


def worker_env(out: Path, gpu: str | None, deterministic: bool, iteration_sms: int = 0,
               slot: int = 0) -> dict[str, str]:
    """The environment a worker sets before it loads CUDA (the caches only where the user has not set them; on a
    GPU with `iteration_sms`, the SMs its runs' iterations may use and its slot among its GPU's workers, which
    `services.trainer.sm_partition` turns into a partition of its own)."""
    from shared.graphs import compile_cache_dir

    cache = compile_cache_dir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if iteration_sms and gpu is not None:
        env.update({ENV_SMS: str(iteration_sms), ENV_SLOT: str(slot)})
    return env


class LocalSource:
    """Runs from the study process's queue; events back to it."""

    def __init__(self, tasks, events):
        self.get, self.emit = tasks.get, events.put

    def done(self, run_id: str, summary: dict) -> None:
        pass                                  # summary.json is the done marker

    def failed(self, run_id: str, error: str) -> None:
        pass                                  # the study process records it from the event

    def check(self) -> None:
        pass                                  # a queued run is this worker's alone

    def hand_over(self) -> bool:
        return False                          # a run locked by another process fails: this study cannot finish it

    def close(self) -> None:
        pass


def exit_on_sigterm(signum, frame) -> None:
    """A worker's SIGTERM (the study stopping it, or a signal to the study's whole group): end as multiprocessing
    ends a child that returns — its finalizers run, among them torch.compile's, which shuts its pool of compile
    processes down and frees the semaphores the pool holds (a worker ended where it stood left them to the resource
    tracker's "leaked semaphore" warning) — then exit. Not by raising: a SystemExit raised inside a `__del__` is
    printed and swallowed, and the worker would train on. Only the first is taken; a worker whose finalizers hang is
    killed with the study (`die_with_parent`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.util._exit_function()
    finally:
        os._exit(128 + signum)


def worker_main(index: int, gpu: str | None, out: str, source: tuple, threads: int, wait_warm: float,
                delay: float, parent_pid: int, extra_env: dict[str, str] | None = None, slot: int = 0,
                spread: float = 0.0) -> None:
    """A worker process: take run ids from its source (("local", tasks, events) or ("redis", sid, n_runs), the Redis
    URL from its environment: `remote.url_in_env`)
    until there is none left, run each, report progress as events. `slot`: its place among the workers of its GPU;
    a worker whose slot is past the runs that fit the GPU's memory (`gpu_slots`) stands down before its next run,
    and a run that meets CUDA out of memory waits for memory to free and resumes (`OOM_RETRIES` times)."""
    die_with_parent(signal.SIGKILL)   # a killed study leaves no worker running on
    if os.getppid() != parent_pid:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the study process's to handle: it stops the workers
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    out_p = Path(out)
    spec = StudySpec.from_dict(json.loads((out_p / "study.json").read_text())["spec"])
    for k, v in worker_env(out_p, gpu, spec.deterministic, spec.iteration_sms, slot).items():
        if k.endswith("_CACHE_DIR"):
            os.environ.setdefault(k, v)   # a cache the user points at is kept
        else:
            os.environ[k] = v
    os.environ.update(extra_env or {})   # the study's MPS daemon (`tradeloop.study.mps`)
    import torch

    torch.set_num_threads(threads)
    if spec.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    if delay > 0:
        time.sleep(delay)
    if wait_warm > 0:
        deadline = time.monotonic() + wait_warm
        while not (out_p / WARM_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    if spread > 0:
        time.sleep(spread)
    if source[0] == "redis":
        from tradeloop.study.remote import RedisSource, env_url

        src = RedisSource(env_url(), *source[1:])
    else:
        src = LocalSource(*source[1:])
    data = DataCache(spec)
    while True:
        fit = gpu_slots(out_p) if gpu is not None else None
        if fit is not None and slot >= fit[0]:
            src.emit({"type": "stand-down", "worker": index, "gpu": gpu, "fit": fit[0],
                      "run_bytes": fit[1]["run_bytes"], "total_bytes": fit[1]["total_bytes"], "t": time.time()})
            break
        task = src.get()
        if task is None:
            break
        if isinstance(task, list):           # a lockstep group (`lockstep_groups`)
            run_group(spec, out_p, task, data, src, index, gpu)
        else:
            run_task(spec, out_p, task, data, src, index, gpu)
            release_run(spec)
    src.emit({"type": "exit", "worker": index, "t": time.time()})
    src.close()


def run_task(spec: StudySpec, out: Path, run_id: str, data: DataCache, src, index: int, gpu: str | None,
             train_fn: Callable | None = None) -> None:
    """One run in this worker, start to end, its progress and its end (done or error) reported as events; under its
    directory's lock. A run another worker took over (`RunHandedOver`, at an epoch's end) or that a live process
    on this disk holds (`RunBusy`) is left to it where the source allows (`hand_over`: through Redis), reported as
    "handed-over", not as an error. Alone (`train_fn` None) a run that meets CUDA out of memory resumes
    (`run_with_memory_retries`); a lockstep member fails instead (the study run again resumes it)."""
    import torch

    rs = spec.run(run_id)
    src.emit({"type": "start", "worker": index, "run": run_id, "gpu": gpu, "t": time.time()})
    lock = None
    try:
        lock = lock_run(out / "runs" / run_id)

        def on_epoch(rec: dict) -> None:
            src.check()                              # RunHandedOver: another worker has the run now
            warm = out / WARM_FILE
            if not warm.exists():
                warm.parent.mkdir(parents=True, exist_ok=True)
                if gpu is not None:
                    record_run_memory(out, gpu)      # before the others start: this worker alone on its GPU
                warm.write_text(f"{run_id} epoch {rec['epoch']}\n")
            src.emit({"type": "epoch", "worker": index, "run": run_id, "epoch": rec["epoch"],
                      "val_sharpe": rec["history"]["val_sharpe"], "train_s": rec["seconds"]["train"],
                      "eval_s": rec["seconds"]["eval"], "t": time.time()})

        if train_fn is None:
            s = run_with_memory_retries(spec, out, rs, data, on_epoch, src, index, gpu)
        else:
            try:
                s = execute_run(spec, out, rs, data, on_epoch, train_fn=train_fn)
            except torch.cuda.OutOfMemoryError as exc:
                raise StudyError(f"CUDA out of memory on GPU {gpu} in a lockstep group ({str(exc).splitlines()[0]}); "
                                 "a group holds its runs' states and their batched copy: run the same command "
                                 "again to resume the run, with a smaller --lockstep or --parallel") from None
        src.done(run_id, s)
        src.emit({"type": "done", "worker": index, "run": run_id, "t": time.time(),
                  "summary": {**{k: s[k] for k in ("selected_epoch", "selectable", "val_sharpe", "val_trades",
                                                   "oos_sharpe", "oos_trades", "run_dsr", "wall_s",
                                                   "epochs_trained_here")},
                              "exploited": [f"{x['run']} e{x['epoch']}" for e in s["epochs"][:-1]
                                            if (x := e.get("exploit"))]}})
    except (RunBusy, RunHandedOver) as exc:
        if not src.hand_over():
            _report_failure(src, run_id, index, exc)
        else:
            src.emit({"type": "handed-over", "worker": index, "run": run_id, "why": str(exc), "t": time.time()})
    except Exception as exc:  # noqa: BLE001 — reported to the study process, which decides
        _report_failure(src, run_id, index, exc)
    finally:
        if lock is not None:
            lock.release()


def _report_failure(src, run_id: str, index: int, exc: Exception) -> None:
    """A run's failure to its source (stored through Redis) and to the study process (an "error" event)."""
    err = f"{type(exc).__name__}: {exc}"
    src.failed(run_id, err)
    src.emit({"type": "error", "worker": index, "run": run_id, "t": time.time(), "error": err,
              "traceback": "".join(traceback.format_exception(exc))})


def run_group(spec: StudySpec, out: Path, run_ids: list[str], data: DataCache, src, index: int,
              gpu: str | None) -> None:
    """A lockstep group: its runs each in a thread of this worker (`run_task`), their epochs trained as one
    (`services.trainer.lockstep.Lockstep`); what the group leaves is freed once all of them are done."""
    import torch

    from services.trainer.lockstep import train_in_lockstep

    data.get(spec.data_seed_of(spec.run(run_ids[0]).seed))     # the group's market, built once before the threads
    # runs that fall out of step train alone, each compiling its own closures of the step's code: room for them all
    # before dynamo's per-code cache is full (and runs go eager)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(run_ids))
    rounds = train_in_lockstep(run_ids, lambda run_id, train_fn: run_task(spec, out, run_id, data, src, index, gpu,
                                                                          train_fn=train_fn))
    src.emit({"type": "lockstep", "worker": index, "runs": run_ids, "rounds": rounds, "t": time.time()})
    release_run(spec)


def release_run(spec: StudySpec) -> None:
    """What a finished (or failed) run leaves in the worker process, freed before the next run builds its own."""
    import torch

    if spec.compiled():              # each run compiles new closures of the same code: without a reset
        torch._dynamo.reset()         # dynamo's per-code cache fills up (recompile limit) and runs go eager;
                                      # the compiled kernels stay in the shared on-disk cache
    gc.collect()                      # the run's graphs, replay and caches
    if torch.cuda.is_available() and spec.device != "cpu":
        torch.cuda.empty_cache()


OOM_RETRIES = 3
"""Times a run that met CUDA out of memory resumes (from its last epoch) once memory is free again."""
OOM_WAIT_S = 1800.0
"""The longest a run waits for its GPU to free the memory one run takes, before each retry."""


def run_with_memory_retries(spec: StudySpec, out: Path, rs: RunSpec, data: DataCache, on_epoch, src, index: int,
                            gpu: str | None) -> dict:
    """`execute_run`; on CUDA out of memory (the GPU's other runs took more than the measured share), free what
    the run held, wait until the GPU has a run's memory free (`RUN_MEMORY_FILE`; else 30 s), and resume the run
    from its last epoch, `OOM_RETRIES` times; then the error says what to do."""
    import torch

    for attempt in itertools.count():
        try:
            return execute_run(spec, out, rs, data, on_epoch)
        except torch.cuda.OutOfMemoryError as exc:
            what = str(exc).splitlines()[0]
        release_run(spec)       # outside the except block: its traceback's frames (the run's tensors) are gone
        if attempt == OOM_RETRIES:
            raise StudyError(f"CUDA out of memory on GPU {gpu} {OOM_RETRIES + 1} times (the last: {what}); run the "
                             "same command again to resume the run, with a smaller --parallel")
        need = (gpu_slots(out) or (0, {"run_bytes": 0}))[1]["run_bytes"]
        src.emit({"type": "memory-wait", "worker": index, "run": rs.run_id, "gpu": gpu, "need_bytes": need,
                  "t": time.time()})
        deadline = time.monotonic() + (OOM_WAIT_S if need else 30.0)
        while time.monotonic() < deadline and (not need or torch.cuda.mem_get_info()[0] < need):
            time.sleep(2.0)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (those of its own CUDA_VISIBLE_DEVICES, else
    0 … n−1); the study process does not create a CUDA context."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def first_fills_cache(spec: StudySpec, out: Path, gpus: list[str]) -> bool:
    """Whether the workers after the first wait for its first epoch (`start_plan`): `--stagger auto`, a compiled
    accel or a GPU, and no run of this out directory has finished an epoch yet (`WARM_FILE`)."""
    return spec.stagger == "auto" and (spec.compiled() or bool(gpus)) and not (out / WARM_FILE).exists()


def start_plan(spec: StudySpec, out: Path, P: int, gpus: list[str]) -> list[tuple[float, float, float]]:
    """Per worker (wait for the warm cache ≤ s, delay s, spread s): `--stagger auto` — with a compiled accel or on a
    GPU, the workers after the first wait (≤ 10 min) for the first epoch of any run, so that its compile fills the
    shared cache and its GPU memory is measured alone; on a GPU, the k-th worker of each GPU then starts k × SPREAD_S
    later (a resumed study's too). `--stagger SECONDS`: worker i starts i × SECONDS after the first, nothing else."""
    auto = spec.stagger == "auto"
    fixed = 0.0 if auto else float(spec.stagger)
    first = first_fills_cache(spec, out, gpus)
    shared = bool(gpus) and P > len(gpus)
    return [(600.0 if first and i > 0 else 0.0, i * fixed, (i // len(gpus)) * SPREAD_S if auto and shared else 0.0)
            for i in range(P)]


def start_workers(ctx, spec: StudySpec, out: Path, source: tuple, P: int, gpus: list[str], threads: int,
                  extra_env: dict[str, str] | None = None) -> list:
    """P worker processes (spawn), worker i on GPU i mod G, started as `start_plan` says.
    `extra_env` is set in every worker before it loads CUDA."""
    workers = []
    for i, (wait, delay, spread) in enumerate(start_plan(spec, out, P, gpus)):
        gpu = gpus[i % len(gpus)] if gpus else None
        workers.append(ctx.Process(target=worker_main, name=f"study-worker-{i}",
                                   args=(i, gpu, str(out), source, threads, wait, delay, os.getpid(),
                                         extra_env, i // len(gpus) if gpus else i, spread)))
    for p in workers:
        p.start()
    return workers
