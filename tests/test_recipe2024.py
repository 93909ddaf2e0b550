"""The 2024 recipe's pieces (`recipe2024` preset): each against a plain reference written here in
numpy, and each config key that switches it on against the v1 behaviour it replaces."""

import copy
import pathlib
import sys

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tests/reference.py

import config as cfg  # noqa: E402
import distributions  # noqa: E402
import dreamer  # noqa: E402
import launch  # noqa: E402
import networks  # noqa: E402
import optim  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags, configs=("debug",)):
    return cfg.parse(["--configs", *configs, "--device", "cpu", *flags], presets=copy.deepcopy(PRESETS))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def to_np(x):
    return x.detach().double().numpy()


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_silu(x):
    return x * np_sigmoid(x)


def np_rmsnorm(x, scale, eps=1e-4):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


# ----------------------------------------------------------------------------------------------
# RMSNorm, the norm key and the weight initialisation
# ----------------------------------------------------------------------------------------------


def test_rmsnorm_matches_the_formula_and_has_only_a_scale():
    norm = networks.RMSNorm(6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 6))
    x = torch.randn(4, 6, generator=gen(0)) * 3
    np.testing.assert_allclose(to_np(norm(x)), np_rmsnorm(to_np(x), to_np(norm.weight)), rtol=1e-5)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]
    tiny = torch.full((1, 6), 1e-3)  # eps 1e-4 dominates mean(x^2) = 1e-6
    np.testing.assert_allclose(to_np(norm(tiny)), np_rmsnorm(to_np(tiny), to_np(norm.weight)), rtol=1e-5)


def test_channel_rmsnorm_normalises_over_channels():
    norm = networks.channel_norm("rms", 3)
    x = torch.randn(2, 3, 4, 5, generator=gen(1))
    want = np_rmsnorm(to_np(x).transpose(0, 2, 3, 1), np.ones(3)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(to_np(norm(x)), want, rtol=1e-5)


@pytest.mark.parametrize("norm, norm_type, bias", [("layer", networks.LayerNorm, False),
                                                   ("rms", networks.RMSNorm, True), ("none", None, True)])
def test_norm_key_chooses_the_norm_of_every_hidden_layer(norm, norm_type, bias):
    config = make_config("--norm", norm, "--encoder.norm", norm, "--decoder.norm", norm)
    agent = dreamer.Dreamer(*spaces(), config)
    mlp = agent.task_behavior.critic.mlp.net
    linear = mlp[0]
    assert (linear.bias is not None) == bias
    if norm_type is None:
        assert isinstance(mlp[1], nn.SiLU)
    else:
        assert type(mlp[1]) is norm_type
    norms = [m for m in agent.modules() if isinstance(m, (nn.LayerNorm, networks.RMSNorm))]
    assert (len(norms) > 0) == (norm_type is not None)
    assert all(isinstance(m, norm_type) for m in norms)
    # Linear -> norm -> SiLU, checked on one block against the plain formula.
    if norm == "rms":
        x = torch.randn(5, linear.in_features, generator=gen(2))
        h = to_np(x) @ to_np(linear.weight).T + to_np(linear.bias)
        np.testing.assert_allclose(to_np(mlp[2](mlp[1](linear(x)))), np_silu(np_rmsnorm(h, 1.0)), rtol=1e-4,
                                   atol=1e-6)


def spaces():
    import gymnasium
    obs = {"vec": gymnasium.spaces.Box(-np.inf, np.inf, (5,), dtype=np.float32),
           "image": gymnasium.spaces.Box(0, 255, (16, 16, 3), dtype=np.uint8)}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    return obs, gymnasium.spaces.Box(-1, 1, (3,), dtype=np.float32)


def test_winit_fan_in_draws_std_outscale_over_sqrt_fan_in():
    layer = networks.init_(nn.Linear(400, 300), 0.5)
    torch.manual_seed(0)
    networks.reinit(layer, "fan_in")
    w = to_np(layer.weight)
    assert np.abs(w).max() <= 2 * 0.5 / np.sqrt(400) / 0.8796 + 1e-6  # truncated at two stds
    assert w.std() == pytest.approx(0.5 / np.sqrt(400), rel=0.03)
    torch.manual_seed(0)
    avg = networks.init_(nn.Linear(400, 300), 0.5)
    assert to_np(avg.weight).std() == pytest.approx(np.sqrt(0.5 / 350), rel=0.03)


@pytest.mark.parametrize("winit", ["fan_avg", "fan_in"])
def test_winit_key_sets_the_policy_and_value_output_scales(winit):
    config = make_config("--winit", winit, "--actor.outscale", "0.01", "--units", "256")
    torch.manual_seed(0)
    agent = dreamer.Dreamer(*spaces(), config)
    out = to_np(agent.task_behavior.actor.out.weight)
    fan_in = agent.task_behavior.actor.out.in_features
    if winit == "fan_in":
        assert out.std() == pytest.approx(0.01 / np.sqrt(fan_in), rel=0.15)
    else:
        fan_out = agent.task_behavior.actor.out.out_features
        assert out.std() == pytest.approx(np.sqrt(0.01 / ((fan_in + fan_out) / 2)), rel=0.15)
    assert not agent.task_behavior.critic.out.weight.any()  # outscale 0 stays exactly zero
    assert not agent.wm.heads["reward"].out.weight.any()
    hidden = agent.task_behavior.critic.mlp.net[0]
    want = 1 / np.sqrt(hidden.in_features) if winit == "fan_in" else np.sqrt(2 / (hidden.in_features + 256))
    assert to_np(hidden.weight).std() == pytest.approx(want, rel=0.1)
    slow = agent.task_behavior.slow_critic.mlp.net[0]
    torch.testing.assert_close(slow.weight, hidden.weight)  # the slow critic starts as a copy


# ----------------------------------------------------------------------------------------------
# Block-diagonal GRU
# ----------------------------------------------------------------------------------------------


def test_block_linear_equals_a_block_diagonal_dense_layer():
    layer = networks.BlockLinear(12, 8, 4)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(8, generator=gen(3)))
    x = torch.randn(5, 12, generator=gen(4))
    dense = np.zeros((12, 8))
    w = to_np(layer.weight)  # (blocks, 3, 2)
    for g in range(4):
        dense[3 * g:3 * g + 3, 2 * g:2 * g + 2] = w[g]
    np.testing.assert_allclose(to_np(layer(x)), to_np(x) @ dense + to_np(layer.bias), rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in layer.parameters()) == 4 * 3 * 2 + 8


