"""Checkpoints: safetensors round trip, sha256 checks, refusal of pickles; the Redis checkpoint store."""
from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch

from shared.checkpoints import (CheckpointError, checkpoint_sha256, checkpoint_to_bytes, load_checkpoint,
                                save_checkpoint, sidecar_path)
from shared.store import RunStore, StoreError


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    return {"trunk.weight": w, "trunk.bias": torch.arange(3, dtype=torch.float32),
            "head.t": w.t(),  # a non-contiguous view sharing w's storage
            "steps": torch.tensor([7], dtype=torch.int64), "half": torch.ones(2, dtype=torch.bfloat16)}


META = {"epoch": 3, "config_hash": "abc", "knobs": {"epsilon": 0.1}, "splits": ["train", "val"]}


def test_round_trip_sidecar_and_sha(tmp_path):
    path = tmp_path / "ckpt" / "epoch_3.safetensors"
    digest = save_checkpoint(path, sample_tensors(), META)
    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() == checkpoint_sha256(data)
    assert sidecar_path(path).read_text().split() == [digest, path.name]
    tensors, meta = load_checkpoint(path)
    assert meta == META
    expected = sample_tensors()
    assert tensors.keys() == expected.keys()
    for k, v in expected.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v), k
    # header is plain safetensors JSON with our metadata under __metadata__["tradeloop"]
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert json.loads(header["__metadata__"]["tradeloop"]) == META
    # from bytes, with and without an expected digest
    assert load_checkpoint(data, digest)[1] == META
    assert load_checkpoint(data)[1] == META
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]


def test_sha256_mismatch_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, sample_tensors(), META)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as ei:
        load_checkpoint(path)
    assert str(path) in str(ei.value)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(bytes(data), hashlib.sha256(b"other").hexdigest())


def test_path_without_sidecar_or_expected_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    digest = save_checkpoint(path, sample_tensors(), META)
    sidecar_path(path).unlink()
    with pytest.raises(CheckpointError, match="no sha256 to check"):
        load_checkpoint(path)
    assert load_checkpoint(path, digest)[1] == META


