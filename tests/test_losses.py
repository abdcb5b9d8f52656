"""Losses against small hand-computed cases: C51 projection, quantile Huber, expectile, n-step targets."""
import math

import pytest
import torch

from services.trainer.losses import (adapt_entropy_coef, atom_utilisation, batch_sum, c51_cross_entropy_probs,
                                     expectile_loss, nstep_returns, project_distribution, projection_weights,
                                     quantile_huber_loss, top_two)

Z3 = torch.tensor([-1.0, 0.0, 1.0])  # 3-atom support, Δz = 1


def test_projection_between_atoms_splits_mass_linearly():
    # Tz = 0.5 lies halfway between z=0 and z=1
    m = project_distribution(torch.tensor([[0.5]]), torch.tensor([[1.0]]), Z3)
    assert torch.allclose(m, torch.tensor([[0.0, 0.5, 0.5]]))


def test_projection_clips_at_v_max_and_v_min():
    m = project_distribution(torch.tensor([[2.0, -3.0]]), torch.tensor([[0.7, 0.3]]), Z3)
    assert torch.allclose(m, torch.tensor([[0.3, 0.0, 0.7]]))


def test_projection_of_two_atoms_by_hand():
    # −0.25 → 0.25 on −1, 0.75 on 0;  0.75 → 0.25 on 0, 0.75 on 1; probabilities 0.4, 0.6
    m = project_distribution(torch.tensor([[-0.25, 0.75]]), torch.tensor([[0.4, 0.6]]), Z3)
    assert torch.allclose(m, torch.tensor([[0.1, 0.45, 0.45]]))


def test_projection_identity_and_shift_by_reward_gamma():
    z = torch.linspace(-2.0, 2.0, 5)                       # Δz = 1
    p = torch.tensor([[0.1, 0.2, 0.4, 0.2, 0.1]])
    assert torch.allclose(project_distribution(z.expand(1, 5), p, z), p)
    # r = 1, γ = 1: every atom moves up one; the top one clips onto z = 2
    m = project_distribution((1.0 + z).expand(1, 5), p, z)
    assert torch.allclose(m, torch.tensor([[0.0, 0.1, 0.2, 0.4, 0.3]]))
    # r = 0, γ = 0.5: Tz = (−1, −.5, 0, .5, 1) → mass .1 to −1; .2 split −1/0; .4 to 0; .2 split 0/1; .1 to 1
    m = project_distribution((0.5 * z).expand(1, 5), p, z)
    assert torch.allclose(m, torch.tensor([[0.0, 0.2, 0.6, 0.2, 0.0]]))


def test_projection_equals_the_dense_hat_weights_form():
    """The two-neighbour scatter equals Σ_j clip(1 − |Tz_j − z_i| / Δz, 0, 1) p_j (Dopamine's dense form), atoms
    outside the support, on an atom and at both ends included."""
    g = torch.Generator().manual_seed(1)
    z = torch.linspace(-0.05, 0.05, 51)
    tz = torch.cat([torch.randn(64, 40, generator=g) * 0.04, z.expand(64, 51)[:, ::5],
                    torch.tensor([[-0.05, 0.05, -0.2, 0.2, 0.0]]).expand(64, 5)], 1)       # 64 × 56
    p = torch.softmax(torch.randn(64, tz.shape[1], generator=g), -1)
    dense = (projection_weights(tz, z) * p.unsqueeze(-2)).sum(-1)
    m = project_distribution(tz, p, z)
    assert torch.allclose(m, dense, atol=1e-6)
    assert torch.allclose(m.sum(-1), torch.ones(64), atol=1e-6)


def test_projection_keeps_mass_and_mean_inside_support():
    g = torch.Generator().manual_seed(0)
    z = torch.linspace(-1, 1, 11)
    p = torch.softmax(torch.randn(4, 11, generator=g), -1)
    tz = 0.05 + 0.9 * z
    m = project_distribution(tz.expand(4, 11), p, z)
    assert torch.allclose(m.sum(-1), torch.ones(4))
    assert torch.allclose((m * z).sum(-1), (p * tz).sum(-1), atol=1e-6)  # no clipping here: the mean is kept