def np_block_gru(cell, stoch, action, h):
    """The block GRU step written out: scaled action, three input layers, per-block hidden and gates."""
    def dense(seq, x):
        lin, norm = seq[0], seq[1]
        return np_silu(np_rmsnorm(x @ to_np(lin.weight).T + to_np(lin.bias), to_np(norm.weight)))

    def block(layer, x):
        g = layer.blocks
        w = to_np(layer.weight)
        parts = x.reshape(len(x), g, -1)
        return np.concatenate([parts[:, i] @ w[i] for i in range(g)], -1) + to_np(layer.bias)

    blocks, deter = cell.blocks, cell.deter
    action = action / np.maximum(1.0, np.abs(action))
    embed = np.concatenate([dense(cell.deter_in, h), dense(cell.stoch_in, stoch), dense(cell.action_in, action)], -1)
    size = deter // blocks
    x = np.concatenate([np.concatenate([h[:, i * size:(i + 1) * size], embed], -1) for i in range(blocks)], -1)
    x = np_silu(np_rmsnorm(block(cell.hidden, x), to_np(cell.hidden_norm.weight)))
    gates = block(cell.gates, x).reshape(len(x), blocks, 3, size)
    reset, cand, update = (gates[:, :, i].reshape(len(x), deter) for i in range(3))
    cand = np.tanh(np_sigmoid(reset) * cand)
    update = np_sigmoid(update - 1)
    return update * cand + (1 - update) * h


@pytest.mark.parametrize("blockwise", [False, True], ids=["all_blocks", "block_by_block"])
def test_block_gru_cell_matches_the_written_out_step(blockwise, monkeypatch):
    """The cell's step against the written-out one, its gates computed for all blocks at once and (the CPU's way
    from networks.BLOCKWISE_MIN_ROWS rows on, here forced on 3 rows) block by block."""
    monkeypatch.setattr(networks, "BLOCKWISE_MIN_ROWS", 1 if blockwise else 10 ** 9)
    torch.manual_seed(0)
    cell = networks.BlockGRUCell(6, 2, 5, 8, 4, "SiLU", "rms")
    with torch.no_grad():
        for p in cell.parameters():  # nonzero biases and scales, so that each one is checked
            p.add_(0.1 * torch.randn(p.shape, generator=gen(5)))
    stoch = torch.randn(3, 6, generator=gen(6))
    action = torch.randn(3, 2, generator=gen(7)) * 3  # some beyond [-1, 1]: scaled back
    h = torch.randn(3, 8, generator=gen(8))
    got = cell(torch.cat([stoch, action], -1), h)
    want = np_block_gru(cell, to_np(stoch), to_np(action), to_np(h))
    np.testing.assert_allclose(to_np(got), want, rtol=1e-4, atol=1e-5)


def test_block_gru_hidden_layer_keeps_each_block_to_its_own_part_of_the_state():
    torch.manual_seed(0)
    cell = networks.BlockGRUCell(6, 2, 5, 8, 4, "SiLU", "rms")
    h = torch.randn(8, generator=gen(10))
    # The hidden layer as the cell computes it (block_input): per block its 2 state units and the
    # shared 15-unit embedding.
    embed = torch.randn(1, 15, generator=gen(11))
    hidden = lambda h: cell.block_input(h[None], embed)[0]  # noqa: E731
    jac = torch.autograd.functional.jacobian(hidden, h)
    for g in range(4):
        outside = torch.ones(8, dtype=bool)
        outside[2 * g:2 * g + 2] = False
        assert not jac[2 * g:2 * g + 2, outside].any()
        assert jac[2 * g:2 * g + 2, ~outside].abs().sum() > 0


@pytest.mark.parametrize("cell", ["gru", "blockgru"])
def test_dyn_cell_chooses_the_recurrent_cell(cell):
    config = make_config("--dyn_cell", cell, "--dyn_blocks", "4", "--norm", "rms")
    agent = dreamer.Dreamer(*spaces(), config)
    rssm = agent.wm.rssm
    want = networks.BlockGRUCell if cell == "blockgru" else networks.GRUCell
    assert type(rssm.cell) is want
    if cell == "blockgru":
        assert rssm.cell.blocks == 4 and rssm.cell.gates.blocks == 4
        assert isinstance(rssm.img_in, nn.Identity)
    state = rssm.initial(2)
    action = torch.ones(2, 3)
    with torch.no_grad():
        prior = rssm.img_step(state, action)
        want_deter = rssm.cell(torch.cat([state["stoch"].flatten(1), action], -1) if cell == "blockgru"
                               else rssm.img_in(torch.cat([state["stoch"].flatten(1), action], -1)), state["deter"])
    torch.testing.assert_close(prior["deter"], want_deter)


