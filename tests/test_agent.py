"""The network and the policy step: shapes, dueling identity, batch consistency, ε, gates, sizing."""

import math

import pytest
import torch

from shared.agent import Agent, AgentConfig, PolicyControls, act

CFG = AgentConfig(n_features=5, window=8, d_model=16, n_heads=2, hidden=24, n_atoms=11, ensemble=3,
                  iqn_embed=8, iqn_quantiles_act=10)


def make(seed=0, shift=True):
    """A random agent; `shift`: randomise the portfolio shift's last layer (zero in a fresh agent)."""
    torch.manual_seed(seed)
    ag = Agent(CFG)
    if shift:
        with torch.no_grad():
            ag.shift[2].weight.normal_(0.0, 0.5)
            ag.shift[2].bias.normal_(0.0, 0.2)
    return ag


def test_shapes_and_dueling_identity():
    ag = make()
    emb = ag.encode(torch.randn(4, 8, 5))
    assert emb.shape == (4, 16)
    out = ag.head(emb, torch.randn(4, CFG.n_portfolio))
    assert out.logits.shape == (4, 3, sum(CFG.branch_sizes), 11)
    # dueling: mean over actions of V + A − mean A equals V, so the mean logit is the same for every branch
    means = [out.logits[:, :, sl].mean(2) for sl in CFG.branch_slices()]
    assert torch.allclose(means[0], means[1], atol=1e-5) and torch.allclose(means[0], means[2], atol=1e-5)
    assert ag.quantiles(out.hidden, torch.rand(4, 7)).shape == (4, 7, 3)
    assert out.value_e.shape == (4,) and out.delta.shape == (4, sum(CFG.branch_sizes) + 1)


