"""services/trainer/traced.py: a stateful step traced at the level of aten ops on its first call and run as its
compiled graph after it — the same state changes as the step run eagerly (views of one storage updated in
place), its Python run once."""
import torch

from services.trainer.traced import TracedStep


class Toy:
    """A step over tensors some of which view one storage (as the parameters of a flat optimizer buffer do): a
    backward pass, an update of a parameter from its gradient, an update of one view from another, a counter."""

    def __init__(self):
        self.flat = torch.arange(12.0)
        self.a, self.b = self.flat[:6].view(2, 3), self.flat[6:].view(2, 3)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.n = torch.zeros((), dtype=torch.long)
        self.python_calls = 0

    def __call__(self) -> torch.Tensor:
        self.python_calls += 1
        loss = (self.a @ self.w).square().sum() / 100
        loss.backward()
        with torch.no_grad():
            self.w.sub_(0.1 * self.w.grad)
            self.w.grad = None
            self.a.add_(self.b * 0.5 + self.w.sum())
            self.b.mul_(0.9)
            self.n += 1
        return loss.detach()


def test_a_traced_step_compiled_changes_the_state_as_the_step_run_eagerly():
    eager, traced = Toy(), Toy()
    step = TracedStep(traced, lambda graph: torch.compile(graph, backend="aot_eager"))
    assert not step.traced
    for _ in range(4):
        want, got = eager(), step()
        assert torch.equal(got, want)
    assert step.traced
    for name in ("flat", "w", "n"):
        assert torch.equal(getattr(traced, name), getattr(eager, name)), name
    assert int(traced.n) == 4 and traced.python_calls == 1         # the Python ran once: the trace