@pytest.mark.parametrize("layers", [1, 2])
def test_dyn_img_layers_is_the_depth_of_the_prior(layers):
    config = make_config("--dyn_img_layers", str(layers))
    rssm = dreamer.Dreamer(*spaces(), config).wm.rssm
    linears = [m for m in rssm.img_out if isinstance(m, nn.Linear)]
    assert len(linears) == layers
    assert linears[0].in_features == config.dyn_deter
    assert all(m.out_features == config.dyn_hidden for m in linears)


# ----------------------------------------------------------------------------------------------
# LaProp, adaptive gradient clipping and the warm-up
# ----------------------------------------------------------------------------------------------


def np_laprop_agc(params, grads, lr, warmup, agc, eps=1e-20, b1=0.9, b2=0.999):
    """The 2024 recipe's update written out per tensor: AGC, RMS scaling, then momentum, lr ramp."""
    params = [p.copy() for p in params]
    nu = [np.zeros_like(p) for p in params]
    mu = [np.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, 1):
        rate = lr * min(1.0, (t - 1) / warmup)
        for i, (p, g) in enumerate(zip(params, step_grads)):
            upper = agc * max(1e-3, np.sqrt((p ** 2).sum()))
            g = g / max(1.0, np.sqrt((g ** 2).sum()) / upper)
            nu[i] = b2 * nu[i] + (1 - b2) * g ** 2
            u = g / (np.sqrt(nu[i] / (1 - b2 ** t)) + eps)
            mu[i] = b1 * mu[i] + (1 - b1) * u
            params[i] = p - rate * mu[i] / (1 - b1 ** t)
    return params


def test_laprop_with_agc_and_warmup_matches_the_written_out_update():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3, dtype=torch.float64)),
              nn.Parameter(torch.zeros(5, dtype=torch.float64))]  # |param| 0: the floor 1e-3 bounds the step
    start = [to_np(p).copy() for p in params]  # a copy: numpy shares a float64 tensor's memory
    opt = optim.Optimizer("x", params, lr=0.1, eps=1e-20, clip=0, opt="laprop", agc=0.3, warmup=2)
    assert isinstance(opt.opt, optim.LaProp)
    grads = []
    for step in range(4):
        coeffs = [torch.randn(p.shape, generator=gen(20 + step), dtype=torch.float64) * (10 ** step) for p in params]
        # The gradient of sum(c * p^2 / 2 + c * p) is c * (p + 1): it depends on where the parameters are.
        grads.append([to_np(c) * (to_np(p) + 1) for c, p in zip(coeffs, params)])  # (p + 1) is a new array
        opt(sum((c * (p ** 2 / 2 + p)).sum() for c, p in zip(coeffs, params)))
    want = np_laprop_agc(start, grads, 0.1, 2, 0.3)
    np.testing.assert_allclose(to_np(params[0]), want[0], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(to_np(params[1]), want[1], rtol=1e-6, atol=1e-9)
    assert opt.updates == 4 and opt.state_dict()["updates"] == 4


def test_laprop_first_update_has_rate_zero_and_second_steps_lr():
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = optim.Optimizer("x", [p], lr=0.5, eps=1e-20, clip=0, opt="laprop", warmup=1)
    opt((p * torch.tensor([3.0, -1.0])).sum())
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0]))
    opt((p * torch.tensor([3.0, -1.0])).sum())
    # Constant gradient: u = sign(g) and the bias-corrected momentum is exactly sign(g).
    torch.testing.assert_close(p.detach(), torch.tensor([0.5, -1.5]))


def test_opt_agc_warmup_and_grad_clip_zero_configure_every_optimizer():
    config = make_config("--opt", "laprop", "--agc", "0.3", "--warmup", "3", "--grad_clip", "0",
                         "--actor.grad_clip", "0", "--critic.grad_clip", "0", "--expl_behavior", "plan2explore")
    agent = dreamer.Dreamer(*spaces(), config)
    optimizers = agent.optimizers()
    assert set(optimizers) == {"model", "task/actor", "task/critic", "expl/ensemble", "expl/behavior/actor",
                               "expl/behavior/critic"}
    for opt in optimizers.values():
        assert isinstance(opt.opt, optim.LaProp) and opt.agc == 0.3 and opt.warmup == 3
    opt = optimizers["task/critic"]
    coeffs = [torch.randn(p.shape, generator=gen(30)) * 1e3 for p in opt.params]
    rates = []
    for _ in range(4):
        before = [p.detach().clone() for p in opt.params]
        rates.append(float(opt.opt.rate(opt.opt.param_groups[0])))  # the rate this step takes
        metrics = opt(sum((c * p).sum() for c, p in zip(coeffs, opt.params)))
    assert rates == pytest.approx([0.0, config.critic.lr / 3, 2 * config.critic.lr / 3, config.critic.lr])
    norm = float(torch.sqrt(sum((c.double() ** 2).sum() for c in coeffs)))
    assert metrics["critic_grad_norm"].item() == pytest.approx(norm, rel=1e-4)  # no global clip
    for c, p, old in zip(coeffs, opt.params, before):  # each tensor clipped to 0.3 max(1e-3, |p|) on its own
        bound = 0.3 * max(1e-3, float(torch.linalg.vector_norm(old)))
        torch.testing.assert_close(p.grad, c * min(1.0, bound / float(torch.linalg.vector_norm(c))))
    default = dreamer.Dreamer(*spaces(), make_config())
    assert type(default.optimizers()["model"].opt) is optim.Adam and default.optimizers()["model"].agc == 0