def test_dueling_folded_into_the_weights_is_the_written_out_sum_and_its_gradients():
    """`Agent.logit_weights`: the logits from one product with the centred weights equal V + A_a − mean_branch A
    computed from the value and advantage streams as written in the paper, and so do the parameters' gradients."""
    ag = make()
    with torch.no_grad():
        for p in [ag.value_b, *ag.adv_b]:
            p.normal_(0.0, 0.5)
    h = torch.randn(6, CFG.hidden)
    K, A = CFG.ensemble, CFG.n_atoms
    value = torch.einsum("nh,kha->nka", h, ag.value_w) + ag.value_b                     # N × K × A
    adv = torch.cat([torch.einsum("nh,khc->nkc", h, w) + b for w, b in zip(ag.adv_w, ag.adv_b)], dim=2)
    adv = adv.view(6, K, -1, A)                                                         # N × K × NB × A
    centre = torch.cat([adv[:, :, sl].mean(2, keepdim=True).expand(-1, -1, sl.stop - sl.start, -1)
                        for sl in CFG.branch_slices()], dim=2)
    written = value.unsqueeze(2) + adv - centre
    w, b = ag.logit_weights()
    folded = (h @ w + b).view(6, K, -1, A)
    torch.testing.assert_close(folded, written, rtol=1e-5, atol=1e-5)
    up = torch.randn_like(written)
    params = [ag.value_w, ag.value_b, *ag.adv_w, *ag.adv_b]
    grads = torch.autograd.grad((folded * up).sum(), params)
    for g, r in zip(grads, torch.autograd.grad((written * up).sum(), params)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    # and the market heads are that product on the trunk state
    emb = torch.randn(6, 16)
    torch.testing.assert_close(ag.market(emb).logits, (ag.trunk(emb) @ w + b).view(6, K, -1, A))


def test_layer_norms_folded_into_the_next_products_give_the_same_encoder_and_gradients():
    """`Agent.fold_layer_norms`: the encoder's embedding and every parameter's gradient (γ and β of each folded
    LayerNorm included) equal the unfolded network's, through a full block and the last-token block."""
    cfg = AgentConfig(n_features=5, window=8, d_model=16, n_heads=2, n_layers=2, hidden=24, n_atoms=11, ensemble=3,
                      iqn_embed=8, iqn_quantiles_act=10)
    torch.manual_seed(3)
    plain = Agent(cfg)
    with torch.no_grad():
        for blk in plain.enc_blocks:               # affines away from (1, 0): a fold that dropped one would show
            for ln in (blk.ln1, blk.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0.0, 0.3)
    folded = Agent(cfg)
    folded.load_state_dict(plain.state_dict())
    folded.fold_layer_norms(True)
    assert all(blk.fold_ln for blk in folded.enc_blocks)
    w = torch.randn(7, 8, 5)
    up = torch.randn(7, 16)
    embs, grads = [], []
    for ag in (plain, folded):
        emb = ag.encode(w)
        embs.append(emb)
        grads.append(torch.autograd.grad((emb * up).sum(), list(ag.parameters()), allow_unused=True))
    torch.testing.assert_close(embs[1], embs[0], rtol=1e-5, atol=1e-5)
    names = [n for n, _ in plain.named_parameters()]
    for name, g, r in zip(names, grads[1], grads[0]):
        if r is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert any(".ln1." in n for n, g in zip(names, grads[0]) if g is not None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_gradient_comes_in_its_parameters_layout(compiled):
    """Autograd takes a gradient as it is only when its strides are the parameter's; otherwise it copies it, one
    kernel a parameter after the backward. The advantage streams are used through `torch.cat`, whose gradients are
    strided slices: `dense_grad` makes them contiguous inside the backward (eager and compiled)."""
    ag = make()
    params = dict(ag.named_parameters())

    def loss(w, pf):
        out = ag.head(ag.encode(w), pf)
        q = ag.quantiles(out.hidden, torch.rand(w.shape[0], 4))
        return out.logits.float().square().mean() + out.value_e.square().mean() + q.square().mean()
    fn = torch.compile(loss) if compiled else loss
    torch._dynamo.reset()
    grads = torch.autograd.grad(fn(torch.randn(6, 8, 5), torch.randn(6, CFG.n_portfolio)), list(params.values()))
    unlike = {n: (tuple(g.stride()), tuple(p.stride())) for (n, p), g in zip(params.items(), grads)
              if g.stride() != p.stride()}
    assert not unlike, f"gradients with strides unlike their parameter's (grad, parameter): {unlike}"


def test_portfolio_enters_only_as_a_shift_of_the_market_distributions():
    """Logits, trunk state and IQN read the market alone; the portfolio moves Q (and V_e) by δ, the same for every
    member; δ scales with v_max; a fresh agent starts with δ = 0."""
    ag = make()
    emb = ag.encode(torch.randn(5, 8, 5))
    p1, p2 = torch.randn(5, CFG.n_portfolio), torch.randn(5, CFG.n_portfolio)
    o1, o2 = ag.head(emb, p1), ag.head(emb, p2)
    assert torch.equal(o1.logits, o2.logits)
    assert torch.equal(o1.hidden, o2.hidden) and not torch.allclose(o1.delta, o2.delta)
    q1, q2 = ag.q_values(o1.logits, o1.delta), ag.q_values(o2.logits, o2.delta)             # N × K × NB
    NB = sum(CFG.branch_sizes)
    torch.testing.assert_close(q1 - q2, (o1.delta - o2.delta)[:, :NB].unsqueeze(1).expand_as(q1))
    ag.v_max.fill_(2 * float(ag.v_max))
    torch.testing.assert_close(ag.head(emb, p1).delta, 2 * o1.delta)
    assert torch.equal(make(shift=False).head(emb, p1).delta, torch.zeros(5, sum(CFG.branch_sizes) + 1))


def test_view_is_what_acting_reads():
    """`Agent.view` of a batch = the same Q (no shift), tail quantiles and code as the heads, row by row."""
    ag = make()
    emb = ag.encode(torch.randn(6, 8, 5))
    v = ag.view(emb)
    m = ag.market(emb)
    q = ag.q_values(m.logits)                                                       # N × K × NB
    torch.testing.assert_close(v.q, q.mean(1))
    torch.testing.assert_close(v.q_std, q[:, :, :3].std(1, unbiased=False))
    torch.testing.assert_close(v.tail, ag.quantiles(m.hidden, ag.act_taus[:CFG.n_tail]))
    torch.testing.assert_close(v.code, m.code)
    r = v.rows(torch.tensor([4, 1]))
    torch.testing.assert_close(r.q, v.q[[4, 1]])


def test_support_follows_v_max():
    ag = make()
    ag.v_max.fill_(0.2)
    z = ag.support
    assert z[0].item() == pytest.approx(-0.2) and z[-1].item() == pytest.approx(0.2) and z.shape == (11,)


def test_encode_is_batch_consistent_and_causal_in_the_window():
    ag = make()
    w = torch.randn(6, 8, 5)
    full = ag.encode(w)
    single = torch.cat([ag.encode(w[i:i + 1]) for i in range(6)])
    assert torch.allclose(full, single, atol=1e-5)
    # the embedding depends on earlier bars of the window (attention reaches back)
    w2 = w.clone()
    w2[:, 0] += 3.0
    assert not torch.allclose(ag.encode(w2), full)


def _act(ag, emb, port, position, controls, **kw):
    B = emb.shape[0]
    return act(ag, ag.view(emb), port, position=position, bars_in_trade=kw.get("bars", torch.zeros(B, dtype=torch.long)),
               vol=torch.full((B,), 0.01, dtype=torch.float64), regime=torch.zeros(B, dtype=torch.long),
               controls=controls, generator=torch.Generator().manual_seed(1))


def test_greedy_policy_matches_argmax_of_ensemble_mean_q():
    ag = make()
    B = 32
    emb, port = torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio)   # δ ≠ 0 all the same (the shift's bias)
    ctl = PolicyControls.make("cpu", epsilon=0.0)
    a = _act(ag, emb, port, torch.zeros(B, dtype=torch.float64), ctl)
    out = ag.head(emb, port)
    q = ag.q_values(out.logits, out.delta).mean(1)                                          # N × NB
    for b, sl in enumerate(CFG.branch_slices()):
        assert torch.equal(a.branches[:, b], q[:, sl].argmax(-1))
    # flat accounts: target = side × size × Kelly scale (f = 0 → kelly_floor) × confidence 1
    side = a.branches[:, 0].double() - 1
    size = torch.tensor(CFG.size_levels, dtype=torch.float64)[a.branches[:, 1]]
    assert torch.allclose(a.target, side * size * CFG.kelly_floor)
    # exit plans: take-profit / stop = multiples of the bar volatility (inf = none)
    plans = torch.tensor(CFG.exit_plans, dtype=torch.float64)[a.branches[:, 2]]
    assert torch.equal(a.take_profit, plans[:, 0] * 0.01) and torch.equal(a.stop_loss, plans[:, 1] * 0.01)


def test_epsilon_one_explores_every_action():
    ag = make()
    B = 600
    a = _act(ag, torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio), torch.zeros(B, dtype=torch.float64),
             PolicyControls.make("cpu", epsilon=1.0))
    for b, n in enumerate(CFG.branch_sizes):
        counts = torch.bincount(a.branches[:, b], minlength=n).float() / B
        assert torch.all((counts - 1.0 / n).abs() < 0.08)