class _Boom:
    """Unpickling this would create a file: the test proves nothing is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_pickle_and_zip_are_refused_without_unpickling(tmp_path, writer):
    marker = tmp_path / "UNPICKLED"
    path = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save({"w": torch.ones(2), "x": _Boom(str(marker))}, path)
    else:
        path.write_bytes(pickle.dumps(_Boom(str(marker)), protocol=4))
    data = path.read_bytes()
    with pytest.raises(CheckpointError, match="not a safetensors file and will not be unpickled"):
        load_checkpoint(path, checkpoint_sha256(data))
    assert not marker.exists()


@pytest.mark.parametrize("header_len", [0x0480, 0x010480])
def test_a_header_whose_length_starts_like_a_pickle_is_read(tmp_path, header_len):
    """A header of 1 152 (or 66 688) bytes starts 0x80 0x04, the opening of a protocol-4 pickle: the file is still
    a safetensors checkpoint and loads (the sniffing for pickles must not refuse it)."""
    data = checkpoint_to_bytes(sample_tensors(), META)
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].rstrip(b" ")
    assert len(header) <= header_len
    padded = header_len.to_bytes(8, "little") + header + b" " * (header_len - len(header)) + data[8 + n:]
    assert padded[:2] == b"\x80\x04"
    path = tmp_path / "c.safetensors"
    path.write_bytes(padded)
    tensors, meta = load_checkpoint(path, checkpoint_sha256(padded))
    assert meta == META and torch.equal(tensors["trunk.weight"], sample_tensors()["trunk.weight"])


def test_truncated_and_garbage_headers(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, sample_tensors(), META)
    data = path.read_bytes()
    for cut, needle in [(len(data) - 5, "outside"), (20, "truncated"), (4, "truncated")]:
        with pytest.raises(CheckpointError, match=needle):
            load_checkpoint(data[:cut])
    huge = (10**12).to_bytes(8, "little") + b"{}"
    with pytest.raises(CheckpointError, match="exceeds"):
        load_checkpoint(huge)
    not_json = (4).to_bytes(8, "little") + b"abcd"
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(not_json)
    no_meta = (2).to_bytes(8, "little") + b"{}"
    with pytest.raises(CheckpointError, match="__metadata__"):
        load_checkpoint(no_meta)
    with pytest.raises(CheckpointError, match="file not found"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.zeros(1000)}, {"v": 1})
    d2 = save_checkpoint(path, {"a": torch.ones(3)}, {"v": 2})
    tensors, meta = load_checkpoint(path)
    assert meta == {"v": 2} and torch.equal(tensors["a"], torch.ones(3))
    assert sidecar_path(path).read_text().split()[0] == d2
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors", "c.safetensors.sha256"]


def test_unserialisable_metadata_is_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "c.safetensors", {"a": torch.ones(1)}, {"x": float("nan")})
    assert not (tmp_path / "c.safetensors").exists()


@pytest.mark.redis
async def test_store_keeps_last_k_checkpoints_and_checks_sha(redis_url, run_id):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = RunStore(client, run_id, keep_checkpoints=2)
        blobs = {}
        for epoch in range(4):
            blobs[epoch] = checkpoint_to_bytes({"w": torch.full((3,), float(epoch))}, {"epoch": epoch})
            key, digest = await store.put_checkpoint(epoch, blobs[epoch])
            assert key == f"tl:{run_id}:ckpt:{epoch}" and digest == checkpoint_sha256(blobs[epoch])
        assert await store.checkpoint_epochs() == [2, 3]
        assert await client.exists(f"tl:{run_id}:ckpt:0", f"tl:{run_id}:ckpt:1") == 0
        data = await store.get_checkpoint(3, checkpoint_sha256(blobs[3]))
        tensors, meta = load_checkpoint(data, checkpoint_sha256(blobs[3]))
        assert meta == {"epoch": 3} and torch.equal(tensors["w"], torch.full((3,), 3.0))
        with pytest.raises(StoreError, match=r"epoch 0 is not in Redis.*\[2, 3\]"):
            await store.get_checkpoint(0)
        await client.set(f"tl:{run_id}:ckpt:2", blobs[2][:-1] + b"\x00")  # corrupted in Redis
        with pytest.raises(CheckpointError, match="sha256 mismatch"):
            await store.get_checkpoint(2)
        with pytest.raises(CheckpointError, match="before storing"):
            await store.put_checkpoint(5, blobs[3], sha256="0" * 64)
        # reports: first write wins (a retried handler does not overwrite)
        assert await store.put_report(3, {"sharpe": 1.5}) is True
        assert await store.put_report(3, {"sharpe": -9}) is False
        assert await store.get_report(3) == {"sharpe": 1.5} and await store.has_report(3)
        # with tallies and marks: written with the report only when it is new (one script, atomic)
        evals, by = f"tl:{run_id}:evaluations", f"tl:{run_id}:evaluated_by"
        for who in ("a", "b"):
            await store.put_report(4, {"sharpe": 0.5}, tally=(evals,), mark={by: who})
        assert await client.hgetall(evals) == {b"4": b"1"} and await client.hgetall(by) == {b"4": b"a"}
        assert await store.json_epochs("report") == [3, 4]
        assert await store.get_bundle(3) is None and not await store.has_bundle(3)
        assert await store.put_bundle(3, '{"epsilon": 0.2}') is True
        assert await store.json_epochs("bundle") == [3]
        assert await store.delete_run() > 0 and await store.checkpoint_epochs() == []
    finally:
        await client.aclose()


def test_a_checkpoint_of_the_earlier_agent_is_refused_with_a_clear_error(tmp_path):
    """A checkpoint whose heads read the portfolio (`port.*` tensors, no portfolio shift) names what does not match
    and why, in the evaluator's loader and in `agent_from_checkpoint`."""
    import pytest
    import torch

    from services.evaluator.runner import restore_agent
    from shared.agent import Agent, AgentConfig, agent_from_checkpoint
    from shared.checkpoints import CheckpointError, save_checkpoint

    cfg = AgentConfig(n_features=5, window=8, d_model=16, n_heads=2, hidden=24, n_atoms=11, ensemble=2)
    old = {k: v for k, v in Agent(cfg).state_dict().items() if not k.startswith(("shift.", "code."))}
    old["port.0.weight"] = torch.zeros(8, 8)
    path = tmp_path / "old.safetensors"
    save_checkpoint(path, old, {"kind": "agent", "agent_config": cfg.to_dict()})
    with pytest.raises(CheckpointError, match="earlier agent whose heads read the portfolio"):
        restore_agent(path, expected_sha256=None)
    with pytest.raises(ValueError, match=r"missing \['code.bias'"):
        agent_from_checkpoint(old, {"agent_config": cfg.to_dict()})


def test_evaluate_on_a_checkpoint_without_its_sidecar_says_what_is_missing(tmp_path):
    """The message names the sidecar file the trainer writes, and no option that does not exist."""
    from services.evaluator.cli_eval import EvaluateInputError, report_for_cli

    path = tmp_path / "c.safetensors"
    save_checkpoint(path, sample_tensors(), META)
    sidecar_path(path).unlink()
    with pytest.raises(EvaluateInputError, match=r"no sha256 to verify against \(c\.safetensors\.sha256, which the "
                                                 r"trainer writes beside every checkpoint, is missing\)") as info:
        report_for_cli(path)
    assert "--sha256" not in str(info.value)