# ----------------------------------------------------------------------------------------------
# Heads: symexp two-hot and the continue head predicting the discount
# ----------------------------------------------------------------------------------------------


def np_symexp(x):
    return np.sign(x) * (np.exp(np.abs(x)) - 1)


def test_symexp_bins_are_symexp_of_an_even_grid_and_antisymmetric():
    for n in (255, 6):
        bins = to_np(distributions.symexp_bins(n))
        if n % 2:
            want = np_symexp(np.linspace(-20, 20, n))
            assert bins[n // 2] == 0
        else:  # no middle bin: both halves come from [-20, 0] on n / 2 points
            half = np_symexp(np.linspace(-20, 0, n // 2))
            want = np.concatenate([half, -half[::-1]])
        np.testing.assert_allclose(bins, want, rtol=1e-5)
        np.testing.assert_array_equal(bins, -bins[::-1])


def test_symexp_twohot_loss_and_prediction_in_raw_space():
    logits = torch.randn(7, 255, generator=gen(40))
    dist = distributions.TwoHot(logits, squash=False)
    bins = to_np(distributions.symexp_bins(255))
    values = np.array([0.0, 0.3, -2.5, 17.0, 1e3, -4e4, 1e10])  # the last beyond the top bin
    log_probs = to_np(torch.log_softmax(logits, -1))
    for i, v in enumerate(values):
        target = np.zeros(255)
        if v >= bins[-1]:
            target[-1] = 1.0
        else:
            k = np.searchsorted(bins, v, side="right") - 1  # bins[k] <= v < bins[k + 1]
            w = (v - bins[k]) / (bins[k + 1] - bins[k])
            target[k], target[k + 1] = 1 - w, w
        got = dist.log_prob(torch.tensor(v, dtype=torch.float32).expand(7))[i].item()
        assert got == pytest.approx((target * log_probs[i]).sum(), rel=1e-4)
    probs = np.exp(log_probs)
    np.testing.assert_allclose(to_np(dist.mean()), (probs * bins).sum(-1), rtol=1e-4, atol=1e-3)
    assert distributions.TwoHot(torch.zeros(255), squash=False).mean().item() == 0.0


@pytest.mark.parametrize("dist", ["symlog_disc", "symexp_twohot"])
def test_reward_and_critic_dist_choose_the_bins(dist):
    config = make_config("--reward_head.dist", dist, "--critic.dist", dist)
    agent = dreamer.Dreamer(*spaces(), config)
    for head in (agent.wm.heads["reward"], agent.task_behavior.critic):
        out = head(torch.randn(3, agent.wm.rssm.feat_size, generator=gen(41)))
        assert out.squash == (dist == "symlog_disc") and out.bins.shape == (255,)
        assert not out.mean().any()  # zero-initialised output: exactly 0


@pytest.mark.parametrize("contdisc", [False, True])
def test_contdisc_makes_the_continue_head_learn_and_imagine_the_discount(contdisc):
    config = make_config("--cont_head.contdisc", str(contdisc), "--discount", "0.99")
    agent = dreamer.Dreamer(*spaces(), config)
    wm = agent.wm
    cont = torch.tensor([[1.0, 0.0, 1.0]])
    torch.testing.assert_close(wm.cont_target(cont), cont * 0.99 if contdisc else cont)
    feat = torch.randn(4, 2, wm.rssm.feat_size, generator=gen(42))
    with torch.no_grad():
        for p in wm.heads["cont"].parameters():
            p.add_(torch.randn(p.shape, generator=gen(43)))
        flags, discount = wm.imagined_cont(feat, torch.tensor([1.0, 0.0]))
        logits = wm.heads["cont"].raw(feat)[..., 0]
    if contdisc:
        torch.testing.assert_close(flags, torch.sigmoid(logits))
        assert discount == 1.0
    else:
        torch.testing.assert_close(flags[0], torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(flags[1:], (logits[1:] > 0).float())
        assert discount == 0.99


@pytest.mark.parametrize("contdisc", [False, True])
def test_continue_loss_trains_on_the_contdisc_target(contdisc):
    config = make_config("--cont_head.contdisc", str(contdisc), "--discount", "0.99")
    torch.manual_seed(0)
    wm = dreamer.Dreamer(*spaces(), config).wm
    rng = np.random.default_rng(0)
    batch = {"vec": rng.normal(size=(2, 4, 5)).astype(np.float32),
             "image": rng.integers(0, 256, (2, 4, 16, 16, 3), dtype=np.uint8),
             "action": rng.uniform(-1, 1, (2, 4, 3)).astype(np.float32),
             "reward": rng.normal(size=(2, 4)).astype(np.float32),
             "is_first": np.eye(4, dtype=bool)[[0, 0]], "is_last": np.zeros((2, 4), bool),
             "is_terminal": np.array([[0, 0, 1, 0], [0, 1, 0, 0]], bool)}
    data = wm.preprocess(batch)
    with torch.no_grad():
        _, post, _, metrics = wm.loss(data)
        logits = wm.heads["cont"].raw(wm.rssm.get_feat(post))[..., 0]
    target = (1 - batch["is_terminal"]) * (0.99 if contdisc else 1.0)
    p = np_sigmoid(to_np(logits))
    want = -(target * np.log(p) + (1 - target) * np.log(1 - p)).mean()
    assert metrics["con_loss"].item() == pytest.approx(want, rel=1e-4)


# ----------------------------------------------------------------------------------------------
# Size presets: parameter counts against the official networks
# ----------------------------------------------------------------------------------------------

SIZES = {  # name: (deter, hidden, classes, units), as in the official configs.yaml
    "size1m": (512, 64, 4, 64), "size12m": (2048, 256, 16, 256), "size25m": (3072, 384, 24, 384),
    "size50m": (4096, 512, 32, 512), "size100m": (6144, 768, 48, 768), "size200m": (8192, 1024, 64, 1024),
    "size400m": (12288, 1536, 96, 1536)}


def walker_spaces():
    """The spaces of DMC walker with proprioceptive observations: 24 numbers, 6 actions."""
    import gymnasium
    box = lambda shape: gymnasium.spaces.Box(-np.inf, np.inf, shape, dtype=np.float32)  # noqa: E731
    obs = {"orientations": box((14,)), "height": box(()), "velocity": box((9,))}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    return obs, gymnasium.spaces.Box(-1, 1, (6,), dtype=np.float32)


def official_count(obs, actions, deter, hidden, classes, units, stoch=32, blocks=8, bins=255):
    """Parameters the official agent's optimizer holds (dyn, enc, dec, rew, con, pol, val; not the
    slow value copy) for vector observations, counted layer by layer from its networks: every
    Linear has a bias, every hidden Linear is followed by an RMSNorm with a scale."""
    feat = stoch * classes + deter
    linear = lambda i, o, norm=True: i * o + o + (o if norm else 0)  # noqa: E731
    rssm = (linear(deter, hidden) + linear(stoch * classes, hidden) + linear(actions, hidden)  # dynin0..2
            + (deter + 3 * blocks * hidden) * deter // blocks + 2 * deter  # dynhid0: block linear + norm
            + 3 * deter * deter // blocks + 3 * deter  # dyngru: block linear to the three gates
            + linear(deter, hidden) + linear(hidden, hidden) + linear(hidden, stoch * classes, False)  # prior
            + linear(deter + units, hidden) + linear(hidden, stoch * classes, False))  # posterior
    mlp = lambda inp, layers: linear(inp, units) + (layers - 1) * linear(units, units)  # noqa: E731
    enc = mlp(obs, 3)
    dec = mlp(feat, 3) + linear(units, obs, False)
    rew = mlp(feat, 1) + linear(units, bins, False)
    con = mlp(feat, 1) + linear(units, 1, False)
    pol = mlp(feat, 3) + 2 * linear(units, actions, False)  # mean and stddev
    val = mlp(feat, 3) + linear(units, bins, False)
    return rssm + enc + dec + rew + con + pol + val


def agent_count(agent):
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return count(agent.wm) + count(agent.task_behavior.actor) + count(agent.task_behavior.critic)


def test_official_count_reproduces_the_published_figures():
    # The official size1m on DMC walker proprio has about 0.64M parameters, size12m about 9.7M.
    assert official_count(24, 6, *SIZES["size1m"]) == pytest.approx(0.64e6, rel=0.01)
    assert official_count(24, 6, *SIZES["size12m"]) == pytest.approx(9.7e6, rel=0.01)


@pytest.mark.parametrize("size", ["size1m", "size12m"])
def test_small_sizes_have_the_official_count_and_train_one_update(size):
    config = make_config("--imag_horizon", "2", "--compile", "False",
                         configs=("dmc_proprio", "recipe2024", size))
    obs_space, act_space = walker_spaces()
    torch.manual_seed(0)
    agent = dreamer.Dreamer(obs_space, act_space, config)
    assert agent_count(agent) == official_count(24, 6, *SIZES[size])
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(2, 3, *obs_space[k].shape)).astype(np.float32)
             for k in ("orientations", "height", "velocity")}
    batch.update(action=rng.uniform(-1, 1, (2, 3, 6)).astype(np.float32),
                 reward=rng.normal(size=(2, 3)).astype(np.float32), is_first=np.eye(3, dtype=bool)[[0, 0]],
                 is_last=np.zeros((2, 3), bool), is_terminal=np.zeros((2, 3), bool))
    # The latents replay_context 1 stores with each step (zeros: the initial state).
    batch.update({k: np.zeros((2, 3, *shape), dtype) for k, (shape, dtype) in agent.context.spec.items()})
    before = [p.detach().clone() for p in agent.wm.parameters()]
    metrics, _ = agent.update.train_step(batch)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    # Warm-up: the first update has learning rate 0, so nothing moves yet.
    assert all(torch.equal(a, b) for a, b in zip(before, agent.wm.parameters()))
    agent.update.train_step(batch)
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.wm.parameters()))