def test_epistemic_gate_and_regime_confidence_block_new_entries():
    ag = make()
    ag.maturity.fill_(1.0)
    B = 64
    emb, port = torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio)
    flat = torch.zeros(B, dtype=torch.float64)
    a = _act(ag, emb, port, flat, PolicyControls.make("cpu", epsilon=1.0, gate_threshold=0.0))
    # every entry where the ensemble disagrees (std > 0) is blocked: flat target, direction reported as flat
    assert torch.all(a.target == 0)
    assert torch.all(a.branches[:, 0] == 1)
    assert a.blocked.sum() > 0
    a = _act(ag, emb, port, flat, PolicyControls.make("cpu", epsilon=1.0, regime_confidence=[0.0] * 9))
    assert torch.all(a.target == 0)


def test_epistemic_gate_compares_the_raw_std_whatever_the_maturity():
    """E5's θ is a quantile of the ensemble's own std: the gate blocks at θ itself, not θ / maturity."""
    ag = make()
    B = 256
    emb, port = torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio)
    flat = torch.zeros(B, dtype=torch.float64)
    noise = torch.rand(B, 6, generator=torch.Generator().manual_seed(3))
    d = (noise[:, 3] * ag.act_n[0]).long()                             # ε = 1: the direction is the random one
    view = ag.view(emb)
    std = view.q_std.gather(1, d.view(B, 1)).squeeze(1)
    entering = d != 1
    theta = float(std[entering].median())

    def blocked(gate):
        return act(ag, view, port, position=flat, bars_in_trade=torch.zeros(B, dtype=torch.long),
                   vol=torch.full((B,), 0.01, dtype=torch.float64), regime=torch.zeros(B, dtype=torch.long),
                   controls=PolicyControls.make("cpu", epsilon=1.0, gate_threshold=gate), noise=noise).blocked

    for m in (1.0, 0.25):
        ag.maturity.fill_(m)
        base = blocked(math.inf)                                      # the CVaR limit alone
        gated = entering & (std > theta) & ~base
        assert torch.equal(blocked(theta), base | gated)
    # at m < 1 the entries θ / m would have let through are blocked
    assert (gated & (std <= theta / 0.25)).sum() > 10