def test_c51_cross_entropy_by_hand():
    probs = torch.tensor([[0.2, 0.3, 0.5]])
    target = torch.tensor([[0.0, 0.5, 0.5]])
    expected = -(0.5 * math.log(0.3) + 0.5 * math.log(0.5))
    assert c51_cross_entropy_probs(probs, target).item() == pytest.approx(expected, rel=1e-6)


def test_quantile_huber_by_hand():
    # pred 0 at τ = 0.25; targets 2 (u = 2 > κ: huber = 1.5, weight .25) and −0.5 (huber .125, weight .75)
    loss = quantile_huber_loss(torch.tensor([[0.0]]), torch.tensor([[2.0, -0.5]]), torch.tensor([[0.25]]))
    assert loss.item() == pytest.approx((0.25 * 1.5 + 0.75 * 0.125) / 2)


def test_quantile_huber_sums_over_quantiles_and_minimiser_is_quantile():
    pred = torch.tensor([[0.0, 1.0]])
    taus = torch.tensor([[0.1, 0.9]])
    target = torch.tensor([[0.5]])
    # τ=.1: u = .5 ≥ 0 → weight .1; τ=.9: u = −.5 < 0 → weight |.9 − 1| = .1; huber(.5) = .125 each
    assert quantile_huber_loss(pred, target, taus).item() == pytest.approx(0.1 * 0.125 * 2)
    # gradient descent on one quantile converges near the τ-quantile of the targets {0..9}
    th = torch.zeros(1, 1, requires_grad=True)
    tgt = torch.arange(10.0).view(1, 10)
    opt = torch.optim.SGD([th], lr=0.5)
    for _ in range(400):
        opt.zero_grad()
        quantile_huber_loss(th, tgt, torch.tensor([[0.75]]), kappa=0.01).sum().backward()
        opt.step()
    assert 6.5 <= th.item() <= 7.5


def test_expectile_loss_weights_by_sign():
    d = torch.tensor([2.0, -2.0])
    assert torch.allclose(expectile_loss(d, 0.7), torch.tensor([0.7 * 4, 0.3 * 4]))


def test_nstep_returns_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    d = torch.zeros(1, 5, dtype=torch.bool)
    R, disc = nstep_returns(r, d, torch.tensor(0.5), (1, 3, 5))
    assert torch.allclose(R, torch.tensor([[1.0, 1 + 1 + 0.75, 1 + 1 + 0.75 + 0.5 + 0.3125]]))
    assert torch.allclose(disc, torch.tensor([[0.5, 0.125, 0.03125]]))


def test_nstep_done_mask_stops_rewards_and_bootstrap():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    d = torch.tensor([[False, True, False, False, False]])  # the episode ends with transition 1
    R, disc = nstep_returns(r, d, torch.tensor(0.5), (1, 3, 5))
    assert torch.allclose(R, torch.tensor([[1.0, 2.0, 2.0]]))      # rewards 3, 4, 5 belong to the next episode
    assert torch.allclose(disc, torch.tensor([[0.5, 0.0, 0.0]]))    # no bootstrap past the end


def test_entropy_coefficient_rises_when_atoms_unused():
    beta = torch.tensor(1e-3)
    adapt_entropy_coef(beta, torch.tensor(0.1), target=0.3, rate=1.0)
    assert beta.item() == pytest.approx(1e-3 * math.exp(0.2))
    adapt_entropy_coef(beta, torch.tensor(0.9), target=0.3, rate=1.0)
    assert beta.item() == pytest.approx(1e-3 * math.exp(0.2 - 0.6))
    # utilisation: one-hot uses 1 of 4 atoms; uniform uses all
    assert atom_utilisation(torch.tensor([[10.0, -10, -10, -10]])).item() == pytest.approx(0.25)
    assert atom_utilisation(torch.zeros(1, 4)).item() == pytest.approx(1.0)