@pytest.mark.parametrize("size", ["size25m", "size50m", "size100m", "size200m", "size400m"])
def test_large_sizes_have_the_official_count(size):
    config = make_config("--compile", "False", configs=("dmc_proprio", "recipe2024", size))
    with torch.device("meta"):  # shapes only: no memory, no initialisation work
        agent = dreamer.Dreamer(*walker_spaces(), config)
    assert agent_count(agent) == official_count(24, 6, *SIZES[size])


# ----------------------------------------------------------------------------------------------
# Image encoder and decoder
# ----------------------------------------------------------------------------------------------


def test_pooled_encoder_is_conv_pool_norm_act_with_channels_2_3_4_4():
    import torch.nn.functional as F
    torch.manual_seed(0)
    encoder = networks.PooledConvEncoder((64, 64, 3), 4, 5, 4, "SiLU", "rms")
    convs = [m for m in encoder.net if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 12, 16, 16]
    assert all(c.kernel_size == (5, 5) and c.stride == (1, 1) for c in convs)
    image = torch.rand(2, 64, 64, 3, generator=gen(50))
    x = image.permute(0, 3, 1, 2) - 0.5
    for conv in convs:  # written out: conv, 2x2 max, RMSNorm over channels (scale 1), SiLU
        x = F.max_pool2d(F.conv2d(x, conv.weight, conv.bias, padding=2), 2)
        x = x / torch.sqrt(x.square().mean(1, keepdim=True) + 1e-4)
        x = x * torch.sigmoid(x)
    assert encoder.outdim == 16 * 4 * 4
    torch.testing.assert_close(encoder(image), x.flatten(1), rtol=1e-4, atol=1e-5)


