"""The pure-PyTorch reference DeepNestedOptimizer (titanmac_c.testing.reference_dno) against the
spec (docs/deep_nested_optimizer.md) itself: groups and depths, the controller, the AdamW step
by hand, the NaN skips, controller_update_freq, the return dicts, the checkpoint layout and
bitwise resume, CMS mode with both momentum networks, and the loss going down.

Section numbers (§N) and bug ids (B1-B11, its section 14) refer to that document."""

import copy
import inspect
import io
import math

import pytest
import torch
import torch.nn as nn

from conftest import DEVICES
from dno_models import loss_fn, make_mlp_10_32_5, make_titanmac_like_model, synthetic_batches
from titanmac_c.testing import reference_dno as ref
from titanmac_c.testing.reference_dno import (ContinuumMemoryState, DeepNestedOptimizer,
                                              DirectUpdateMLP, L2RegressionMomentum,
                                              NestedController, ReferenceDeepNestedOptimizer,
                                              SimplifiedMetaTrainer)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def train(opt, model, batches, on_step=None):
    """zero_grad -> forward -> backward -> step(loss.item()) for every batch; returns results."""
    results = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        results.append(opt.step(loss_value=loss.item()))
        if on_step is not None:
            on_step(opt)
    return results


def checkpoint(model, opt):
    """torch.save / torch.load round trip of model and optimizer state, as a user does it."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"max abs diff {(a.double() - b.double()).abs().max().item()}"


def assert_same_run(opt_a, opt_b, model_a, model_b):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert_bitwise(pa.detach(), pb.detach())
    for pa, pb in zip(opt_a.controller.parameters(), opt_b.controller.parameters()):
        assert_bitwise(pa.detach(), pb.detach())
    for pa, pb in zip(opt_a.momentum_mlp.parameters(), opt_b.momentum_mlp.parameters()):
        assert_bitwise(pa.detach(), pb.detach())
    assert_bitwise(opt_a.get_lr_multipliers(), opt_b.get_lr_multipliers())
    assert_bitwise(opt_a.ema_loss, opt_b.ema_loss)
    assert opt_a.global_step == opt_b.global_step
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.base_optimizer.state.get(pa, {}), opt_b.base_optimizer.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            assert_bitwise(sa[key], sb[key])
        for la, lb in zip(opt_a.state[pa].levels, opt_b.state[pb].levels):
            assert la.step_count == lb.step_count
            for key in ("momentum", "accumulated_grad", "ema_grad", "v_sq"):
                assert_bitwise(getattr(la, key), getattr(lb, key))


def n_params(module):
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# §2.1 constructor
# ---------------------------------------------------------------------------------------------
def test_constructor_signature_and_mode():
    expected = [
        ("model", inspect.Parameter.empty), ("base_lr", 1e-3), ("meta_lr", 1e-4),
        ("k_unroll", 5), ("cms_frequencies", None), ("momentum_hidden_dim", 64),
        ("momentum_num_layers", 2), ("controller_hidden_dim", 32), ("controller_num_layers", 2),
        ("use_gradient_checkpointing", True), ("mode", "simple"), ("meta_update_freq", 100),
        ("weight_decay", 0.0), ("max_grad_norm", 1.0), ("low_memory", False),
        ("use_cms_updates", False), ("use_preprocessing", True), ("use_compile", False),
        ("controller_update_freq", 1), ("use_cuda_graph", False), ("cuda_graph_warmup_steps", 3),
    ]
    params = list(inspect.signature(ReferenceDeepNestedOptimizer.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == expected
    assert DeepNestedOptimizer is ReferenceDeepNestedOptimizer

    model = make_mlp_10_32_5()
    with pytest.raises(ValueError):
        DeepNestedOptimizer(model, mode="implicit")
    opt = DeepNestedOptimizer(model)
    assert opt.base_lr == 1e-3 and opt.mode == "simple" and opt.n_groups == 2
    assert opt.global_step == 0 and opt.last_meta_loss is None and opt.controller_grad_norm == 0.0
    assert_bitwise(opt.get_lr_multipliers(), torch.ones(2))
    assert_bitwise(opt.ema_loss, torch.zeros(2))
    assert opt.cms_frequencies == [1, 10, 100]
    assert isinstance(opt.momentum_mlp, DirectUpdateMLP) and opt.mlp_optimizer is not None
    assert DeepNestedOptimizer(model, low_memory=True).cms_frequencies == [1]
    legacy = DeepNestedOptimizer(model, use_preprocessing=False)
    assert isinstance(legacy.momentum_mlp, L2RegressionMomentum) and legacy.mlp_optimizer is None
    # AdamW defaults (§2.1) and CMS state for every grouped tensor in every mode (B11)
    for group in opt.base_optimizer.param_groups:
        assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
        assert group["weight_decay"] == 0.0 and not group["amsgrad"]
    assert len(opt.state) == 4
    assert all(len(st.levels) == 3 for st in opt.state.values())
    # meta optimizer: momentum-MLP params, then controller params
    meta = opt.meta_optimizer.param_groups[0]["params"]
    expected_meta = list(opt.momentum_mlp.parameters()) + list(opt.controller.parameters())
    assert len(meta) == len(expected_meta) and all(a is b for a, b in zip(meta, expected_meta))
    assert opt.meta_optimizer.param_groups[0]["lr"] == 1e-4
    assert opt.mlp_optimizer.param_groups[0]["lr"] == 1e-3


# ---------------------------------------------------------------------------------------------
# §2.2 groups, §2.3 depths
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def titanmac_opt():
    model = make_titanmac_like_model(seed=0)
    return model, DeepNestedOptimizer(model, weight_decay=0.01)


def test_groups_titanmac_like(titanmac_opt):
    model, opt = titanmac_opt
    named = list(model.named_parameters())
    assert len(named) == 48 and sum(p.numel() for _, p in named) == 3_237_888
    core, embed = opt.param_groups
    assert core["name"] == "core" and embed["name"] == "embed"
    assert len(core["params"]) == 19 and sum(p.numel() for p in core["params"]) == 3_218_176
    assert len(embed["params"]) == 29 and sum(p.numel() for p in embed["params"]) == 19_712
    names = {id(p): n for n, p in named}
    core_names = {names[id(p)] for p in core["params"]}
    assert {"embed_tokens.weight", "embed_positions.weight", "persistent_tokens"} <= core_names
    embed_names = {names[id(p)] for p in embed["params"]}
    assert {"norm.scale", "layers.0.attn.q_conv.weight", "layers.3.attn.gate_proj.weight",
            "layers.3.attn.gate_proj.bias"} <= embed_names
    # depths [0.5526, 0.6207] = [10.5/19, 18/29]
    torch.testing.assert_close(opt.group_depths, torch.tensor([10.5 / 19, 18 / 29]))
    assert ref.infer_param_depth("norm.scale", 4) == 0.5
    assert ref.infer_param_depth("embed_tokens.weight", 4) == 0.0
    assert ref.infer_param_depth("persistent_tokens", 4) == 0.5
    assert ref.infer_param_depth("layers.3.mlp.up_proj.weight", 4) == 1.0


def test_titanmac_like_controller_saturates(titanmac_opt):
    """B6: raw parameter norms (~36 and ~48 here) saturate the sigmoid; mu pins at 2.0
    (with this init)."""
    model, opt = titanmac_opt
    stats = opt._compute_group_stats()
    assert (stats[:, 1] > 30).all()                     # raw group parameter norms (36, 48)
    assert stats[0, 0].item() == 0.0                    # no gradients yet
    with torch.no_grad():
        mult = opt.controller(stats)
    assert (mult > 1.99).all() and (mult <= 2.0).all()


def test_groups_mlp():
    model = make_mlp_10_32_5()
    opt = DeepNestedOptimizer(model)
    core, embed = opt.param_groups
    assert [p.shape for p in core["params"]] == [(32, 10), (5, 32)]
    assert [p.shape for p in embed["params"]] == [(32,), (5,)]
    assert_bitwise(opt.group_depths, torch.tensor([0.5, 0.5]))


def test_group_rule_edge_cases():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.token_embedding = nn.Parameter(torch.zeros(4, 4))      # embed (name)
            self.LayerNorm_w = nn.Parameter(torch.zeros(4, 4))          # embed (lower 'norm')
            self.router = nn.Parameter(torch.zeros(4, 4))               # embed
            self.Gate = nn.Parameter(torch.zeros(4, 4))       # core: 'gate' is case-sensitive
            self.conv = nn.Parameter(torch.zeros(4, 1, 3))              # embed (3-D)
            self.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)  # skipped
            self.w = nn.Parameter(torch.zeros(4, 4))                    # core
            self.transformer_blocks = nn.ModuleList([nn.Identity()] * 3)
            self.layers = nn.ModuleList([nn.Identity()] * 7)

    model = Model()
    groups, names = ref.group_moe_params(model)
    assert names == [["Gate", "w"], ["token_embedding", "LayerNorm_w", "router", "conv"]]
    assert ref._model_n_layers(model) == 3            # transformer_blocks before layers
    model.config = type("C", (), {"n_layers": 6})()
    assert ref._model_n_layers(model) == 6            # config.n_layers first
    assert ref._model_n_layers(nn.Linear(2, 2)) == 1
    depth = ref.infer_param_depth
    assert depth("lm_head.weight", 4) == 1.0 and depth("norm.weight", 4) == 1.0
    assert depth("final_norm.weight", 4) == 0.5
    assert depth("blocks.1.w", 4) == 0.5 and depth("layer.2.w", 2) == 1.5   # no cap
    # an empty embed group is kept, with depth 0.5
    lin = nn.Sequential(nn.Linear(3, 3, bias=False))
    opt = DeepNestedOptimizer(lin)
    assert opt.param_groups[1]["params"] == [] and opt.group_depths[1].item() == 0.5


# ---------------------------------------------------------------------------------------------
# §4 controller, §7.3 momentum networks
# ---------------------------------------------------------------------------------------------
def test_controller_architecture_and_init():
    c2 = NestedController(32, 2)
    assert n_params(c2) == 1217
    assert n_params(NestedController(32, 5)) == 4385
    assert {k: tuple(v.shape) for k, v in c2.state_dict().items()} == {
        "net.0.weight": (32, 3), "net.0.bias": (32,), "net.2.weight": (32, 32),
        "net.2.bias": (32,), "net.4.weight": (1, 32), "net.4.bias": (1,)}
    assert list(NestedController(32, 5).state_dict())[-2:] == ["net.10.weight", "net.10.bias"]
    for module in c2.net:
        if isinstance(module, nn.Linear):
            bound = math.sqrt(6.0 / (module.in_features + module.out_features))   # Xavier, gain 1
            assert module.weight.abs().max() <= bound
            assert module.weight.abs().max() > 0.5 * bound
            assert torch.count_nonzero(module.bias) == 0
    assert isinstance(c2.net[1], nn.ReLU)


def test_controller_bounds_and_nan():
    ctrl = NestedController(32, 2)
    for scale in (1e-3, 1.0, 1e3, 1e6):
        stats = torch.randn(2, 3) * scale
        for s in (stats, -stats):
            mult = ctrl(s)
            assert mult.shape == (2,) and (mult >= 0.1).all() and (mult <= 2.0).all()
    # r = 0 -> mu = 0.1 + 1.9 * 0.5 = 1.05
    with torch.no_grad():
        ctrl.net[-1].weight.zero_()
        ctrl.net[-1].bias.zero_()
    torch.testing.assert_close(ctrl(torch.randn(2, 3)), torch.full((2,), 1.05))
    # any non-finite input -> all multipliers 1.0
    ctrl = NestedController(32, 2)
    stats = torch.rand(2, 3)
    stats[1, 0] = float("nan")
    assert_bitwise(ctrl(stats), torch.ones(2))
    stats[1, 0] = float("inf")
    assert_bitwise(ctrl(stats), torch.ones(2))


def test_momentum_networks():
    mlp = DirectUpdateMLP(20, 2)
    assert n_params(mlp) == 541
    assert list(mlp.state_dict()) == ["net.0.weight", "net.0.bias", "net.2.weight",
                                      "net.2.bias", "net.4.weight", "net.4.bias"]
    out_w = mlp.net[4].weight.detach()
    expected = torch.zeros(1, 20)
    expected[0, 1] = 0.1                                       # B4: hidden unit 1, not sign_g
    assert_bitwise(out_w, expected)
    assert torch.count_nonzero(mlp.net[4].bias) == 0
    assert isinstance(mlp.net[1], nn.SiLU)
    assert list(DirectUpdateMLP(20, 4).state_dict())[-2:] == ["net.8.weight", "net.8.bias"]
    g = torch.randn(7, 3)
    assert mlp(g, torch.zeros_like(g)).shape == (7, 3)

    legacy = L2RegressionMomentum(64, 2)
    assert n_params(legacy) == 4996
    assert {k: tuple(v.shape) for k, v in legacy.state_dict().items()} == {
        "residual_weight": (), "net.0.weight": (64, 9), "net.0.bias": (64,),
        "net.2.weight": (64, 64), "net.2.bias": (64,), "net.4.weight": (3, 64),
        "net.4.bias": (3,)}
    assert list(legacy.state_dict())[0] == "residual_weight"
    a, b, d = legacy(torch.randn(5, 4), torch.randn(5, 4), torch.tensor([0.001, 1e-3, 0.7]))
    assert a.shape == () and b.shape == () and d.shape == ()
    torch.testing.assert_close(torch.stack([a, b, d]).detach(),
                               torch.tensor([0.5 + 0.49 * torch.sigmoid(torch.tensor(1.5)).item(),
                                             math.tanh(3.0), 1 / (1 + math.exp(5.0))]))
    assert abs(a.item() - 0.9006) < 1e-4 and abs(b.item() - 0.9951) < 1e-4
    assert abs(d.item() - 0.0067) < 1e-4


def test_preprocess_gradient():
    x = torch.tensor([0.0, 1e-6, -1e-6, 0.5, -2.0, math.exp(-10) * 1.0001])
    log_f, sign_f = ref.preprocess_gradient(x)
    assert log_f[0].item() == -1.0 and sign_f[0].item() == 0.0
    torch.testing.assert_close(sign_f[1:3], x[1:3] * math.exp(10))
    assert (log_f[1:3] == -1).all()
    torch.testing.assert_close(log_f[3:], torch.log(x[3:].abs()) / 10)
    assert_bitwise(sign_f[3:], torch.sign(x[3:]))


# ---------------------------------------------------------------------------------------------
# §7.1 CMS state, §8 clip, §9.1 meta trainer
# ---------------------------------------------------------------------------------------------
def test_cms_state_schedule_and_accumulate():
    st = ContinuumMemoryState((3,), [1, 10, 100])
    assert [lvl.frequency for lvl in st.levels] == [1, 10, 100]
    assert [st.should_update(0, t) for t in (0, 1, 99)] == [True] * 3
    assert [st.should_update(1, t) for t in (0, 10, 20, 5)] == [True, True, True, False]
    assert [st.should_update(2, t) for t in (0, 100, 50)] == [True, True, False]
    st.accumulate(torch.ones(3))
    st.accumulate(2 * torch.ones(3))
    for lvl in st.levels:
        assert_bitwise(lvl.accumulated_grad, torch.full((3,), 3.0))
    assert [lvl.ema_decay for lvl in st.levels] == [0.99, 0.99 ** 0.1, 0.99 ** 0.01]
    assert all(lvl.momentum.dtype == torch.float32 for lvl in st.levels)
    # B7: only element [1] sets the schedule
    assert [lvl.frequency for lvl in ContinuumMemoryState((1,), [1, 5, 50]).levels] == [1, 5, 25]
    assert [lvl.frequency for lvl in ContinuumMemoryState((1,), [1]).levels] == [1]


def test_fused_clip():
    assert_bitwise(ref._fused_clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0),
                   torch.tensor(0.0))
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    ps[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ps[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = ref._fused_clip_grad_norm_(ps, 1.0)
    assert norm.item() == pytest.approx(5.0)                     # pre-clip norm
    torch.testing.assert_close(ps[0].grad, torch.tensor([3.0, 0, 0]) / (5.0 + 1e-6))
    before = [p.grad.clone() for p in ps]
    ref._fused_clip_grad_norm_(ps, 10.0, inplace=False)         # kappa capped at 1
    for p, b in zip(ps, before):
        assert_bitwise(p.grad, b)
    assert ref._fused_clip_grad_norm_(ps, 10.0, norm_type=math.inf).item() == pytest.approx(
        4.0 / (5.0 + 1e-6))


def test_simplified_meta_trainer():
    mt = SimplifiedMetaTrainer(window_size=12)
    mu = torch.tensor([1.2, 0.7], requires_grad=True)
    torch.testing.assert_close(mt.compute_proxy_loss(mu), torch.tensor((0.04 + 0.09) / 2))
    for i in range(15):
        mt.record_step(10.0 - i, torch.tensor([1.5, 0.5]), 0.0)
    assert len(mt.loss_history) == 12 and mt.loss_history[0] == 7.0       # FIFO window
    # improving: pull toward the last recorded multipliers
    torch.testing.assert_close(mt.compute_proxy_loss(mu), torch.tensor((0.09 + 0.04) / 2))
    # stagnating: mean((mu-1)^2) - 0.1 mean|mu-1|
    mt.record_step(100.0, torch.tensor([1.0, 1.0]), 0.0)
    torch.testing.assert_close(mt.compute_proxy_loss(mu),
                               torch.tensor((0.04 + 0.09) / 2 - 0.1 * (0.2 + 0.3) / 2))
    assert set(mt.get_statistics()) == {"loss_improvement", "loss_std", "avg_momentum_norm"}


# ---------------------------------------------------------------------------------------------
# §6 one AdamW-mode step by hand (stats, controller, clip, decay, AdamW formulas)
# ---------------------------------------------------------------------------------------------
def _controller_by_hand(ctrl, stats):
    h = stats
    linears = [m for m in ctrl.net if isinstance(m, nn.Linear)]
    for i, lin in enumerate(linears):
        h = h @ lin.weight.detach().double().T + lin.bias.detach().double()
        if i < len(linears) - 1:
            h = torch.relu(h)
    return 0.1 + 1.9 * torch.sigmoid(h.squeeze(-1))


def test_adamw_steps_by_hand():
    base_lr, wd, max_norm = 1e-2, 0.1, 0.5
    model = make_mlp_10_32_5()
    opt = DeepNestedOptimizer(model, base_lr=base_lr, weight_decay=wd, max_grad_norm=max_norm)
    twin = make_mlp_10_32_5()                                  # torch.optim.AdamW twin
    twin_opt = torch.optim.AdamW([{"params": [twin[0].weight, twin[2].weight]},
                                  {"params": [twin[0].bias, twin[2].bias]}], weight_decay=wd)
    groups = [[0, 2], [1, 3]]                                  # tensor indices per group
    p_hand = [p.detach().double().clone() for p in model.parameters()]
    m_hand = [torch.zeros_like(p) for p in p_hand]
    v_hand = [torch.zeros_like(p) for p in p_hand]
    gen = torch.Generator().manual_seed(7)
    for k in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen) * 3.0 for p in model.parameters()]
        for p, q, g in zip(model.parameters(), twin.parameters(), grads):
            p.grad = g.clone()
            q.grad = g.clone()
        # by hand: stats on unclipped grads, controller, clip, decay, AdamW
        gd = [g.double() for g in grads]
        stats = torch.tensor([[math.sqrt(sum((gd[i] ** 2).sum().item() for i in idx)),
                               math.sqrt(sum((p_hand[i] ** 2).sum().item() for i in idx)),
                               0.5] for idx in groups], dtype=torch.float64)
        mu = _controller_by_hand(opt.controller, stats)
        total = math.sqrt(sum((g ** 2).sum().item() for g in gd))
        kappa = min(max_norm / (total + 1e-6), 1.0)
        assert kappa < 1.0                                      # clipping is active
        for gi, idx in enumerate(groups):
            lr = base_lr * mu[gi].item()
            for i in idx:
                g = gd[i] * kappa
                p_hand[i] = p_hand[i] * (1 - lr * wd)
                m_hand[i] = 0.9 * m_hand[i] + 0.1 * g
                v_hand[i] = 0.999 * v_hand[i] + 0.001 * g * g
                denom = v_hand[i].sqrt() / math.sqrt(1 - 0.999 ** k) + 1e-8
                p_hand[i] = p_hand[i] - lr * (m_hand[i] / (1 - 0.9 ** k)) / denom
        result = opt.step(loss_value=1.0)
        torch.testing.assert_close(result["lr_multipliers"].double(), mu, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(opt.get_effective_lrs(), dtype=torch.float64),
                                   base_lr * mu, rtol=1e-6, atol=0)
        for p, ph in zip(model.parameters(), p_hand):
            torch.testing.assert_close(p.detach().double(), ph, rtol=1e-5, atol=1e-7)
        # and exactly torch.optim.AdamW with lr = base_lr * mu after torch's global clip
        torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
        for gi, m in enumerate(result["lr_multipliers"].tolist()):
            twin_opt.param_groups[gi]["lr"] = base_lr * m
        twin_opt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_bitwise(p.detach(), q.detach())
    assert all(int(s["step"]) == 3 for s in opt.base_optimizer.state.values())


# ---------------------------------------------------------------------------------------------
# §5 NaN skips, controller_update_freq, return dicts, set_loss
# ---------------------------------------------------------------------------------------------
def _mlp_opt(**kwargs):
    model = make_mlp_10_32_5()
    return model, DeepNestedOptimizer(model, **kwargs)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [int(s["step"]) for s in opt.base_optimizer.state.values()],
            opt.get_lr_multipliers(), opt.ema_loss.clone())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_loss_skip(bad):
    model, opt = _mlp_opt(base_lr=1e-2)
    batches = synthetic_batches("mlp", 3, seed=1)
    train(opt, model, batches[:2])
    params, steps, mult, ema = _snapshot(model, opt)
    loss_fn(model, batches[2]).backward()
    result = opt.step(loss_value=bad)
    assert result == {"global_step": 3, "lr_multipliers": mult.tolist(), "skipped": True,
                      "reason": "nan_loss"}
    assert opt.global_step == 3
    assert all(p.grad is None for p in model.parameters())
    p2, s2, m2, e2 = _snapshot(model, opt)
    assert s2 == steps == [2, 2, 2, 2]
    for a, b in zip(params, p2):
        assert_bitwise(a, b)
    assert_bitwise(m2, mult)
    assert_bitwise(e2, ema)


def test_nan_gradient_skip():
    model, opt = _mlp_opt(base_lr=1e-2)
    batches = synthetic_batches("mlp", 4, seed=1)
    train(opt, model, batches[:2])
    params, steps, mult, ema = _snapshot(model, opt)
    loss_fn(model, batches[2]).backward()
    model[0].bias.grad[3] = float("nan")
    result = opt.step(loss_value=0.5)
    assert result["skipped"] is True and result["reason"] == "nan_gradient"
    assert set(result) == {"global_step", "lr_multipliers", "skipped", "reason"}
    assert isinstance(result["lr_multipliers"], list) and len(result["lr_multipliers"]) == 2
    assert all(p.grad is None for p in model.parameters())
    p2, s2, _, e2 = _snapshot(model, opt)
    assert s2 == steps == [2, 2, 2, 2]                        # AdamW's step did not advance
    for a, b in zip(params, p2):
        assert_bitwise(a, b)
    torch.testing.assert_close(e2, 0.9 * ema + 0.1 * 0.5)    # the EMA had already moved
    train(opt, model, batches[3:])
    assert [int(s["step"]) for s in opt.base_optimizer.state.values()] == [3, 3, 3, 3]


def test_controller_update_freq_reuses_stale_multipliers():
    model, opt = _mlp_opt(base_lr=1e-2, controller_update_freq=3)
    calls = []
    stats_fn = opt._compute_group_stats
    opt._compute_group_stats = lambda: (calls.append(opt.global_step), stats_fn())[1]
    results = train(opt, model, synthetic_batches("mlp", 7, seed=2))
    assert calls == [1, 3, 6]
    mult = [r["lr_multipliers"] for r in results]
    assert_bitwise(mult[1], mult[0])
    assert_bitwise(mult[3], mult[2])
    assert_bitwise(mult[4], mult[2])
    assert_bitwise(mult[6], mult[5])
    assert not torch.equal(mult[2], mult[0])                  # the controller did run again


def test_step_return_dicts_and_set_loss():
    model, opt = _mlp_opt()
    batch = synthetic_batches("mlp", 1)[0]
    loss_fn(model, batch).backward()
    opt.set_loss(2.0)
    result = opt.step()
    assert set(result) == {"global_step", "lr_multipliers", "ema_loss"}
    assert result["global_step"] == 1
    assert result["lr_multipliers"].shape == (2,) and result["ema_loss"].shape == (2,)
    assert_bitwise(result["ema_loss"], torch.full((2,), 2.0))   # t = 1: ema = L
    assert result["lr_multipliers"] is not opt._lr_multipliers  # a clone
    loss_fn(model, batch).backward()
    with pytest.warns(UserWarning):
        result = opt.step()                                     # stored loss was cleared -> 0.0
    torch.testing.assert_close(result["ema_loss"], torch.full((2,), 0.9 * 2.0))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    # CMS mode: surrogate_loss appears at t = 5 and stays, stale
    model, opt = _mlp_opt(use_cms_updates=True)
    results = train(opt, model, synthetic_batches("mlp", 6))
    assert all("surrogate_loss" not in r for r in results[:4])
    assert set(results[4]) == {"global_step", "lr_multipliers", "ema_loss", "surrogate_loss"}
    assert results[5]["surrogate_loss"] is results[4]["surrogate_loss"]


# ---------------------------------------------------------------------------------------------
# §9 meta-learning
# ---------------------------------------------------------------------------------------------
def test_simple_mode_meta_update_schedule():
    model, opt = _mlp_opt(base_lr=1e-2, meta_update_freq=4)
    before = [p.detach().clone() for p in opt.controller.parameters()]
    losses = []
    for batch in synthetic_batches("mlp", 9):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        opt.step(loss.item())
    assert opt.meta_trainer.loss_history == [losses[3], losses[7]]     # at t = 4 and t = 8
    assert torch.is_tensor(opt.last_meta_loss) and opt.last_meta_loss.ndim == 0
    assert torch.is_tensor(opt.controller_grad_norm)
    assert any(not torch.equal(a, b) for a, b in zip(before, opt.controller.parameters()))
    # the momentum MLP is never meta-trained in AdamW mode (B2), and its CMS state is untouched
    assert all(p.grad is None for p in opt.momentum_mlp.parameters())
    assert all(torch.count_nonzero(lvl.momentum) == 0
               for st in opt.state.values() for lvl in st.levels)
    # a meta-update does not refresh the multipliers
    mult = opt.get_lr_multipliers()
    opt._update_meta_components(1.0)
    assert_bitwise(opt.get_lr_multipliers(), mult)


def test_explicit_meta_update():
    model, opt = _mlp_opt(base_lr=1e-2, mode="explicit", meta_update_freq=2)
    batches = synthetic_batches("mlp", 5)
    train(opt, model, batches[:4])
    assert opt.meta_trainer.loss_history == []                  # explicit: no automatic update
    seen = []
    stats_fn = opt._compute_group_stats
    opt._compute_group_stats = lambda: (seen.append(stats_fn()), seen[-1])[1]
    mult = opt.get_lr_multipliers()
    for _ in range(2):
        loss_fn(model, batches[4]).backward()                   # grads are cleared by meta_update
        opt.meta_update(batches[4], loss_fn=loss_fn, use_unrolled=False)
    assert len(opt.meta_trainer.loss_history) == 2
    assert opt.meta_trainer.loss_history[0] == pytest.approx(loss_fn(model, batches[4]).item(),
                                                             rel=1e-2)
    assert all(p.grad is None for p in model.parameters())
    assert seen[0][0, 0].item() == 0.0 and seen[0][1, 0].item() == 0.0   # B5
    assert_bitwise(opt.get_lr_multipliers(), mult)              # mu unchanged by meta-updates
    with pytest.raises(NotImplementedError):                    # B3
        opt.meta_update(batches[0], train_batches=batches, loss_fn=loss_fn, use_unrolled=True)


def test_meta_update_default_loss_fn_truncates_to_4_rows(titanmac_opt):
    model, opt = titanmac_opt
    batch = synthetic_batches("titanmac", 1, seed=3, batch_size=6, seq_len=8)[0]
    expected = model({k: v[:4] for k, v in batch.items()})["loss"].item()
    opt.meta_update(batch, use_unrolled=False)
    assert opt.meta_trainer.loss_history[-1] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# Appendix A checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preprocessing", [True, False])
def test_state_dict_layout(preprocessing):
    model, opt = _mlp_opt(use_preprocessing=preprocessing, use_cms_updates=True,
                          cms_frequencies=[1, 5, 50])
    train(opt, model, synthetic_batches("mlp", 6))
    sd = opt.state_dict()
    keys = ["base_optimizer", "momentum_mlp", "controller", "meta_optimizer", "global_step",
            "lr_multipliers", "ema_loss", "cms_state"]
    keys += ["mlp_optimizer"] if preprocessing else []
    assert list(sd) == keys
    assert [g["name"] for g in sd["base_optimizer"]["param_groups"]] == ["core", "embed"]
    assert sd["base_optimizer"]["state"] == {}                  # CMS mode never steps AdamW
    assert list(sd["controller"]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias",
                                      "net.4.weight", "net.4.bias"]
    first = "net.0.weight" if preprocessing else "residual_weight"
    assert list(sd["momentum_mlp"])[0] == first
    n_meta = len(list(opt.momentum_mlp.parameters())) + 6
    assert sd["meta_optimizer"]["param_groups"][0]["params"] == list(range(n_meta))
    assert sd["global_step"] == 6 and isinstance(sd["global_step"], int)
    assert sd["lr_multipliers"].shape == (2,) and sd["ema_loss"].shape == (2,)
    cms = sd["cms_state"]
    assert list(cms) == [0, 1, 2, 3]                            # group order: weights, biases
    assert cms[1][0]["momentum"].shape == (5, 32) and cms[2][0]["momentum"].shape == (32,)
    for entry in cms.values():
        assert list(entry) == [0, 1, 2]
        for level in entry.values():
            assert list(level) == ["momentum", "step_count", "accumulated_grad", "ema_grad", "v_sq"]
            assert isinstance(level["step_count"], int)
        assert [entry[lvl]["step_count"] for lvl in range(3)] == [6, 1, 0]
    if preprocessing:
        assert len(sd["mlp_optimizer"]["param_groups"][0]["params"]) == 6


def test_load_state_dict_cpu_defaults():
    """B10: missing lr_multipliers / ema_loss come back as CPU ones(2) / zeros(2)."""
    model, opt = _mlp_opt()
    sd = opt.state_dict()
    del sd["lr_multipliers"], sd["ema_loss"]
    for level in sd["cms_state"][0].values():
        del level["ema_grad"], level["v_sq"]
    opt2 = DeepNestedOptimizer(make_mlp_10_32_5())
    opt2.load_state_dict(sd)
    assert opt2._lr_multipliers.device.type == "cpu" and opt2.ema_loss.device.type == "cpu"
    assert_bitwise(opt2._lr_multipliers, torch.ones(2))
    assert_bitwise(opt2.ema_loss, torch.zeros(2))
    assert_bitwise(list(opt2.state.values())[0].levels[0].v_sq, torch.zeros(32, 10))


def _resume_pair(kind_kwargs, n_before, n_after, seed=5, before_resume=None):
    """Run A for n_before + n_after steps; run B = a fresh model/optimizer loaded from A's
    checkpoint after n_before steps, for n_after steps on the same batches."""
    batches = synthetic_batches("mlp", n_before + n_after, seed=seed)
    model_a = make_mlp_10_32_5(seed=1)
    opt_a = DeepNestedOptimizer(model_a, **kind_kwargs)
    train(opt_a, model_a, batches[:n_before])
    ckpt = checkpoint(model_a, opt_a)
    if before_resume is not None:
        before_resume(opt_a)
    model_b = make_mlp_10_32_5(seed=99)
    model_b.load_state_dict(ckpt["model"])
    opt_b = DeepNestedOptimizer(model_b, **kind_kwargs)
    opt_b.load_state_dict(ckpt["opt"])
    assert_same_run(opt_a, opt_b, model_a, model_b)
    ra = train(opt_a, model_a, batches[n_before:])
    rb = train(opt_b, model_b, batches[n_before:])
    assert_same_run(opt_a, opt_b, model_a, model_b)
    for x, y in zip(ra, rb):
        assert_bitwise(x["lr_multipliers"], y["lr_multipliers"])
    return opt_a, opt_b


def test_state_dict_resume_bitwise_adamw():
    # meta-updates at t = 4, 8, 12: before and after the resume (histories stay < 10 entries,
    # so the unsaved history does not change the proxy loss)
    _resume_pair(dict(base_lr=1e-2, weight_decay=0.01, meta_update_freq=4,
                      controller_update_freq=2), n_before=6, n_after=8)


@pytest.mark.parametrize("freqs", [[1, 10, 100], [1, 5, 50]])
def test_state_dict_resume_bitwise_cms_legacy(freqs):
    _resume_pair(dict(base_lr=1e-2, weight_decay=0.01, use_cms_updates=True,
                      use_preprocessing=False, cms_frequencies=freqs, meta_update_freq=10),
                 n_before=12, n_after=18)


@pytest.mark.slow
@pytest.mark.parametrize("freqs", [[1, 10, 100], [1, 5, 50]])
def test_state_dict_resume_bitwise_cms_direct(freqs):
    """The surrogate output history is not saved (§12): the resumed run equals the uninterrupted
    run with that history cleared at the resume point, bitwise."""
    _resume_pair(dict(base_lr=1e-2, weight_decay=0.01, use_cms_updates=True,
                      cms_frequencies=freqs, meta_update_freq=10),
                 n_before=12, n_after=18,
                 before_resume=lambda opt: opt._mlp_output_history.clear())


# ---------------------------------------------------------------------------------------------
# §7 CMS mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preprocessing", [True, False])
@pytest.mark.parametrize("freqs,counts", [([1, 10, 100], [30, 3, 0]), ([1, 5, 50], [30, 6, 1])])
def test_cms_mode_30_steps(preprocessing, freqs, counts):
    model, opt = _mlp_opt(base_lr=1e-2, weight_decay=0.01, use_cms_updates=True,
                          use_preprocessing=preprocessing, cms_frequencies=freqs)
    initial = [p.detach().clone() for p in model.parameters()]
    results = train(opt, model, synthetic_batches("mlp", 30, seed=3))
    assert [r["global_step"] for r in results] == list(range(1, 31))
    assert opt.base_optimizer.state == {}                       # AdamW never stepped
    for p, p0 in zip(model.parameters(), initial):
        assert torch.isfinite(p).all() and not torch.equal(p.detach(), p0)
    for st in opt.state.values():
        assert [lvl.step_count for lvl in st.levels] == counts
        assert torch.count_nonzero(st.levels[0].ema_grad) > 0
        assert torch.count_nonzero(st.levels[0].accumulated_grad) == 0    # reset every step
    if preprocessing:
        assert "surrogate_loss" in results[-1] and len(opt._mlp_output_history) == 4


@pytest.mark.parametrize("preprocessing", [True, False])
def test_cms_first_step_by_hand(preprocessing):
    """t = 1: level 0 fires alone. g0 = g; e = 0.01 g; v = 0.001 g^2; then the momentum rule,
    the clamp, and p <- p - lr (c + wd p)."""
    lr, wd = 1e-2, 0.05
    model, opt = _mlp_opt(base_lr=lr, weight_decay=wd, use_cms_updates=True,
                          use_preprocessing=preprocessing, max_grad_norm=0.0)
    batch = synthetic_batches("mlp", 1)[0]
    loss = loss_fn(model, batch)
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    mlp = copy.deepcopy(opt.momentum_mlp)
    result = opt.step(loss.item())
    eta = [lr * m for m in result["lr_multipliers"].tolist()]
    context = torch.tensor([0.001, lr, math.log(max(loss.item(), 1e-8) + 1)])
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            i = [q is p for q in model.parameters()].index(True)
            g = p.grad
            lvl = opt.state[p].levels[0]
            with torch.no_grad():
                zero = torch.zeros_like(g)
                if preprocessing:
                    c = mlp(g, zero)
                    m = 0.9 * zero + 0.1 * c
                else:
                    a, b, d = mlp(g, zero, context)
                    m = a * zero + b * g
                    c = m * (1 - d)
                limit = 100 * max(g.norm().item(), 1e-8)
                if m.norm().item() > limit:
                    m = m * (limit / m.norm())
            torch.testing.assert_close(lvl.momentum, m)
            torch.testing.assert_close(lvl.ema_grad, 0.01 * g, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(lvl.v_sq, 0.001 * g * g, rtol=1e-5, atol=1e-12)
            for other in opt.state[p].levels[1:]:
                assert_bitwise(other.accumulated_grad, g)
                assert other.step_count == 0
            expected = before[i] - eta[gi] * (c + wd * before[i])
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_cms_level_divisor_b7():
    """[1, 5, 50]: level 2 fires every 25 steps but divides its 25-gradient sum by 50."""
    model, opt = _mlp_opt(base_lr=1e-3, use_cms_updates=True, use_preprocessing=False,
                          cms_frequencies=[1, 5, 50])
    sums = [torch.zeros_like(p) for p in model.parameters()]

    def collect(o):
        for s, p in zip(sums, model.parameters()):
            s.add_(p.grad)
    train(opt, model, synthetic_batches("mlp", 25, seed=4), on_step=collect)
    for p, s in zip(model.parameters(), sums):
        lvl = opt.state[p].levels[2]
        assert lvl.frequency == 25 and lvl.step_count == 1
        torch.testing.assert_close(lvl.ema_grad, (1 - 0.99 ** (1 / 25)) * s / 50,
                                   rtol=1e-4, atol=1e-10)


def test_cms_surrogate_sees_zero_gradients_b1(monkeypatch):
    targets = []
    original = ref.compute_surrogate_loss

    def spy(output, target, prev=None):
        targets.append(target.detach().clone())
        return original(output, target, prev)

    monkeypatch.setattr(ref, "compute_surrogate_loss", spy)
    model, opt = _mlp_opt(base_lr=1e-2, use_cms_updates=True)
    train(opt, model, synthetic_batches("mlp", 10))
    assert len(targets) == 8                                    # 4 tensors at t = 5 and t = 10
    assert all(torch.count_nonzero(t) == 0 for t in targets)


# ---------------------------------------------------------------------------------------------
# training works; devices
# ---------------------------------------------------------------------------------------------
def test_adamw_mode_loss_goes_down():
    model, opt = _mlp_opt(base_lr=1e-2, weight_decay=0.01, meta_update_freq=10)
    losses = []
    for batch in synthetic_batches("mlp", 100, seed=11):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        opt.step(loss.item())
    # window = meta_update_freq = 10: the meta-update at t = 100 is the first past the warmup
    assert len(opt.meta_trainer.loss_history) == 10
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.3 * first, (first, last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cms", [False, True])
def test_runs_on_device(device, cms):
    torch.manual_seed(0)
    model = make_mlp_10_32_5().to(device)
    opt = DeepNestedOptimizer(model, base_lr=1e-2, use_cms_updates=cms, meta_update_freq=5)
    assert opt.group_depths.device.type == device
    results = train(opt, model, synthetic_batches("mlp", 10, device=device))
    assert results[-1]["lr_multipliers"].device.type == device
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_deterministic_given_seed():
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        model = make_mlp_10_32_5()
        opt = DeepNestedOptimizer(model, base_lr=1e-2, use_cms_updates=True, meta_update_freq=5)
        train(opt, model, synthetic_batches("mlp", 10))
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("preprocessing", [True, False])
def test_cms_meta_proxy_past_warmup_has_no_mlp_gradient_b2(preprocessing):
    """CMS mode, 10 meta-updates: the last one computes a real MLP proxy loss Q (e0 is nonzero
    in CMS mode), but Q carries no gradient, so the momentum MLP gets none (B2)."""
    model, opt = _mlp_opt(base_lr=1e-3, use_cms_updates=True, use_preprocessing=preprocessing,
                          meta_update_freq=10)      # the history window is 10, too
    q_values = []
    proxy = opt._compute_mlp_proxy_loss
    opt._compute_mlp_proxy_loss = lambda loss: (q_values.append(proxy(loss)), q_values[-1])[1]
    mlp_before = [p.detach().clone() for p in opt.momentum_mlp.parameters()]
    train(opt, model, synthetic_batches("mlp", 100, seed=6))
    assert len(q_values) == 10
    assert all(q.item() == 0.0 and q.requires_grad for q in q_values[:9])    # warmup
    assert q_values[9].item() > 0.0 and not q_values[9].requires_grad
    assert all(p.grad is None for p in opt.momentum_mlp.parameters())
    if not preprocessing:                     # no surrogate training either: MLP never moves
        for a, b in zip(mlp_before, opt.momentum_mlp.parameters()):
            assert_bitwise(a, b.detach())