def test_shift_distribution_moves_the_mean_by_delta_and_is_differentiable():
    """Φ(z + δ): identity at δ = 0; the mean moves by exactly δ while no mass reaches an end of the support; mass
    past an end piles there; the result is a distribution with a gradient in δ."""
    from services.trainer.losses import shift_distribution
    z = torch.linspace(-1.0, 1.0, 21)
    p = torch.softmax(torch.randn(4, 3, 21) * 0.3, -1) * 0.0
    p[..., 8:13] = torch.softmax(torch.randn(4, 3, 5), -1)                       # mass well inside the support
    delta = torch.tensor([0.0, 0.05, -0.13, 0.31], requires_grad=True)
    q = shift_distribution(p, delta, z)
    torch.testing.assert_close(q[0], p[0])
    torch.testing.assert_close(q.sum(-1), torch.ones(4, 3))
    torch.testing.assert_close((q * z).sum(-1), (p * z).sum(-1) + delta.detach().view(4, 1).expand(4, 3))
    (q * z).sum().backward()
    assert delta.grad is not None and torch.all(delta.grad != 0)
    far = shift_distribution(p[:1], torch.tensor([5.0]), z)                      # everything past the top
    torch.testing.assert_close(far[..., -1], torch.ones(1, 3))


def _dense_shift(probs: torch.Tensor, delta: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Φ(z + δ) with every A × A hat weight (the form `shift_distribution` replaced), in atom units: w_ij =
    clip(1 − |clip(j + δ / Δz, 0, A − 1) − i|, 0, 1) — `projection_weights(z + δ, z)` on an evenly spaced support,
    without the rounding of the support's values."""
    A = z.shape[0]
    pos = (torch.arange(A) + (delta / ((z[-1] - z[0]) / (A - 1))).unsqueeze(1)).clamp(0, A - 1)   # N × A'
    w = (1.0 - (pos.unsqueeze(1) - torch.arange(A).view(1, A, 1)).abs()).clamp(0.0, 1.0)          # N × A × A'
    return torch.einsum("nij,nkj->nki", w, probs)


def test_dense_shift_in_atom_units_is_the_projection_of_the_moved_support():
    """The test's dense shift is `projection_weights(z + δ, z)`, the C51 projection of the moved atoms, up to the
    rounding of the support's values."""
    g = torch.Generator().manual_seed(4)
    z = torch.linspace(-0.05, 0.05, 51)
    delta = torch.randn(16, generator=g) * 0.03
    p = torch.softmax(torch.randn(16, 5, 51, generator=g), -1)
    want = torch.einsum("nij,nkj->nki", projection_weights(z.unsqueeze(0) + delta.unsqueeze(1), z), p)
    torch.testing.assert_close(_dense_shift(p, delta, z), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["random", "zero", "whole steps", "past the ends", "on the ends"])
def test_shift_distribution_band_equals_the_dense_weights_with_their_subgradients(case):
    """The four-atom band gives the dense hat weights' values and gradients in p and δ — at δ = 0 and at whole atom
    steps too, where every source atom sits on a kink and the dense form's subgradient in δ is the central one
    (the two-weight projection's is one-sided there: that form fails this test)."""
    from services.trainer.losses import shift_distribution
    g = torch.Generator().manual_seed(3)
    A, N = 51, 24
    z = torch.linspace(-0.05, 0.05, A)
    dz = 0.1 / (A - 1)
    delta = {"random": torch.randn(N, generator=g) * 0.03, "zero": torch.zeros(N),
             "whole steps": torch.arange(-12, 12).float() * dz,
             "past the ends": torch.linspace(-0.3, 0.3, N),
             "on the ends": torch.tensor([-0.1, 0.1]).repeat(N // 2)}[case]
    p0 = torch.softmax(torch.randn(N, 5, A, generator=g), -1)
    target = torch.softmax(torch.randn(N, 5, A, generator=g), -1)
    out = []
    for form in (shift_distribution, _dense_shift):
        d, p = delta.clone().requires_grad_(), p0.clone().requires_grad_()
        q = form(p, d, z)
        c51_cross_entropy_probs(q, target).sum().backward()                       # the update's loss of it
        out.append((q.detach(), p.grad, d.grad))
    for name, band, dense in zip(("values", "d/dp", "d/dδ"), *out):
        torch.testing.assert_close(band, dense, rtol=1e-5, atol=1e-5 * (1.0 + float(dense.abs().max())),
                                   msg=lambda m: f"{case}, {name}: {m}")
    if case in ("zero", "whole steps"):
        assert torch.all(out[0][2].abs() > 0), "the central subgradient in δ is non-zero at a kink"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shift_distribution_on_cuda_equals_the_cpu(no_tf32):
    """On CUDA the shift's scatter-add runs as atomics in no fixed order; values and gradients must be the CPU's
    within float rounding (fp32, no TF32). It passed on the H200 with the band form
    (bench/README.md, entry 2358885)."""
    out = _shift_on("cpu"), _shift_on("cuda")
    for name, a, b in zip(("shifted", "d/dp", "d/dδ"), *out):
        print(f"{name}: max |cpu − cuda| {(a - b).abs().max():.3g} of max |cpu| {a.abs().max():.3g}")
        # d/dδ sums ~4A terms of both signs: its small entries carry the rounding of its large ones (on the H200,
        # the dense form's: 6.1e-5 apart where the largest is 426), so the absolute bar scales with the tensor's
        # largest entry; a misplaced atom would be off by O(1) of it
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * (1.0 + float(a.abs().max())),
                                   msg=lambda m: f"{name}: {m}")


def _shift_on(dev: str) -> list[torch.Tensor]:
    from services.trainer.losses import shift_distribution
    g = torch.Generator().manual_seed(5)
    z = torch.linspace(-0.05, 0.05, 51)
    delta = torch.randn(33, generator=g) * 0.03
    p0 = torch.softmax(torch.randn(33, 5, 51, generator=g), -1)
    d, p = delta.to(dev).requires_grad_(), p0.to(dev).requires_grad_()
    q = shift_distribution(p, d, z.to(dev))
    (q * torch.linspace(0.5, 2.0, 51, device=dev)).square().sum().backward()
    return [x.detach().cpu() for x in (q, p.grad, d.grad)]


@pytest.mark.parametrize("n", [3, 5])
def test_top_two_equals_topk_with_a_subgradient_at_ties(n):
    """`top_two` (max / median form for the direction branch's three actions) gives topk's two values exactly,
    ties and equal rows included, and the gradient of their gap: +1 at the largest, −1 at the second, apart from
    ties, where it may split between the tied entries but keeps the same sums."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, n, generator=g)
    q[:8] = torch.randint(0, 2, (8, n), generator=g).float()           # ties: two or three equal values
    q[8] = 0.5                                                          # a row of equal values
    q.requires_grad_(True)
    first, second = top_two(q)
    want = q.detach().topk(2, dim=1).values
    assert torch.equal(first.detach(), want[:, 0]) and torch.equal(second.detach(), want[:, 1])
    (first - second).sum().backward()
    gq = q.grad
    assert torch.allclose(gq.sum(1), torch.zeros(64))                   # +1 and −1 in every row
    vals = q.detach()
    untied = (vals.unsqueeze(2) != vals.unsqueeze(1)).sum((1, 2)) == n * (n - 1)
    assert untied.sum() > 40
    ref = torch.zeros_like(vals)
    ref.scatter_(1, vals.topk(2, dim=1).indices, torch.tensor([1.0, -1.0]).expand(64, 2))
    assert torch.equal(gq[untied], ref[untied])
    # at ties: the gradient stays on the entries holding the largest and second values
    on_top = (vals >= want[:, 1:2])
    assert torch.all(gq[~on_top] == 0)


@pytest.mark.parametrize("shape", [(4096,), (512, 3), (37,), (1,), (96, 2, 5)])
def test_batch_sum_is_the_sum_over_the_first_dimension(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    got = batch_sum(x)
    assert got.shape == x.shape[1:]
    torch.testing.assert_close(got, x.sum(0), rtol=1e-12, atol=1e-12)