def test_upsample_decoder_seed_blocks_and_stages():
    import torch.nn.functional as F
    torch.manual_seed(0)
    decoder = networks.UpsampleConvDecoder(12, 16, (32, 32, 3), 8, 5, 4, "SiLU", "rms", 1.0, 10)
    feat = torch.randn(2, 28, generator=gen(51))
    stoch, deter = feat[:, :12], feat[:, 12:]
    # Seed (4, 4, 32): block k of from_deter fills channels 4k..4k+3 at every position, from deter
    # units 2k..2k+1 only; from_stoch fills all channels in (h, w, c) order.
    w, b = decoder.from_deter.weight, decoder.from_deter.bias  # (8, 2, 64), (512,)
    seed = torch.zeros(2, 4, 4, 32)
    for k in range(8):
        block = deter[:, 2 * k:2 * k + 2] @ w[k] + b[64 * k:64 * (k + 1)]  # (2, 64) = (h, w, 4)
        seed[..., 4 * k:4 * k + 4] = block.reshape(2, 4, 4, 4)
    seed = seed + decoder.from_stoch(stoch).reshape(2, 4, 4, 32)
    x = seed.permute(0, 3, 1, 2)
    x = x / torch.sqrt(x.square().mean(1, keepdim=True) + 1e-4)
    x = x * torch.sigmoid(x)
    convs = [m for m in decoder.net if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [24, 16, 3]  # depth x [3, 2], then the image
    for i, conv in enumerate(convs):
        x = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), conv.weight, conv.bias, padding=2)
        if i < len(convs) - 1:
            x = x / torch.sqrt(x.square().mean(1, keepdim=True) + 1e-4)
            x = x * torch.sigmoid(x)
    want = torch.sigmoid(x).permute(0, 2, 3, 1)
    torch.testing.assert_close(decoder(feat), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("enc, dec", [("strided", "transposed"), ("pooled", "upsample")])
def test_encoder_cnn_and_decoder_cnn_choose_the_image_networks(enc, dec):
    config = make_config("--encoder.cnn", enc, "--decoder.cnn", dec, "--decoder.cnn_sigmoid", "True",
                         "--encoder.kernel_size", "5", "--decoder.kernel_size", "5")
    agent = dreamer.Dreamer(*spaces(), config)
    encoder, decoder = agent.wm.encoder.cnn, agent.wm.heads["decoder"].cnn
    assert type(encoder) is (networks.ConvEncoder if enc == "strided" else networks.PooledConvEncoder)
    assert type(decoder) is (networks.ConvDecoder if dec == "transposed" else networks.UpsampleConvDecoder)
    with torch.no_grad():
        assert encoder(torch.rand(2, 16, 16, 3)).shape == (2, encoder.outdim)
        image = decoder(torch.randn(2, 5, agent.wm.rssm.feat_size))
    assert image.shape == (2, 5, 16, 16, 3) and image.min() > 0 and image.max() < 1


def official_vision_count(actions, deter, hidden, classes, units, depth, stoch=32, blocks=8, bins=255):
    """As official_count, for 64x64x3 images: the encoder's four 5x5 conv stages (depth x [2, 3,
    4, 4], pooled down to 4x4), the decoder's block-linear seed, three conv stages and output conv."""
    feat = stoch * classes + deter
    linear = lambda i, o, norm=True: i * o + o + (o if norm else 0)  # noqa: E731
    conv = lambda i, o, norm=True: 25 * i * o + o + (o if norm else 0)  # noqa: E731
    d2, d3, d4 = 2 * depth, 3 * depth, 4 * depth
    enc = conv(3, d2) + conv(d2, d3) + conv(d3, d4) + conv(d4, d4)
    embed = seed = 4 * 4 * d4
    dec = (deter * seed // blocks + seed + linear(stoch * classes, 2 * units) + linear(2 * units, seed, False) + d4
           + conv(d4, d4) + conv(d4, d3) + conv(d3, d2) + conv(d2, 3, False))
    rssm = (linear(deter, hidden) + linear(stoch * classes, hidden) + linear(actions, hidden)
            + (deter + 3 * blocks * hidden) * deter // blocks + 2 * deter + 3 * deter * deter // blocks + 3 * deter
            + linear(deter, hidden) + linear(hidden, hidden) + linear(hidden, stoch * classes, False)
            + linear(deter + embed, hidden) + linear(hidden, stoch * classes, False))
    mlp = lambda inp, layers: linear(inp, units) + (layers - 1) * linear(units, units)  # noqa: E731
    heads = (mlp(feat, 1) + linear(units, bins, False) + mlp(feat, 1) + linear(units, 1, False)
             + mlp(feat, 3) + 2 * linear(units, actions, False) + mlp(feat, 3) + linear(units, bins, False))
    return rssm + enc + dec + heads


@pytest.mark.parametrize("size", list(SIZES))
def test_every_size_on_images_has_the_official_count(size):
    import gymnasium
    config = make_config("--compile", "False", configs=("dmc_vision", "recipe2024", size))
    obs = {"image": gymnasium.spaces.Box(0, 255, (64, 64, 3), dtype=np.uint8)}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    with torch.device("meta"):
        agent = dreamer.Dreamer(obs, gymnasium.spaces.Box(-1, 1, (6,), dtype=np.float32), config)
    deter, hidden, classes, units = SIZES[size]
    assert config.encoder.cnn_depth == config.decoder.cnn_depth == units // 16  # as in the official presets
    assert agent_count(agent) == official_vision_count(6, deter, hidden, classes, units, units // 16)


# ----------------------------------------------------------------------------------------------
# Replay value loss
# ----------------------------------------------------------------------------------------------


def test_replay_return_matches_the_recursion_written_out():
    import models
    rng = np.random.default_rng(60)
    B, T, gamma, lam = 3, 6, 0.99, 0.95
    reward, boot = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    is_last = np.zeros((B, T))
    is_terminal = np.zeros((B, T))
    is_last[1, 3] = 1  # a truncated episode: bootstrap there, do not look past it
    is_last[2, 2] = is_terminal[2, 2] = 1  # a terminated one: nothing after it counts
    want = np.zeros((B, T - 1))
    for b in range(B):
        ret = boot[b, T - 1]
        for t in range(T - 2, -1, -1):
            nxt = t + 1
            if is_terminal[b, nxt]:
                ret = reward[b, nxt]
            elif is_last[b, nxt]:
                ret = reward[b, nxt] + gamma * boot[b, nxt]
            else:
                ret = reward[b, nxt] + gamma * ((1 - lam) * boot[b, nxt] + lam * ret)
            want[b, t] = ret
    as_t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    got = models.replay_return(as_t(reward), as_t(is_last), as_t(is_terminal), as_t(boot), gamma, lam)
    np.testing.assert_allclose(to_np(got), want, rtol=1e-10)


def test_critic_repval_adds_the_weighted_replay_value_loss_to_the_critic():
    losses = {}
    for repval in (0.0, 0.3):
        agent, batch = vector_setup("--critic.repval", str(repval))
        torch.manual_seed(1)
        losses[repval], _ = agent.update.train_step(batch)
    assert "critic_repval_loss" not in losses[0.0]
    repval = losses[0.3]["critic_repval_loss"].item()
    assert repval > 0
    total = losses[0.3]["critic_loss"].item()
    assert total == pytest.approx(losses[0.0]["critic_loss"].item() + 0.3 * repval, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# One optimizer, one step: update 'joint'
# ----------------------------------------------------------------------------------------------


def vector_setup(*flags):
    import gymnasium
    config = make_config("--encoder.cnn_keys", "$^", "--decoder.cnn_keys", "$^", "--encoder.mlp_keys", "vec",
                         "--decoder.mlp_keys", "vec", *flags)
    obs = {"vec": gymnasium.spaces.Box(-np.inf, np.inf, (5,), dtype=np.float32)}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    torch.manual_seed(0)
    agent = dreamer.Dreamer(obs, gymnasium.spaces.Box(-1, 1, (3,), dtype=np.float32), config)
    rng = np.random.default_rng(0)
    batch = {"vec": rng.normal(size=(2, 4, 5)).astype(np.float32),
             "action": rng.uniform(-1, 1, (2, 4, 3)).astype(np.float32),
             "reward": rng.normal(size=(2, 4)).astype(np.float32), "is_first": np.eye(4, dtype=bool)[[0, 0]],
             "is_last": np.zeros((2, 4), bool), "is_terminal": np.zeros((2, 4), bool)}
    batch["is_last"][1, 2] = batch["is_terminal"][1, 2] = True
    return agent, batch


JOINT = ("--update", "joint", "--imag_gradient", "reinforce", "--opt", "laprop", "--agc", "0.3", "--warmup", "0",
         "--model_lr", "0.01", "--opt_eps", "1e-20", "--grad_clip", "0", "--critic.repval", "0.3")


def test_joint_update_is_one_laprop_step_on_the_sum_of_all_losses():
    """One joint update against tests/reference.py, which writes the losses at the starting parameters, their
    one gradient (the replay value loss reaching the representation) and the LaProp + AGC step out with no
    product helper."""
    import reference  # tests/reference.py
    agent, batch = vector_setup(*JOINT)
    with torch.no_grad():  # heads that start at zero leave the actor's gradient at rounding noise
        for layer in (agent.wm.heads["reward"].out, agent.task_behavior.critic.out):
            layer.weight.copy_(0.3 * torch.randn(layer.weight.shape, generator=gen(40)))
    twin = copy.deepcopy(agent)
    before = {name: p.detach().clone() for name, p in agent.named_parameters()}
    torch.manual_seed(5)
    agent.update.train_step(batch)
    torch.manual_seed(5)
    reference.update(twin, batch)
    want, moved = dict(twin.named_parameters()), 0
    for name, p in agent.named_parameters():  # a first LaProp step is about lr x sign(gradient): a few % of lr
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-5, atol=5e-4, msg=name)
        moved += int(not torch.equal(p.detach(), before[name]))
    assert moved > 10


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_update_decides_whether_the_replay_value_loss_trains_the_world_model(update):
    flags = [*JOINT[2:]]
    after = {}
    for repval in ("0.0", "0.3"):
        agent, batch = vector_setup("--update", update, *flags, "--critic.repval", repval)
        torch.manual_seed(5)
        for _ in range(2):  # a first LaProp step is sign(gradient): magnitudes show from the second on
            agent.update.train_step(batch)
        after[repval] = [p.detach().clone() for p in agent.wm.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(after["0.0"], after["0.3"]))
    assert same == (update == "sequential")


@pytest.mark.parametrize("absmax", [1.0, 0.0])
def test_actor_absmax_bounds_the_samples_or_leaves_them_to_the_environment(absmax):
    agent, _ = vector_setup("--actor.absmax", str(absmax))
    feat = torch.randn(4000, agent.wm.rssm.feat_size, generator=gen(7))
    with torch.no_grad():
        dist = agent.task_behavior.actor(feat)
        torch.manual_seed(7)
        sample = dist.sample()
        torch.manual_seed(7)
        raw = torch.distributions.Normal(dist.mean_, dist.dist.stddev).sample()  # written out: mean + std * noise
    if absmax:  # v1: scaled back into the box, keeping the direction
        np.testing.assert_allclose(to_np(sample), to_np(raw / raw.abs().clamp(min=1.0)), rtol=1e-5)
    else:  # 2024: the sample itself; the environment clips what leaves [-1, 1]
        np.testing.assert_allclose(to_np(sample), to_np(raw), rtol=1e-6)
        assert (sample.abs() > 1).any()


def test_joint_update_refuses_the_dynamics_gradient():
    with pytest.raises(tools.ConfigError, match="Invalid value 'dynamics' for --imag_gradient: --update joint needs "
                                                "reinforce"):
        vector_setup("--update", "joint", "--imag_gradient", "dynamics")


@pytest.mark.parametrize("configs, online", [(("debug", "recipe2024"), True), (("debug",), False)])
def test_replay_online_gives_the_training_replay_the_queue_of_its_sequence_length(tmp_path, configs, online):
    config = cfg.parse(["--configs", *configs, "--batch_length", "12"], presets=copy.deepcopy(PRESETS))
    stored = storage.StoredEpisodes(config, tmp_path, 0, None, {})
    assert stored.replay.online == (12 + config.replay_context if online else 0)
    assert stored.eval_replay.online == 0  # evaluation batches are not training


def test_recipe2024_switches_to_the_official_settings_and_defaults_stay_v1():
    config = make_config(configs=("dmc_proprio", "recipe2024", "size1m"))
    assert (config.opt, config.agc, config.warmup, config.update) == ("laprop", 0.3, 1000, "joint")
    for lr, eps, clip in ((config.model_lr, config.opt_eps, config.grad_clip),
                          (config.actor.lr, config.actor.eps, config.actor.grad_clip),
                          (config.critic.lr, config.critic.eps, config.critic.grad_clip)):
        assert (lr, eps, clip) == (4e-5, 1e-20, 0)
    assert (config.dyn_scale, config.rep_scale, config.kl_free) == (1.0, 0.1, 1.0)
    assert config.discount == pytest.approx(1 - 1 / 333, abs=1e-6)
    layers = (config.reward_head.layers, config.cont_head.layers, config.actor.layers, config.critic.layers)
    assert layers == (1, 1, 3, 3)
    assert (config.actor.outscale, config.critic.outscale, config.reward_head.outscale) == (0.01, 0.0, 0.0)
    assert (config.actor.min_std, config.actor.max_std, config.actor.entropy) == (0.1, 1.0, 3e-4)
    critic = config.critic
    assert (critic.repval, critic.slow_target_fraction, critic.slow_target_update) == (0.3, 0.02, 1)
    assert config.imag_gradient == "reinforce" and config.cont_head.contdisc
    assert (config.replay_context, config.batch_length, config.actor.absmax) == (1, 64, 0.0)
    assert config.replay_online
    defaults = cfg.parse(["--configs", "dmc_proprio"], presets=copy.deepcopy(PRESETS))
    assert (defaults.norm, defaults.winit, defaults.opt, defaults.update, defaults.dyn_cell) == (
        "layer", "fan_avg", "adam", "sequential", "gru")
    assert (defaults.encoder.cnn, defaults.decoder.cnn, defaults.critic.repval, defaults.cont_head.contdisc) == (
        "strided", "transposed", 0.0, False)
    assert (defaults.replay_context, defaults.actor.absmax, defaults.replay_online) == (0, 1.0, False)


def test_new_keys_are_range_checked_at_start_up():
    with pytest.raises(tools.ConfigError, match="--dyn_blocks; valid: a whole number >= 1 that divides --dyn_deter"):
        make_config("--dyn_cell", "blockgru", "--dyn_deter", "30")
    make_config("--dyn_deter", "30")  # the GRU of v1 has no blocks to divide into
    for key in ("--agc", "--critic.repval", "--actor.absmax"):
        with pytest.raises(tools.ConfigError, match=f"Invalid value '-1.0' for {key}"):
            make_config(key, "-1.0")
    with pytest.raises(tools.ConfigError, match="--warmup"):
        make_config("--warmup", "-1")
    assert make_config("--grad_clip", "0").grad_clip == 0  # 0: no global clip


def test_distribute_reaches_the_joint_optimizer():
    agent, _ = vector_setup(*JOINT)
    ranks = launch.SingleProcess()
    agent.distribute(ranks)
    assert set(agent.optimizers()) == {"update"}  # the one optimizer, none per network
    assert agent.optimizers()["update"].ranks is ranks
