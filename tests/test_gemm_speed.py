"""bench/gemm_speed.py: its shapes are the update's (the heads' padded width, the IQN's rows), and it runs."""
from bench.gemm_speed import main, shapes
from services.trainer.train import TrainConfig


def test_shapes_follow_the_preset_and_the_heads_padding():
    cfg = TrainConfig.preset("full", 16)
    a, H, M = cfg.agent, len(cfg.horizons), cfg.iqn_quantiles
    cols = a.ensemble * (1 + a.n_actions) * a.n_atoms
    got = {what: (m, k, n) for what, m, k, n in shapes(cfg, 4096)}
    # the heads' product is as wide as `Agent.market` pads it on CUDA (`align_pad`: 16-byte bf16 rows)
    m, k, n = got["heads at the bootstrap states"]
    assert (m, k) == (4096 * H, a.hidden) and n % 8 == 0 and cols <= n < cols + 8
    assert got["target IQN, hidden layer"] == (4096 * H * M, a.hidden, a.hidden)
    assert got["online IQN, hidden layer"] == (4096 * M, a.hidden, a.hidden)


def test_runs_on_a_cpu_and_reports_every_shape_and_dtype():
    rows = main(["--device", "cpu", "--batch", "2", "--repeat", "1", "--dtypes", "float32"])
    assert len(rows) == 5 and all(r["us"] > 0 and r["dtype"] == "float32" for r in rows)
