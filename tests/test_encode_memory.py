"""bench/encode_memory.py on the CPU: the evaluation's batched part at two chunk sizes, each in a process of its own —
the same embeddings whatever the chunk, and the larger chunk's peak memory the larger."""
from __future__ import annotations

import pytest

from bench import encode_memory


def test_chunks_change_no_embedding_and_the_larger_one_takes_more_memory(capsys):
    rows = encode_memory.main(["--device", "cpu", "--preset", "small", "--bars", "9000", "--chunks", "64", "8192",
                               "--repeats", "1"])
    assert [r["chunk"] for r in rows] == [64, 8192]
    assert all(r["delta_emb"] < 1e-6 and r["s"] > 0 and r["reserved_gib"] is None for r in rows)
    assert rows[1]["peak_gib"] > rows[0]["peak_gib"] >= 0
    out = capsys.readouterr().out
    assert "| 8192 |" in out and "| chunk (windows) |" in out


def test_bad_arguments_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit) as exc:
        encode_memory.main(["--device", "cpu", "--chunks", "0"])
    assert exc.value.code == 2 and "--chunks" in capsys.readouterr().err
