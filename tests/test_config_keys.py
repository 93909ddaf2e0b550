"""Every config key changes what it should ("No config key is dead"): the shapes of the networks it
builds, the optimizer it configures, the loss terms it weighs, where a run reads and writes.

Agents are built as dreamer.main builds them, from the spaces of the debug task's environment.
The end-to-end checks run short `dreamer.main` trainings in this process (no interpreter start-up
per run); a module fixture shares each run among the tests that read it.
"""

import copy
import json
import pathlib
import sys

import gymnasium
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import compilation  # noqa: E402
import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import models  # noqa: E402
import networks  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402
from envs import wrappers  # noqa: E402

PRESETS = cfg.load_presets()
PROPRIO = ["--encoder.mlp_keys", ".*", "--encoder.cnn_keys", "$^", "--decoder.mlp_keys", ".*",
           "--decoder.cnn_keys", "$^"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return cfg.parse(["--configs", "debug", *flags], presets=copy.deepcopy(PRESETS))


def make_agent(spaces, *flags, seed=0):
    config = make_config(*flags)
    torch.manual_seed(seed)
    agent = dreamer.Dreamer(*spaces, config)
    return agent, agent.config  # settled: the 'auto' keys resolved


def fake_batch(spaces, batch=3, length=5, seed=0):
    """A replayed batch (B, T, ...) for the debug task's spaces: random observations and actions."""
    obs_space, act_space = spaces
    rng = np.random.default_rng(seed)
    data = {}
    for key, space in obs_space.items():
        if key in ("is_first", "is_last", "is_terminal"):
            continue
        if space.dtype == np.uint8:
            data[key] = rng.integers(0, 256, (batch, length, *space.shape), dtype=np.uint8)
        else:
            data[key] = rng.normal(size=(batch, length, *space.shape)).astype(np.float32)
    data["action"] = rng.uniform(-1, 1, (batch, length, *act_space.shape)).astype(np.float32)
    data["reward"] = rng.normal(size=(batch, length)).astype(np.float32)
    data["is_first"] = np.zeros((batch, length), bool)
    data["is_first"][:, 0] = True
    data["is_last"] = np.zeros((batch, length), bool)
    data["is_terminal"] = rng.random((batch, length)) < 0.3
    return data


def linears(module):
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def flat_grad(params):
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in params])


# ----------------------------------------------------------------------------------------------
# Network shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [24, 40])
def test_dyn_hidden_is_the_width_of_every_rssm_hidden_layer(spaces, hidden):
    agent, config = make_agent(spaces, "--dyn_hidden", str(hidden))
    rssm = agent.wm.rssm
    assert [seq[0].out_features for seq in (rssm.img_in, rssm.img_out, rssm.obs_out)] == [hidden] * 3
    assert rssm.cell.linear.in_features == hidden + config.dyn_deter
    assert rssm.img_stats.in_features == rssm.obs_stats.in_features == hidden


@pytest.mark.parametrize("depth", [1, 3])
def test_dyn_rec_depth_applies_the_gru_cell_that_often_per_step(spaces, depth):
    agent, _ = make_agent(spaces, "--dyn_rec_depth", str(depth))
    rssm = agent.wm.rssm
    calls = []
    rssm.cell.register_forward_hook(lambda module, args, out: calls.append(args))
    with torch.no_grad():
        start = rssm.initial(4)
        start["deter"] = torch.randn(4, rssm.deter, generator=torch.Generator().manual_seed(1))
        action = torch.ones(4, spaces[1].shape[0])
        state = rssm.img_step(start, action)
    assert len(calls) == depth
    with torch.no_grad():  # the same input x every time, the state fed back
        x = rssm.img_in(torch.cat([start["stoch"].flatten(1), action], -1))
        deter = start["deter"]
        for _ in range(depth):
            deter = rssm.cell(x, deter)
    torch.testing.assert_close(state["deter"], deter)