def test_open_trade_in_chosen_direction_is_held_without_resizing():
    ag = make()
    B = 200
    emb, port = torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio)
    pos = torch.full((B,), 0.37, dtype=torch.float64)
    a = _act(ag, emb, port, pos, PolicyControls.make("cpu", epsilon=1.0), bars=torch.full((B,), 100))
    long_ = a.branches[:, 0] == 2
    assert long_.any() and torch.all(a.target[long_] == 0.37)
    assert torch.all(a.target[a.branches[:, 0] == 1] == 0)


def test_commitment_holds_young_trades_when_mature():
    ag = make()
    ag.maturity.fill_(1.0)
    B = 100
    pos = torch.full((B,), -0.5, dtype=torch.float64)
    a = _act(ag, torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio), pos, PolicyControls.make("cpu", epsilon=1.0),
             bars=torch.ones(B, dtype=torch.long))  # 1 bar < min_hold: no exit
    assert torch.all(a.target == -0.5) and torch.all(a.branches[:, 0] == 0)


def test_commitment_comes_before_the_entry_block():
    """A young trade asked to flip into an entry the protection stack would block is held: the direction reported
    (and learned) is its own side, and no block is reported — the account never left the trade."""
    ag = make()
    ag.maturity.fill_(1.0)
    B = 300
    pos = torch.full((B,), -0.5, dtype=torch.float64)
    no_entries = PolicyControls.make("cpu", epsilon=1.0, regime_confidence=[0.0] * 9)   # every entry would block
    a = _act(ag, torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio), pos, no_entries,
             bars=torch.ones(B, dtype=torch.long))
    assert torch.all(a.target == -0.5) and torch.all(a.branches[:, 0] == 0) and not a.blocked.any()
    old = _act(ag, torch.randn(B, 16), torch.zeros(B, CFG.n_portfolio), pos, no_entries,
               bars=torch.full((B,), 1000))                                            # mature trades: flips block
    assert old.blocked.any() and torch.all(old.branches[old.blocked, 0] == 1)


def test_attention_matches_pytorch_sdpa_and_last_token_matches_the_block():
    """The written-out attention (what compiled no-gradient passes run) equals `F.scaled_dot_product_attention`
    (causal), the last-query form equals its last row, and `CausalBlock.last_token` equals the block's last row."""
    from shared.agent import (CausalBlock, causal_attention, causal_attention_math, last_query_attention,
                              last_query_attention_math)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, 12, 8, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for causal, last in ((causal_attention, last_query_attention),
                         (causal_attention_math, last_query_attention_math)):
        assert torch.allclose(causal(q, k, v), ref, atol=1e-5)
        assert torch.allclose(last(q[:, :, -1], k, v), ref[:, :, -1], atol=1e-5)
    torch.manual_seed(0)
    blk = CausalBlock(32, 4)
    x = torch.randn(6, 12, 32, generator=g)
    assert torch.allclose(blk.last_token(x), blk(x)[:, -1], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_heads_with_aligned_widths_equal_the_cpu_heads(no_tf32):
    """On CUDA the heads' output widths are padded to 16-byte rows (`aligned_linear`, the fused head matmul); the
    outputs must be the CPU's: logits, V_e, δ, the IQN quantiles and their gradients, in fp32 without TF32."""
    torch.manual_seed(0)
    cfg = AgentConfig(n_features=5, window=8, d_model=16, n_heads=2, hidden=40, ensemble=3, n_atoms=51)
    cpu = Agent(cfg)
    for p in cpu.parameters():                      # the shift starts at 0: give every weight a value
        torch.nn.init.normal_(p, std=0.1)
    gpu = Agent(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    win, port, taus = torch.randn(33, 8, 5), torch.randn(33, cfg.n_portfolio), torch.rand(33, 7)
    outs = []
    for net, dev in ((cpu, "cpu"), (gpu, "cuda")):
        emb = net.encode(win.to(dev))                # 5 features: the input projection is padded too
        o = net.head(emb, port.to(dev))
        q = net.quantiles(o.hidden, taus.to(dev))
        loss = sum(x.float().square().sum() for x in (o.logits, o.value_e, o.delta, q))
        grads = torch.autograd.grad(loss, [net.adv_w[0], net.shift[2].weight, net.iqn_out[2].weight,
                                           net.enc_in.weight])
        outs.append([x.detach().cpu() for x in (emb, o.logits, o.value_e, o.delta, q, *grads)])
    for a, b in zip(*outs):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
