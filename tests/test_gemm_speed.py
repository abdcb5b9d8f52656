"""bench/gemm_speed.py: its shapes are the update's (the heads' padded width, the IQN's rows), and it runs."""
from bench.gemm_speed import main, shapes
from services.trainer.train import TrainConfig


def test_shapes_follow_the_preset_and_the_heads_padding():
    cfg = TrainConfig.preset("full", 16)
    a, M = cfg.agent, cfg.iqn_quantiles
    assert cfg.horizon_sample and cfg.iqn_batch == 512        # the preset: one horizon a sample, IQN on 512 samples
    cols = a.ensemble * a.n_actions * a.n_atoms
    got = {what: (m, k, n) for what, m, k, n in shapes(cfg, 4096)}
    # the heads' product is as wide as `Agent.market` pads it on CUDA (`align_pad`: 16-byte bf16 rows)
    m, k, n = got["heads at the bootstrap states"]
    assert (m, k) == (4096, a.hidden) and n % 8 == 0 and cols <= n < cols + 8
    assert got["target IQN, hidden layer"] == (512 * M, a.hidden, a.hidden)
    assert got["online IQN, hidden layer"] == (512 * M, a.hidden, a.hidden)
    cfg.horizon_sample, cfg.iqn_batch = False, 0
    got = {what: (m, k, n) for what, m, k, n in shapes(cfg, 4096)}
    H = len(cfg.horizons)
    assert got["heads at the bootstrap states"][0] == 4096 * H
    assert got["target IQN, hidden layer"] == (4096 * H * M, a.hidden, a.hidden)


def test_runs_on_a_cpu_and_reports_every_shape_and_dtype():
    rows = main(["--device", "cpu", "--batch", "2", "--repeat", "1", "--dtypes", "float32"])
    assert len(rows) == 5 and all(r["us"] > 0 and r["dtype"] == "float32" for r in rows)