@pytest.mark.parametrize("kernel, minres", [(2, 2), (4, 4), (6, 8)])
def test_encoder_and_decoder_convolutions_follow_kernel_size_and_minres(spaces, kernel, minres):
    stages = int(np.log2(16 // minres))  # debug images are 16x16
    # Encoder and decoder take their own values: the other one keeps the debug preset's 4 / 4.
    enc_agent, _ = make_agent(spaces, "--encoder.kernel_size", str(kernel), "--encoder.minres", str(minres))
    dec_agent, _ = make_agent(spaces, "--decoder.kernel_size", str(kernel), "--decoder.minres", str(minres))
    convs = [m for m in enc_agent.wm.encoder.cnn.net if isinstance(m, nn.Conv2d)]
    assert len(convs) == stages and all(c.kernel_size == (kernel, kernel) for c in convs)
    image = torch.rand(2, 16, 16, 3)
    with torch.no_grad():
        out = enc_agent.wm.encoder.cnn.net(image.permute(0, 3, 1, 2))
    assert out.shape == (2, 4 * 2 ** (stages - 1), minres, minres)  # cnn_depth 4, doubled per stage
    assert enc_agent.wm.encoder.outdim == out[0].numel() + enc_agent.wm.encoder.mlp.outdim  # + the vectors' MLP
    default_convs = [m for m in dec_agent.wm.encoder.cnn.net if isinstance(m, nn.Conv2d)]
    assert len(default_convs) == 2 and default_convs[0].kernel_size == (4, 4)

    decoder = dec_agent.wm.heads["decoder"].cnn
    tconvs = [m for m in decoder.net if isinstance(m, nn.ConvTranspose2d)]
    assert len(tconvs) == stages and all(c.kernel_size == (kernel, kernel) for c in tconvs)
    assert decoder.linear.out_features == minres * minres * 4 * 2 ** (stages - 1)
    with torch.no_grad():
        assert decoder(torch.randn(2, 5, dec_agent.wm.rssm.feat_size)).shape == (2, 5, 16, 16, 3)
    default_tconvs = [m for m in enc_agent.wm.heads["decoder"].cnn.net if isinstance(m, nn.ConvTranspose2d)]
    assert len(default_tconvs) == 2 and default_tconvs[0].kernel_size == (4, 4)


@pytest.mark.parametrize("kernel", [3, 5])
def test_odd_kernel_size_keeps_the_image_sizes(spaces, kernel):
    """An odd kernel (the 2024 recipe's 5) builds networks whose images keep their sizes: the
    encoder's padding (k - 1) // 2 halves each stage exactly and the decoder's output padding k % 2
    doubles it back, so the loss runs and the decoder's image is the observation's size."""
    for part in ("encoder", "decoder"):
        agent, _ = make_agent(spaces, f"--{part}.kernel_size", str(kernel))
        network = agent.wm.encoder.cnn.net if part == "encoder" else agent.wm.heads["decoder"].cnn.net
        convs = [m for m in network if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
        assert convs and all(c.kernel_size == (kernel, kernel) for c in convs), part
        data = agent.wm.preprocess(fake_batch(spaces, batch=2, length=3))
        terms, _, _, metrics = agent.wm.loss(data)  # raises on a size mismatch anywhere
        assert torch.isfinite(models.scaled_sum(terms, agent.wm.scales))
        assert agent.wm.heads["decoder"](torch.zeros(1, agent.wm.rssm.feat_size))["image"].mode().shape == (
            1, 16, 16, 3)


def test_encoder_and_decoder_mlps_follow_their_layers_and_units(spaces):
    agent, _ = make_agent(spaces, *PROPRIO, "--encoder.mlp_layers", "3", "--encoder.mlp_units", "24",
                          "--decoder.mlp_layers", "4", "--decoder.mlp_units", "40")
    encoder, decoder = agent.wm.encoder.mlp, agent.wm.heads["decoder"]
    assert [m.out_features for m in linears(encoder)] == [24, 24, 24]
    assert linears(encoder)[0].in_features == 5  # cartpole: position 3 + velocity 2
    assert agent.wm.encoder.outdim == 24
    assert [m.out_features for m in linears(decoder.mlp)] == [40, 40, 40, 40]
    assert decoder.mlp_out.in_features == 40 and decoder.mlp_out.out_features == 5


def test_head_actor_and_critic_depths_follow_their_layers(spaces):
    agent, config = make_agent(spaces, "--reward_head.layers", "3", "--cont_head.layers", "4",
                               "--actor.layers", "5", "--critic.layers", "6")
    heads, behavior = agent.wm.heads, agent.task_behavior
    depths = {name: len(linears(module.mlp)) for name, module in (
        ("reward", heads["reward"]), ("cont", heads["cont"]), ("actor", behavior.actor),
        ("critic", behavior.critic), ("slow_critic", behavior.slow_critic))}
    assert depths == {"reward": 3, "cont": 4, "actor": 5, "critic": 6, "slow_critic": 6}
    for module in (heads["reward"], heads["cont"], behavior.actor, behavior.critic):
        assert all(m.out_features == config.units for m in linears(module.mlp))


def test_ensemble_follows_disag_models_layers_and_units(spaces):
    agent, _ = make_agent(spaces, "--expl_behavior", "plan2explore", "--disag_models", "4", "--disag_layers", "2",
                          "--disag_units", "24")
    ensemble = agent.expl_behavior.ensemble
    feat, target = agent.wm.rssm.feat_size, agent.expl_behavior.target_size
    assert [tuple(w.shape) for w in ensemble.weights] == [(4, feat, 24), (4, 24, 24), (4, 24, target)]
    assert ensemble(torch.randn(6, feat)).shape == (4, 6, target)


# ----------------------------------------------------------------------------------------------
# Distributions and loss terms
# ----------------------------------------------------------------------------------------------


def test_cnn_sigmoid_squashes_the_decoded_image_into_unit_range(spaces):
    plain, _ = make_agent(spaces, "--decoder.cnn_sigmoid", "False")
    squashed, _ = make_agent(spaces, "--decoder.cnn_sigmoid", "True")
    squashed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for agent in (plain, squashed):  # large weights: raw outputs far outside [0, 1]
            agent.wm.heads["decoder"].cnn.net[-1].weight.mul_(30)
        feat = torch.randn(4, plain.wm.rssm.feat_size, generator=torch.Generator().manual_seed(2))
        shifted = plain.wm.heads["decoder"](feat)["image"].mode()
        image = squashed.wm.heads["decoder"](feat)["image"].mode()
    assert shifted.min() < 0 and shifted.max() > 1  # no sigmoid: raw output + 0.5
    assert image.min() >= 0 and image.max() <= 1
    torch.testing.assert_close(image, torch.sigmoid(shifted - 0.5))


@pytest.mark.parametrize("vector_dist", ["symlog_mse", "mse"])
def test_decoder_dists_give_squared_errors_in_their_space(spaces, vector_dist):
    agent, _ = make_agent(spaces, "--decoder.mlp_keys", ".*", "--decoder.vector_dist", vector_dist)
    decoder = agent.wm.heads["decoder"]
    feat = torch.randn(2, 3, agent.wm.rssm.feat_size, generator=torch.Generator().manual_seed(3))
    target = {"position": torch.randn(2, 3, 3) * 50, "velocity": torch.randn(2, 3, 2) * 50,
              "image": torch.rand(2, 3, 16, 16, 3)}
    with torch.no_grad():
        dists = decoder(feat)
        raw = decoder.mlp_out(decoder.mlp(feat)).double().numpy()
        image = decoder.cnn(feat).double().numpy()
    space = (lambda x: np.sign(x) * np.log1p(np.abs(x))) if vector_dist == "symlog_mse" else (lambda x: x)
    for key, part in (("position", raw[..., :3]), ("velocity", raw[..., 3:])):
        want = -((part - space(target[key].double().numpy())) ** 2).sum(-1)
        np.testing.assert_allclose(dists[key].log_prob(target[key]).double().numpy(), want, rtol=1e-5)
    # The image's distribution: squared error summed over height, width and channels.
    want = -((image - target["image"].double().numpy()) ** 2).sum((-3, -2, -1))
    np.testing.assert_allclose(dists["image"].log_prob(target["image"]).double().numpy(), want, rtol=1e-5)
    # decoder.image_dist, which named that one choice and was read by nothing, is gone
    with pytest.raises(tools.ConfigError, match="Unknown config key '--decoder.image_dist'"):
        make_config("--decoder.image_dist", "mse")


def test_reward_and_cont_loss_scales_multiply_their_terms(spaces):
    base, _ = make_agent(spaces)
    scaled, _ = make_agent(spaces, "--reward_head.loss_scale", "2.0", "--cont_head.loss_scale", "3.0")
    scaled.load_state_dict(base.state_dict())
    data = base.wm.preprocess(fake_batch(spaces))
    results = []
    for agent in (base, scaled):
        torch.manual_seed(4)  # the same posterior samples
        terms, _, _, metrics = agent.wm.loss(data)
        loss = models.scaled_sum(terms, agent.wm.scales)
        results.append((loss.item(), {k: v.item() for k, v in metrics.items()}))
    (loss1, m1), (loss2, m2) = results
    assert m1["rew_loss"] > 0 and m1["con_loss"] > 0
    assert m2["rew_loss"] == pytest.approx(2 * m1["rew_loss"], rel=1e-6)
    assert m2["con_loss"] == pytest.approx(3 * m1["con_loss"], rel=1e-6)
    assert m2["image_loss"] == pytest.approx(m1["image_loss"], rel=1e-6)
    assert m2["kl_loss"] == pytest.approx(m1["kl_loss"], rel=1e-6)
    assert loss2 - loss1 == pytest.approx(m1["rew_loss"] + 2 * m1["con_loss"], rel=1e-4)


def kl_case(spaces, reference, dyn_scale, rep_scale, free):
    """World-model loss of one step (T = 1) from a zero initial state, the heads kept off the
    representation: the prior's output layers then learn only from the dyn term, the posterior's
    and the encoder only from the rep term."""
    agent, _ = make_agent(spaces, "--initial", "zeros", "--stop_grad_heads", "decoder,reward,cont",
                          "--dyn_scale", str(dyn_scale), "--rep_scale", str(rep_scale), "--kl_free", str(free))
    agent.load_state_dict(reference.state_dict())
    wm = agent.wm
    data = wm.preprocess(fake_batch(spaces, batch=8, length=1, seed=5))
    _, _, _, metrics = wm.loss(data)
    wm.zero_grad(set_to_none=True)
    models.scaled_sum(wm.loss(data)[0], wm.scales).backward()
    rssm = wm.rssm
    prior_grad = flat_grad([*rssm.img_out.parameters(), *rssm.img_stats.parameters()])
    post_grad = flat_grad([*rssm.obs_out.parameters(), *rssm.obs_stats.parameters(), *wm.encoder.parameters()])
    with torch.no_grad():  # per-step KL[post || prior] from the logits, in numpy
        post = rssm.observe(wm.embed(data), data["action"], data["is_first"])
        prior = rssm.prior(post["deter"])
        p = torch.log_softmax(post["logit"], -1).double().numpy()
        q = torch.log_softmax(prior["logit"], -1).double().numpy()
    kl = (np.exp(p) * (p - q)).sum((-2, -1))  # (B, T)
    want = (dyn_scale * np.maximum(free, kl) + rep_scale * np.maximum(free, kl)).mean()
    assert metrics["kl_loss"].item() == pytest.approx(want, rel=1e-5)
    return prior_grad, post_grad, kl


def test_dyn_scale_rep_scale_and_kl_free_weigh_the_two_kl_terms(spaces):
    reference, _ = make_agent(spaces, "--initial", "zeros")
    prior1, post1, kl = kl_case(spaces, reference, 1.0, 1.0, 0.0)
    assert prior1.abs().sum() > 0 and post1.abs().sum() > 0
    prior, post, _ = kl_case(spaces, reference, 2.0, 0.5, 0.0)
    torch.testing.assert_close(prior, 2 * prior1)  # dyn_scale scales the prior's gradient only
    torch.testing.assert_close(post, 0.5 * post1)  # rep_scale the posterior's only
    prior, post, _ = kl_case(spaces, reference, 0.0, 1.0, 0.0)
    assert prior.abs().sum() == 0 and post.abs().sum() > 0
    prior, post, _ = kl_case(spaces, reference, 1.0, 0.0, 0.0)
    assert prior.abs().sum() > 0 and post.abs().sum() == 0
    # Free nats: steps whose KL is below kl_free give no gradient; above every step, none at all.
    assert kl.min() < np.median(kl) < kl.max()
    prior, post, _ = kl_case(spaces, reference, 1.0, 1.0, float(np.median(kl)))
    assert 0 < prior.abs().sum() < prior1.abs().sum() and 0 < post.abs().sum() < post1.abs().sum()
    prior, post, _ = kl_case(spaces, reference, 1.0, 1.0, float(kl.max()) + 1.0)
    assert prior.abs().sum() == 0 and post.abs().sum() == 0


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_unimix_ratio_mixes_uniform_into_the_latent_categoricals(spaces, ratio):
    agent, config = make_agent(spaces, "--unimix_ratio", str(ratio))
    rssm = agent.wm.rssm
    with torch.no_grad():
        state = rssm.initial(5)
        state["deter"] = torch.randn(5, rssm.deter, generator=torch.Generator().manual_seed(6))
        prior = rssm.img_step(state, torch.zeros(5, 1))
        raw = rssm.img_stats(rssm.img_out(prior["deter"])).reshape(5, config.dyn_stoch, config.dyn_discrete)
    want = (1 - ratio) * torch.softmax(raw, -1) + ratio / config.dyn_discrete
    torch.testing.assert_close(torch.softmax(prior["logit"], -1), want)
    assert torch.softmax(raw, -1).min() < 0.3 / config.dyn_discrete  # the mixture is visible at 0.3


@pytest.mark.parametrize("ratio", [0.0, 0.2])
def test_actor_unimix_ratio_mixes_uniform_into_discrete_actions(spaces, ratio):
    four_actions = wrappers.OneHotSpace(4)  # one-hot actions, as for Atari
    agent, _ = make_agent((spaces[0], four_actions), "--actor.dist", "onehot", "--actor.std", "none",
                          "--actor.unimix_ratio", str(ratio), "--actor.outscale", "10.0")
    actor = agent.task_behavior.actor
    feat = torch.randn(6, agent.wm.rssm.feat_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        raw = torch.softmax(actor.raw(feat), -1)
        probs = actor(feat).probs
    assert raw.min() < 0.2 / 4  # far from uniform, so that the mixture shows
    torch.testing.assert_close(probs, (1 - ratio) * raw + ratio / 4)


def test_eval_state_mean_makes_evaluation_use_the_posterior_mode(spaces):
    obs = {k: v[:, 0] for k, v in fake_batch(spaces, batch=64, length=1, seed=8).items()
           if k not in ("action", "reward")}
    for eval_state_mean in (True, False):
        agent, _ = make_agent(spaces, "--eval_state_mean", str(eval_state_mean), "--eval_sample", "False")
        outputs = {}
        for mode in ("eval", "train"):
            for seed in (1, 2):
                torch.manual_seed(seed)
                action, (latent, _, _) = agent.policy(obs, None, mode)
                outputs[mode, seed] = action, latent
        (eval1, latent1), (eval2, latent2) = outputs["eval", 1], outputs["eval", 2]
        mode_stoch = nn.functional.one_hot(latent1["logit"].argmax(-1), latent1["stoch"].shape[-1]).float()
        if eval_state_mean:
            np.testing.assert_array_equal(eval1, eval2)
            assert torch.equal(latent1["stoch"], mode_stoch)
        else:
            assert not np.array_equal(eval1, eval2)
            assert not torch.equal(latent1["stoch"], latent2["stoch"])
        # Training always samples.
        assert not np.array_equal(outputs["train", 1][0], outputs["train", 2][0])


def test_eval_sample_chooses_between_a_policy_sample_and_its_mode(spaces):
    """v1 acts in evaluation exactly as in training, with a sample of the task policy; eval_sample
    False takes the mode, tanh of the actor's mean output."""
    obs = {k: v[:, 0] for k, v in fake_batch(spaces, batch=32, length=1, seed=9).items()
           if k not in ("action", "reward")}
    for eval_sample in (True, False):
        agent, _ = make_agent(spaces, "--eval_sample", str(eval_sample))
        actions = {}
        for mode in ("eval", "train"):
            for seed in (1, 2):
                torch.manual_seed(seed)
                actions[mode, seed], (latent, _, _) = agent.policy(obs, None, mode)
                if mode == "eval" and seed == 1:
                    with torch.no_grad():
                        raw = agent.task_behavior.actor.raw(agent.wm.rssm.get_feat(latent))
                    plain_mode = np.tanh(raw[:, :agent.act_size].numpy())
        if eval_sample:
            np.testing.assert_array_equal(actions["eval", 1], actions["train", 1])  # the same draw
            assert not np.array_equal(actions["eval", 1], actions["eval", 2])
        else:
            np.testing.assert_allclose(actions["eval", 1], plain_mode, rtol=1e-5, atol=1e-6)
            assert not np.array_equal(actions["eval", 1], actions["train", 1])


@pytest.mark.parametrize("discrete", [False, True])
def test_auto_actor_dist_and_imag_gradient_follow_the_action_space(spaces, discrete):
    """v1's actor_dist_disc/cont and actor_grad_disc/cont: onehot + reinforce for discrete actions,
    normal + dynamics for continuous ones; explicit values stay."""
    act_space = wrappers.OneHotSpace(4) if discrete else spaces[1]
    obs_space = spaces[0]
    agent, config = make_agent((obs_space, act_space), "--actor.dist", "auto", "--imag_gradient", "auto")
    want = ("onehot", "reinforce") if discrete else ("normal", "dynamics")
    assert (config.actor.dist, config.imag_gradient) == want
    assert agent.task_behavior.actor.kind == want[0] and {"actor.dist", "imag_gradient"} <= set(agent.resolved)
    assert cfg.actor_note(config, agent.resolved) == (
        f"{want[0]} distribution, {want[1]} gradient (actor.dist and imag_gradient auto: from the action space)")
    # Behaviour: REINFORCE rollouts record no graph through the dynamics; dynamics rollouts do.
    start = {k: v.detach() for k, v in agent.wm.rssm.initial(3).items()}
    with models.frozen(agent.wm):  # as ActorCritic.loss imagines
        feat, _, _ = agent.task_behavior.imagine(start)
    assert feat[-1].requires_grad is (not discrete)
    other = "dynamics" if discrete else "reinforce"
    agent, config = make_agent((obs_space, act_space), "--imag_gradient", other)
    assert config.imag_gradient == other and "imag_gradient" not in agent.resolved
    assert cfg.actor_note(config, agent.resolved).endswith("(actor.dist auto: from the action space)")
    wrong, kind = ("normal", "discrete") if discrete else ("onehot", "continuous")
    with pytest.raises(tools.ConfigError, match=f"Invalid value '{wrong}' for --actor.dist: task "
                                                   f"'dmc_cartpole_balance' has {kind} actions; use --actor.dist "
                                                   f"{want[0]}"):
        make_agent((obs_space, act_space), "--actor.dist", wrong)


def test_compile_auto_compiles_on_cuda_and_not_for_a_short_cpu_run_and_explicit_values_stay(spaces):
    agent, config = make_agent(spaces, "--compile", "auto", "--device", "cpu")  # the debug preset: 600 frames
    assert config.compile is False and agent.compiled == [] and "compile" in agent.resolved
    note = cfg.compile_note(config, agent.resolved["compile"])
    assert note.startswith("off (auto: on a CPU: "), note
    assert "less than the ~290 s warm-up of compiling the whole update" in note, note
    cuda, resolved = compilation.resolve_auto(make_config("--compile", "auto", "--device", "cuda:0"), spaces[1],
                                              spaces[0])
    assert "compile" in resolved and cuda.compile == "update"
    explicit, resolved = compilation.resolve_auto(make_config("--compile", "True", "--device", "cpu"), spaces[1],
                                                  spaces[0])
    assert "compile" not in resolved and explicit.compile is True
    assert make_config("--compile", "false").compile is False
    assert cfg.parse(["--device", "cpu"]).compile == "auto"  # the default


def test_default_observation_keys_route_images_to_the_cnn_and_vectors_to_the_mlp():
    """v1's defaults: encoder and decoder take every key (.*), rank-3 observations to the CNN,
    rank 0-1 to the MLP; presets narrow them."""
    space = {"image": gymnasium.spaces.Box(0, 255, (16, 16, 3), np.uint8),
             "depth": gymnasium.spaces.Box(0, 255, (16, 16, 1), np.uint8),
             "position": gymnasium.spaces.Box(-1, 1, (5,), np.float32),
             "height": gymnasium.spaces.Box(-1, 1, (), np.float32),
             "log_score": gymnasium.spaces.Box(-1, 1, (), np.float32),
             **{k: gymnasium.spaces.Box(0, 1, (), bool) for k in ("is_first", "is_last", "is_terminal")}}
    shapes = {}
    for preset in ([], ["dmc_vision"], ["dmc_proprio"]):
        config = cfg.parse([*(["--configs", *preset] if preset else []), "--encoder.cnn_depth", "2",
                            "--decoder.cnn_depth", "2", "--encoder.mlp_units", "8", "--decoder.mlp_units", "8"])
        encoder = networks.MultiEncoder(space, config.encoder)
        decoder = networks.MultiDecoder(8, space, config.decoder)
        shapes[tuple(preset)] = (set(encoder.cnn_shapes), set(encoder.mlp_shapes),
                                 set(decoder.cnn_shapes), set(decoder.mlp_shapes))
    assert shapes[()] == ({"image", "depth"}, {"position", "height"}) * 2
    assert shapes[("dmc_vision",)] == ({"image"}, set()) * 2
    assert shapes[("dmc_proprio",)] == (set(), {"position", "height"}) * 2


@pytest.mark.parametrize("horizon", [3, 7])
def test_imag_horizon_is_the_length_of_imagined_trajectories(spaces, horizon):
    agent, _ = make_agent(spaces, "--imag_horizon", str(horizon))
    rssm, behavior = agent.wm.rssm, agent.task_behavior
    steps, img_step = [], rssm.img_step
    rssm.img_step = lambda *args, **kwargs: steps.append(1) or img_step(*args, **kwargs)
    with torch.no_grad():
        feat, action, _ = behavior.imagine(rssm.initial(6))
    assert len(steps) == horizon
    assert feat.shape[:2] == action.shape[:2] == (horizon + 1, 6)


# ----------------------------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------------------------

OPTIMIZERS = {  # name: (the agent's optimizer, its lr, eps and grad_clip keys)
    "model": (lambda agent: agent.optimizers()["model"], "--model_lr", "--opt_eps", "--grad_clip"),
    "actor": (lambda agent: agent.optimizers()["task/actor"], "--actor.lr", "--actor.eps", "--actor.grad_clip"),
    "critic": (lambda agent: agent.optimizers()["task/critic"], "--critic.lr", "--critic.eps", "--critic.grad_clip"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lr_eps_and_grad_clip_set_each_optimizer_and_only_it(spaces, name):
    get, lr_key, eps_key, clip_key = OPTIMIZERS[name]
    agent, _ = make_agent(spaces, lr_key, "0.03", eps_key, "0.01", clip_key, "0.5")
    default, _ = make_agent(spaces)
    optimizer = get(agent)
    for other in OPTIMIZERS:
        group = OPTIMIZERS[other][0](agent).opt.param_groups[0]
        expected = OPTIMIZERS[other][0](default).opt.param_groups[0]
        want = (0.03, 0.01) if other == name else (expected["lr"], expected["eps"])
        assert (group["lr"], group["eps"]) == want, other
        assert OPTIMIZERS[other][0](agent).clip == (0.5 if other == name else OPTIMIZERS[other][0](default).clip)
    # One step on a linear loss: gradient c, clipped to norm 0.5, then Adam's first step
    # p -= lr * g / (|g| + eps), in which eps makes the size of the clipped gradient matter.
    gen = torch.Generator().manual_seed(9)
    params = optimizer.params
    coeffs = [torch.randn(p.shape, generator=gen) * 3 for p in params]
    before = [p.detach().clone() for p in params]
    metrics = optimizer(sum((c * p).sum() for c, p in zip(coeffs, params)))
    norm = float(np.sqrt(sum((c.double() ** 2).sum().item() for c in coeffs)))
    assert norm > 0.5
    assert metrics[f"{name}_grad_norm"].item() == pytest.approx(norm, rel=1e-4)
    assert float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))) == pytest.approx(0.5, rel=1e-4)
    for c, p, old in zip(coeffs, params, before):
        g = c.double() * 0.5 / (norm + 1e-6)
        np.testing.assert_allclose((p.detach() - old).double().numpy(), (-0.03 * g / (g.abs() + 0.01)).numpy(),
                                   rtol=1e-3, atol=3e-7)  # float32 rounding of p + delta


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_opt_and_weight_decay_choose_coupled_or_decoupled_decay(spaces, opt):
    agent, _ = make_agent(spaces, "--opt", opt, "--weight_decay", "0.2", "--model_lr", "0.1")
    cls = optim.AdamW if opt == "adamw" else optim.Adam
    optimizers = [agent.optimizers()[name] for name in ("model", "task/actor", "task/critic")]
    assert all(type(o.opt) is cls for o in optimizers)
    assert optimizers[0].opt.param_groups[0]["weight_decay"] == 0.2
    assert [o.opt.param_groups[0]["weight_decay"] for o in optimizers[1:]] == [0.0, 0.0]  # world model only
    # A step with zero loss gradient leaves only the decay: AdamW shrinks every weight by lr * wd,
    # Adam adds wd * p to the gradient, which its normalisation turns into a step of about lr.
    params = optimizers[0].params
    before = [p.detach().clone().double() for p in params]
    optimizers[0](sum((p * 0).sum() for p in params))
    for p, old in zip(params, before):
        if opt == "adamw":
            want = old * (1 - 0.1 * 0.2)
        else:
            grad = 0.2 * old
            want = old - 0.1 * grad / (grad.abs() + 1e-8)
        np.testing.assert_allclose(p.detach().double().numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
    assert any((p.detach().double() - old).abs().max() > 1e-3 for p, old in zip(params, before))


# ----------------------------------------------------------------------------------------------
# Replay and episode folders (Trainer without environments)
# ----------------------------------------------------------------------------------------------


def write_episodes(directory, rewards, length=10):
    """One episode per reward value, written oldest first; every step carries the episode's reward."""
    for value in rewards:
        storage.save_episode(directory, {"reward": np.full(length, value, np.float32),
                                       "is_first": np.arange(length) == 0,
                                       "x": np.full((length, 2), value, np.float32)})


def trainer_of(config, logdir):
    """A Trainer with no environments (the stored episodes are taken on trust), of a real agent whose
    spaces are those of the episodes write_episodes stores."""
    obs_space = {"x": gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32)}
    agent = dreamer.Dreamer(obs_space, gymnasium.spaces.Box(-1, 1, (1,), np.float32), config)
    return dreamer.Trainer(config, agent, logdir, [], [])


def stream_rewards(replay):
    stream = replay.streams[0]
    return stream.data["reward"][stream.indices(np.array([0]), len(stream))[0]].tolist()


@pytest.mark.parametrize("size", [25, 1000])
def test_dataset_size_caps_the_replay_and_drops_the_oldest_steps(tmp_path, size):
    write_episodes(tmp_path / "train_eps", [0, 1, 2, 3])
    config = make_config("--dataset_size", str(size))
    trainer = trainer_of(config, tmp_path)
    if size == 25:  # the newest episodes that fit: 2 and 3
        assert stream_rewards(trainer.replay) == [2] * 10 + [3] * 10
    else:
        assert stream_rewards(trainer.replay) == [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10
    for _ in range(10):
        trainer.replay.add({"reward": np.float32(9), "is_first": False, "x": np.zeros(2, np.float32)})
    if size == 25:
        assert len(trainer.replay) == 25 and stream_rewards(trainer.replay) == [2] * 5 + [3] * 10 + [9] * 10
    else:
        assert len(trainer.replay) == 50


def test_offline_evaldir_replaces_the_eval_episodes_for_open_loop_videos(tmp_path):
    write_episodes(tmp_path / "eval_eps", [5, 5])
    write_episodes(tmp_path / "offline", [7, 7, 7])
    own = trainer_of(make_config(), tmp_path)
    assert stream_rewards(own.stored.eval_replay) == [5] * 20
    config = make_config("--offline_evaldir", str(tmp_path / "offline"))
    trainer = trainer_of(config, tmp_path)
    assert stream_rewards(trainer.stored.eval_replay) == [7] * 30
    assert trainer.stored.evaldir == tmp_path / "eval_eps"  # new evaluation episodes still go to the run's folder
    assert (trainer.stored.eval_replay.sample(6, config.batch_length)["reward"] == 7).all()  # what eval/openl shows


def test_episode_folders_expand_home_like_logdir(tmp_path, monkeypatch):
    """--logdir ~/run means the home folder (setup() expands it); so must the episode folders,
    which a preset in configs.yaml can only write with ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_episodes(tmp_path / "offline_train", [1, 1])
    write_episodes(tmp_path / "offline_eval", [2])
    config = make_config("--traindir", "~/train", "--evaldir", "~/eval", "--offline_traindir", "~/offline_train",
                         "--offline_evaldir", "~/offline_eval")
    trainer = trainer_of(config, tmp_path / "run")
    assert (trainer.stored.traindir, trainer.stored.evaldir) == (tmp_path / "train", tmp_path / "eval")
    assert len(trainer.replay) == 20 and len(trainer.stored.eval_replay) == 10


# ----------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure, restart", [("restart", True), ("stop", False)])
def test_env_failure_decides_whether_parallel_workers_restart(failure, restart):
    config = make_config("--parallel", "True", "--env_failure", failure)
    created = parallel.make_envs(config, "train", 2)
    try:
        assert [type(env) for env in created] == [parallel.Parallel] * 2
        assert [env.restart for env in created] == [restart] * 2
        assert [env.index for env in created] == [0, 1]
    finally:
        for env in created:
            env.close()


# ----------------------------------------------------------------------------------------------
# Asynchronous training (runs: tests/test_async.py, which also checks actor_sync_every's interval)
# ----------------------------------------------------------------------------------------------


def test_asynchronous_chooses_the_train_schedule_and_the_waits_it_times(tmp_path):
    sync = trainer_of(make_config(), tmp_path / "a")
    assert type(sync.schedules["train"]) is tools.Ratio and set(sync.stopwatch.fractions()) == {"learner", "env"}
    trainer = trainer_of(make_config("--asynchronous"), tmp_path / "b")
    assert type(trainer.schedules["train"]) is tools.SamplesPerInsert and trainer.schedules["train"].ratio == 32
    assert set(trainer.stopwatch.fractions()) == {"learner", "env", "learner_wait", "env_wait"}


@pytest.mark.parametrize("tolerance", [1, 5])
def test_ratio_tolerance_is_how_far_the_learner_may_run_ahead_or_behind(tmp_path, tolerance):
    config = make_config("--asynchronous", "--ratio_tolerance", str(tolerance))
    limiter = trainer_of(config, tmp_path).schedules["train"]
    ahead = 0
    while limiter.can_sample():  # no steps inserted yet: updates on credit only
        limiter.sampled()
        ahead += 1
    assert ahead == tolerance and limiter.can_insert()
    behind = trainer_of(config, tmp_path).schedules["train"]
    steps_per_update = config.batch_size * config.batch_length // config.train_ratio  # 200 / 32 -> 6.25
    behind.inserted(int(tolerance * steps_per_update) + 6)  # owed: just over `tolerance` updates, none made
    assert not behind.can_insert() and behind.can_sample()


@pytest.mark.parametrize("flags, message", [
    (["--ratio_tolerance", "0.5"], "Invalid value '0.5' for --ratio_tolerance; valid: a number >= 1"),
    (["--actor_sync_every", "0"], "Invalid value '0' for --actor_sync_every; valid: a whole number >= 1"),
    (["--offline_traindir", "/nonexistent"], "Invalid value 'True' for --asynchronous; valid: False with"),
])
def test_asynchronous_keys_refuse_bad_values_before_writing_anything(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        dreamer.main(["--configs", "debug", "--asynchronous", "--logdir", str(tmp_path / "run"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# Seeds, determinism and batch shapes: the first update of a real run
# ----------------------------------------------------------------------------------------------


class FirstUpdate(Exception):
    """Ends a run right after its first update."""


def first_update(logdir, *flags):
    """Run dreamer.main until its first update; return that update's batch, metrics and whether
    deterministic algorithms were on."""
    seen, train_step = {}, models.Update.train_step

    def recording(self, batch):
        metrics, _ = train_step(self, batch)
        seen.update(batch={k: np.array(v) for k, v in batch.items()},
                    metrics={k: v.detach().clone() for k, v in metrics.items()},
                    deterministic=torch.are_deterministic_algorithms_enabled())
        raise FirstUpdate

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models.Update, "train_step", recording)
        with pytest.raises(FirstUpdate):
            dreamer.main(["--configs", "debug", "--logdir", str(logdir), "--steps", "1000", "--eval_episode_num",
                          "0", "--batch_size", "3", "--batch_length", "7", *flags])
    return seen


@pytest.fixture(scope="module")
def first_updates(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_updates")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        return {"seed0": first_update(root / "a", "--seed", "0"),
                "seed0_again": first_update(root / "b", "--seed", "0"),
                "seed1": first_update(root / "c", "--seed", "1"),
                "deterministic": first_update(root / "d", "--seed", "0", "--deterministic_run", "True")}
    finally:
        torch.use_deterministic_algorithms(previous)


def test_same_seed_gives_the_same_first_update_and_another_seed_another(first_updates):
    a, b, c = first_updates["seed0"], first_updates["seed0_again"], first_updates["seed1"]
    assert a["batch"].keys() == b["batch"].keys() == c["batch"].keys()
    for key in a["batch"]:
        np.testing.assert_array_equal(a["batch"][key], b["batch"][key], err_msg=key)
    for key in a["metrics"]:
        assert torch.equal(a["metrics"][key], b["metrics"][key]), key
    # Another seed: another start state of the environment, other random actions, other weights.
    # (The 16x16 images of the two runs' first steps can coincide: the cart barely moves.)
    assert not np.array_equal(a["batch"]["position"][:, 0], c["batch"]["position"][:, 0])
    assert not np.array_equal(a["batch"]["action"], c["batch"]["action"])
    for key in ("model_loss", "image_loss", "actor_loss", "critic_loss"):
        assert not torch.equal(a["metrics"][key], c["metrics"][key]), key


def test_batch_size_and_batch_length_shape_the_replayed_batch(first_updates):
    batch = first_updates["seed0"]["batch"]
    assert {key: value.shape[:2] for key, value in batch.items()} == {key: (3, 7) for key in batch}
    assert batch["image"].shape == (3, 7, 16, 16, 3) and batch["action"].shape == (3, 7, 1)


def test_replay_context_adds_steps_that_carry_the_stored_latent(tmp_path, first_updates):
    assert not any(key.startswith("latent_") for key in first_updates["seed0"]["batch"])  # 0: nothing stored
    batch = first_update(tmp_path, "--seed", "0", "--replay_context", "2")["batch"]
    assert {key: value.shape[:2] for key, value in batch.items()} == {key: (3, 9) for key in batch}
    assert batch["latent_deter"].shape == (3, 9, 32) and batch["latent_stoch"].shape == (3, 9, 4, 4)


def test_deterministic_run_turns_on_deterministic_algorithms_for_training(first_updates):
    assert first_updates["deterministic"]["deterministic"] is True
    assert first_updates["seed0"]["deterministic"] is False
    for key, value in first_updates["deterministic"]["metrics"].items():
        assert torch.isfinite(value).all(), key


# ----------------------------------------------------------------------------------------------
# Episode folders and videos in real runs
# ----------------------------------------------------------------------------------------------


def event_tags(logdir):
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator.Tags()


def read_metrics(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def episode_files(directory):
    return sorted(p.name for p in pathlib.Path(directory).glob("*.npz"))


@pytest.fixture(scope="module")
def folder_runs(tmp_path_factory):
    """Run A collects into its own --traindir/--evaldir without videos; run B then trains offline
    on A's episodes (and takes eval_openl from A's evaluation episodes), with videos."""
    root = tmp_path_factory.mktemp("folder_runs")
    common = ["--configs", "debug", "--time_limit", "40", "--eval_every", "1000"]
    dreamer.main([*common, "--logdir", str(root / "a"), "--steps", "80", "--traindir", str(root / "train"),
                  "--evaldir", str(root / "eval"), "--video_pred_log", "False"])
    collected = {"train": episode_files(root / "train"), "eval": episode_files(root / "eval")}
    dreamer.main([*common, "--logdir", str(root / "b"), "--steps", "40", "--offline_traindir", str(root / "train"),
                  "--offline_evaldir", str(root / "eval")])
    return root, collected


def test_traindir_and_evaldir_receive_the_episodes_instead_of_logdir(folder_runs):
    root, collected = folder_runs
    assert len(collected["train"]) == 2 and len(collected["eval"]) == 2  # 80 frames of 40; eval at start, end
    assert not (root / "a" / "train_eps").exists() and not (root / "a" / "eval_eps").exists()
    with np.load(root / "train" / collected["train"][0]) as episode:
        assert len(episode["reward"]) == 21 and episode["image"].shape == (21, 16, 16, 3)


def test_video_pred_log_false_writes_no_videos(folder_runs):
    root, _ = folder_runs
    tags = event_tags(root / "a")
    assert "eval/return" in tags["scalars"] and "world_model/model_loss" in tags["scalars"]
    assert tags["images"] == []
    assert set(event_tags(root / "b")["images"]) == {"eval/policy", "eval/openl", "train/openl"}  # default True


def test_offline_traindir_trains_on_the_folder_and_collects_nothing(folder_runs):
    root, collected = folder_runs
    assert episode_files(root / "train") == collected["train"]  # the folder is read, never written
    assert not (root / "b" / "train_eps").exists()
    rows = read_metrics(root / "b")
    assert rows[-1]["step"] == 40 and rows[-1]["perf/updates"] > 0
    steps = sum(len(np.load(root / "train" / name)["reward"]) for name in collected["train"])
    assert rows[-1]["perf/replay_steps"] == steps == 42
    assert all("train/return" not in row for row in rows)  # no training episodes were played
    assert episode_files(root / "eval") == collected["eval"] and len(episode_files(root / "b" / "eval_eps")) == 2
