"""The GPU issue's reference point: a plain branching-C51 update, timed in the modes of train_speed.py.

    python3 bench/plain_c51.py --device cuda                       # batches 256 and 4 096, all four modes
    .venv/bin/python bench/plain_c51.py --device cpu --modes eager --batches 256 --updates 5

The reference measured ~210 updates/s eager and ~1 240 captured in one CUDA graph at batch 4 096 on an H200 (TF32),
~2 100 at batch 256, for a plain branching C51: an MLP trunk and one C51 head per action branch, a target network,
the projected Bellman target and the cross-entropy, Adam and the target update. tradeloop's `full` update does far
more (a causal attention encoder, a 5-member dueling ensemble, the portfolio shift, the IQN risk head, the expectile
and stability losses, prioritised replay): this bench runs the plain update through the same machinery
(`shared.graphs.capture`, torch.compile, the capturable AdamW, TF32), so the two figures side by side separate what
the capture costs from what the agent costs.

The network: the `full` preset's decision input flattened (64 bars × 16 features = 1 024), two 256-wide ReLU layers,
and the agent's branches (direction 3, size 2, exit 3 actions) × 51 atoms. Each update gathers its batch from a
device pool of 2^20 random transitions at indices drawn outside the step, as replay sampling would. Prints one
table, updates/s per batch and mode, with each mode's ratio to eager.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from services.trainer.losses import project_distribution  # noqa: E402
from shared.graphs import capture  # noqa: E402

BRANCHES = (3, 2, 3)
MODES = ("eager", "graph", "compile", "compile+graph")


class PlainC51(nn.Module):
    """MLP trunk, one C51 head per branch: obs N × I → logits N × Σ n_b × A (branch-major)."""

    def __init__(self, n_in: int, hidden: int, atoms: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.heads = nn.Linear(hidden, sum(BRANCHES) * atoms)
        self.atoms = atoms

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.heads(self.trunk(obs)).view(obs.shape[0], sum(BRANCHES), self.atoms)


class Plain:
    """A plain branching-C51 learner over a device pool of transitions; `step()` is one update on the batch at the
    indices in `self.idx` (static: the caller draws them before each call)."""

    def __init__(self, batch: int, device: torch.device, *, n_in: int = 1024, hidden: int = 256, atoms: int = 51,
                 pool: int = 1 << 20, gamma: float = 0.99, v_max: float = 10.0, tau: float = 0.01, lr: float = 1e-4,
                 compiled: bool = False, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        torch.manual_seed(seed)
        self.net = PlainC51(n_in, hidden, atoms).to(device)
        self.target = PlainC51(n_in, hidden, atoms).to(device)
        self.target.load_state_dict(self.net.state_dict())
        cuda = device.type == "cuda"
        # fused Adam eagerly and in a graph (capturable: its step count stays on the device); the capturable foreach
        # form when compiled (inductor lowers it to its own kernels)
        kw = (dict(capturable=True, foreach=True) if compiled and cuda else
              dict(fused=True, capturable=True) if cuda else {})
        self.opt = torch.optim.Adam(self.net.parameters(), lr=lr, **kw)
        self.support = torch.linspace(-v_max, v_max, atoms, device=device)
        self.gamma, self.tau = gamma, tau
        n = pool
        self.obs = torch.randn(n, n_in, generator=g).to(device)
        self.next_obs = torch.roll(self.obs, -1, 0)
        self.action = torch.stack([torch.randint(0, k, (n,), generator=g) for k in BRANCHES], 1).to(device)
        self.reward = (torch.randn(n, generator=g) * 0.5).to(device)
        self.done = (torch.rand(n, generator=g) < 0.01).float().to(device)
        self.starts = [sum(BRANCHES[:i]) for i in range(len(BRANCHES))]                      # first column per branch
        self.first = torch.tensor(self.starts, device=device)
        self.idx = torch.zeros(batch, dtype=torch.long, device=device)
        self.loss = torch.zeros((), device=device)

    def step(self) -> torch.Tensor:
        i, z, A = self.idx, self.support, self.support.shape[0]
        obs, nxt, col = self.obs[i], self.next_obs[i], self.action[i] + self.first           # col: N × 3
        with torch.no_grad():
            # the target network's greedy action of each branch and its distribution, projected (Bellemare 2017)
            p_next = torch.softmax(self.target(nxt), -1)                                       # N × ΣB × A
            q = (p_next * z).sum(-1)
            best = torch.stack([q[:, s:s + k].argmax(1) + s for s, k in zip(self.starts, BRANCHES)], 1)
            p_star = p_next.gather(1, best.unsqueeze(-1).expand(-1, -1, A))                     # N × 3 × A
            tz = self.reward[i].view(-1, 1, 1) + self.gamma * (1 - self.done[i]).view(-1, 1, 1) * z
            m = project_distribution(tz.expand_as(p_star), p_star, z)
        logp = torch.log_softmax(self.net(obs), -1).gather(1, col.unsqueeze(-1).expand(-1, -1, A))
        loss = -(m * logp).sum(-1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(self.target.parameters()), list(self.net.parameters()), self.tau)
            self.loss.copy_(loss.detach())
        return self.loss


def updates_per_s(mode: str, batch: int, device: torch.device, n: int, pool: int) -> float:
    torch._dynamo.reset()
    p = Plain(batch, device, compiled="compile" in mode, pool=pool)
    fn = torch.compile(p.step) if "compile" in mode else p.step
    if "graph" in mode:
        fn = capture(fn, warmup=3)
    draw = lambda: torch.randint(0, p.obs.shape[0], p.idx.shape, out=p.idx)  # noqa: E731  outside the step
    for _ in range(3):
        draw()
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        draw()
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def update_gflop(batch: int) -> float:
    """Floating-point operations of one update at `batch` (torch's FLOP counter, on the CPU: the count is the
    device's), in GFLOP — beside bench/update_flops.py's count for tradeloop's update."""
    from torch.utils.flop_counter import FlopCounterMode
    p = Plain(batch, torch.device("cpu"), pool=1 << 12)
    with FlopCounterMode(display=False) as fc:
        p.step()
    return fc.get_total_flops() / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batches", nargs="+", type=int, default=[256, 4096])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--pool", type=int, default=1 << 20, help="transitions in the device pool")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# plain_c51: device={name} torch={torch.__version__} tf32={dev.type == 'cuda'}")
    rates = {(b, m): updates_per_s(m, b, dev, a.updates, a.pool) for b in a.batches for m in a.modes}
    print("\n| batch | GFLOP per update | " + " | ".join(a.modes) + " | "
          + " | ".join(f"{m} / {a.modes[0]}" for m in a.modes[1:]) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(a.modes) - 1))
    for b in a.batches:
        row = [f"{rates[b, m]:.0f}" for m in a.modes]
        ratios = [f"{rates[b, m] / rates[b, a.modes[0]]:.1f}×" for m in a.modes[1:]]
        print(f"| {b} | {update_gflop(b):.2f} | " + " | ".join(row + ratios) + " |")


if __name__ == "__main__":
    main()
