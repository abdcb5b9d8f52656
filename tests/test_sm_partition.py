"""services/trainer/sm_partition.py and `tradeloop study --iteration-sms`: what a worker is told, how the trainer reads
it, where it is refused; on an NVIDIA GPU, that the iterations' graph captured on the partition runs on its SMs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.sm_partition_probe import timed
from services.trainer import sm_partition
from services.trainer.sm_partition import ENV_SLOT, ENV_SMS, PartitionError, partition_streams, requested


def test_the_request_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_SMS, raising=False)
    monkeypatch.delenv(ENV_SLOT, raising=False)
    assert requested() is None
    monkeypatch.setenv(ENV_SMS, "0")
    assert requested() is None                       # 0: no limit
    monkeypatch.setenv(ENV_SMS, "40")
    assert requested() == (40, 0)
    monkeypatch.setenv(ENV_SLOT, "7")
    assert requested() == (40, 7)


@pytest.mark.parametrize("sms, slot, word", [("forty", "0", "integers"), ("40", "x", "integers"),
                                               ("-8", "0", "≥ 0"), ("40", "-1", "≥ 0")])
def test_a_bad_request_names_the_variables(monkeypatch, sms, slot, word):
    monkeypatch.setenv(ENV_SMS, sms)
    monkeypatch.setenv(ENV_SLOT, slot)
    with pytest.raises(PartitionError, match=f"{ENV_SMS}.*{word}"):
        requested()


def test_a_bad_request_is_said_and_the_run_goes_on_unpartitioned(monkeypatch, capsys):
    monkeypatch.setenv(ENV_SMS, "forty")
    assert partition_streams(torch.device("cuda", 0), 3) is None
    assert f"{ENV_SMS}='forty'" in capsys.readouterr().err


def test_no_partition_off_the_gpu(monkeypatch):
    """On the CPU the request is ignored: the runner's steps run on the current stream as without it."""
    monkeypatch.setenv(ENV_SMS, "40")
    monkeypatch.setenv(ENV_SLOT, "1")
    assert partition_streams(torch.device("cpu"), 3) is None


def test_a_driver_without_green_contexts_leaves_the_whole_gpu(monkeypatch, capsys):
    """A refused partition (here: no libcuda) is said once on stderr and the run goes on unpartitioned."""
    def no_driver(*_):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setenv(ENV_SMS, "40")
    monkeypatch.setattr(sm_partition, "make_partition", no_driver)
    monkeypatch.setattr(sm_partition, "_held", {})
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: None)       # no CUDA context to make on this machine
    assert partition_streams(torch.device("cuda", 0), 3) is None
    assert partition_streams(torch.device("cuda", 0), 3) is None
    err = capsys.readouterr().err
    assert err.count("no SM partition") == 1 and "libcuda.so.1" in err and "whole GPU" in err


def test_a_study_worker_is_told_its_sms_and_slot_on_a_gpu_only(tmp_path: Path):
    from tradeloop.study.worker import worker_env

    env = worker_env(tmp_path, "0", False, iteration_sms=40, slot=3)
    assert (env[ENV_SMS], env[ENV_SLOT]) == ("40", "3")
    assert ENV_SMS not in worker_env(tmp_path, "0", False) and ENV_SMS not in worker_env(tmp_path, None, False, 40, 3)


def test_iteration_sms_is_how_a_study_runs_not_what_it_measures(tmp_path: Path):
    from tradeloop.cmd_study import build_spec
    from tradeloop.study.spec import StudyError

    base = {"dataset": "synthetic", "epochs": 1, "out": tmp_path / "o", "folds": 1}
    a, _ = build_spec({**base, "iteration_sms": 40})
    b, _ = build_spec(base)
    assert (a.iteration_sms, b.iteration_sms) == (40, 0) and a.identity() == b.identity()
    for bad in (-1, 5000):
        with pytest.raises(StudyError, match=rf"--iteration-sms must be a count of SMs .* got {bad}"):
            build_spec({**base, "iteration_sms": bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with green contexts")
def test_a_graph_captured_on_the_partition_runs_on_its_sms(monkeypatch):
    """Compute-bound matmuls captured on the partition's stream take about SMs / sms times as long as on the whole
    GPU, wherever the graph is replayed; the result is the same."""
    monkeypatch.setenv(ENV_SMS, "16")
    monkeypatch.setenv(ENV_SLOT, "1")
    streams = partition_streams(torch.device("cuda"), 1)
    if streams is None:
        pytest.skip("this driver has no green contexts")
    part = streams[0]
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def work():
        for _ in range(40):
            torch.mm(a, a, out=c)

    whole = timed(work, torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    part.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=part):
        work()
    held = timed(g.replay, part)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert held > 0.5 * (sms / 16) * whole
    assert torch.allclose(c.float(), a.float() @ a.float(), rtol=0.05, atol=2.0)
