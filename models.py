"""The world model and the actor-critic that learns inside it (Sections 2 and 3 of the paper).

In the order a reader looks for them: precision and profiling helpers, 1. the world model and the
one table of loss scales, 2. the λ-return and return normalisation, 3. the actor-critic, 4. the
update: `Update.train_step`, the whole loss in the official order (# World model, # Imagination,
# Replay) and the optimizers each update mode steps it with, 5. the replay context, 6. optimizers,
7. compilation, and last the choices this module owns and the settling of their `auto` values.
"""

import contextlib
import copy

import numpy as np
import torch
from torch import nn

import launch
import networks
import storage
import tools

# ==================================================================================================
# Precision and profiling
# ==================================================================================================


@contextlib.contextmanager
def frozen(*modules):
    """Turn off gradients of `modules` so that a loss backpropagating through them (the actor's
    dynamics gradient) computes no gradients for their parameters."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def profiled(name):
    """Label a phase of the update for torch.profiler (benchmarks/train_speed.py); nearly free
    when no profiler runs."""
    return torch.profiler.record_function(name)


PRECISIONS = (16, 32, "bf16")  # config.precision


def compute_dtype(config):
    """The dtype the update computes in under `precision`: None for 32 (no autocast); bfloat16 for
    bf16 on any device (the official code's compute type); float16 for 16 on CUDA, bfloat16 for 16
    on a CPU (float16 matmuls are slow there, and bfloat16 needs no scaler)."""
    if config.precision == 32:
        return None
    cuda = torch.device(config.device).type == "cuda"
    return torch.float16 if config.precision == 16 and cuda else torch.bfloat16


def autocast(config):
    """Autocast to compute_dtype(config); a no-op for precision 32. Parameters, optimizer moments,
    normalisation statistics (networks.LayerNorm, RMSNorm, ReturnNorm) and distribution parameters
    (the tools distributions) stay float32."""
    dtype = compute_dtype(config)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=dtype)


def use_scaler(config):
    """A gradient scaler only for float16 (precision 16 on CUDA): bfloat16 has float32's range."""
    return config.precision == 16 and torch.device(config.device).type == "cuda"


def precision_note(config):
    """The start-up summary's line on what runs under `precision`."""
    dtype = compute_dtype(config)
    if dtype is None:
        return f"{config.precision} (float32)"
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    where = " on a CPU" if config.precision == 16 and torch.device(config.device).type != "cuda" else ""
    scaler = "gradient scaler" if use_scaler(config) else "no scaler"
    return f"{config.precision} ({name} autocast{where}, {scaler}; parameters float32)"


VALUE_DISTS = ("symlog_disc", "symexp_twohot", "symlog_mse")  # reward and critic heads



# ==================================================================================================
# 1. World model
# ==================================================================================================


# The one table of the loss's terms, named as the official Agent.loss names them: each term's scale
# (a config key, or a fixed number) and the optimizer that steps it under update 'sequential' (under
# 'joint' one optimizer steps them all). `rec` stands for one term per decoded observation key, named
# after the key, as the official `loss_scales.rec`. Each term is computed by one function
# (WorldModel.HEAD_LOSSES, networks.RSSM.kl_loss, ActorCritic.loss, ActorCritic.replay_loss), and
# Update.train_step checks on every update that the terms computed are exactly these. Changing a
# scale is one line here or in configs.yaml; adding a term is its function and a row.
LOSS_TERMS = {
    "rec": (1.0, "model"),
    "rew": ("reward_head.loss_scale", "model"),
    "con": ("cont_head.loss_scale", "model"),
    "dyn": ("dyn_scale", "model"),
    "rep": ("rep_scale", "model"),
    "policy": (1.0, "actor"),
    "value": (1.0, "critic"),
    "repval": ("critic.repval", "critic"),  # 0 (v1): the replay value loss is not computed
}


def loss_scales(config, decoder_keys):
    """{term: scale} of LOSS_TERMS for this config, `rec` expanded to each decoded key."""
    flat = tools.flatten(config.to_dict())
    scales = {}
    for term, (scale, _) in LOSS_TERMS.items():
        value = flat[scale] if isinstance(scale, str) else scale
        scales.update(dict.fromkeys(decoder_keys, value) if term == "rec" else {term: value})
    return scales


def terms_of(optimizer, scales):
    """The terms of `scales` (loss_scales) that `optimizer` ('model', 'actor' or 'critic') steps
    under update 'sequential'."""
    return tuple(term for term in scales if LOSS_TERMS.get(term, LOSS_TERMS["rec"])[1] == optimizer)


class WorldModel(nn.Module):
    """Encoder, RSSM and prediction heads (decoder, reward, continue), trained on replayed sequences."""

    def __init__(self, obs_space, act_space, config):
        super().__init__()
        self.config = config
        self.encoder = networks.MultiEncoder(obs_space, config.encoder)
        self.rssm = networks.RSSM(config, self.encoder.outdim, act_space.shape[0])
        feat = self.rssm.feat_size
        self.heads = nn.ModuleDict({
            "decoder": networks.MultiDecoder(feat, obs_space, config.decoder, config.dyn_deter),
            "reward": networks.Head(feat, (), config.reward_head.layers, config.units, config.act, config.norm,
                                    config.reward_head.dist, config.reward_head.outscale),
            "cont": networks.Head(feat, (1,), config.cont_head.layers, config.units, config.act, config.norm,
                                  "binary", config.cont_head.outscale),
        })
        for name in config.grad_heads:
            if name not in self.heads:
                raise tools.ConfigError(f"Unknown grad_heads entry '{name}'; valid: {', '.join(self.heads)}")
        unknown = [name for name in self.heads if name not in self.HEAD_LOSSES]
        if unknown:
            raise ValueError(f"World-model head '{unknown[0]}' has no loss in WorldModel.HEAD_LOSSES; "
                             f"known: {', '.join(self.HEAD_LOSSES)}")
        networks.reinit(self, config.winit)
        self.scales = loss_scales(config, self.heads["decoder"].keys)  # every term of every loss
        self.terms = terms_of("model", self.scales)  # this model's own

    def preprocess(self, obs):
        """numpy/tensor batch -> float tensors on the device; images to [0, 1], cont = 1 - terminal."""
        device = self.rssm.img_stats.weight.device
        data = {}
        for key, value in obs.items():
            if key.startswith("log_"):
                continue
            # A tensor is already on the device (storage.Prefetcher) or is copied there.
            value = torch.as_tensor(value if isinstance(value, torch.Tensor) else np.asarray(value), device=device)
            data[key] = value.float() / 255.0 if value.dtype == torch.uint8 else value.float()
        if "is_terminal" in data:
            data["cont"] = 1.0 - data["is_terminal"]
        return data

    def embed(self, data):  # dict of (B, T, ...) -> (B, T, E)
        lead = data["is_first"].shape
        flat = {k: v.reshape(-1, *v.shape[len(lead):]) for k, v in data.items()}
        return self.encoder(flat).reshape(*lead, -1)

    def loss(self, data, start=None):
        """The world model's loss terms (Eq. 4-5) on a batch (B, T, ...) filtered from the latent
        `start` (deter (B, D), stoch (B, S[, C]); None: the initial state): {term: (B, T)}, unscaled
        (models.Update scales and sums them), the posterior, the embedding and metrics (the scaled
        terms' means; dyn_loss and rep_loss are the KLs before the free nats)."""
        config = self.config
        embed = self.embed(data)  # (B, T, E)
        post, prior = self.rssm.observe(embed, data["action"], data["is_first"], start)
        scales = self.scales
        feat = self.rssm.get_feat(post)  # (B, T, F)
        losses = {}  # term: (B, T)
        for name, head in self.heads.items():
            pred = head(feat if name in config.grad_heads else feat.detach())
            losses.update(self.HEAD_LOSSES[name](self, pred, data))
        metrics = {f"{k}_loss": (v * scales[k]).detach().mean() for k, v in losses.items()}
        losses["dyn"], losses["rep"], dyn, rep = self.rssm.kl_loss(post, prior, config.kl_free)
        kl = scales["dyn"] * losses["dyn"] + scales["rep"] * losses["rep"]
        metrics.update(kl_loss=kl.detach().mean(), dyn_loss=dyn.detach().mean(), rep_loss=rep.detach().mean(),
                       prior_entropy=self.rssm.dist(prior).entropy().detach().mean(),
                       post_entropy=self.rssm.dist(post).entropy().detach().mean())
        return losses, post, embed, metrics

    def decoder_loss(self, pred, data):  # {key: dist} -> {key: (B, T)}
        return {key: -dist.log_prob(data[key]) for key, dist in pred.items()}

    def reward_loss(self, pred, data):
        return {"rew": -pred.log_prob(data["reward"])}

    def cont_loss(self, pred, data):
        return {"con": -pred.log_prob(self.cont_target(data["cont"])[..., None])}

    # The loss terms of each head, unscaled; a head without an entry is an error at construction.
    HEAD_LOSSES = {"decoder": decoder_loss, "reward": reward_loss, "cont": cont_loss}

    def cont_target(self, cont):
        """What the continue head learns from cont = 1 - terminal (B, T): the flag itself, or with
        cont_head.contdisc the discount it implies, cont * discount (the 2024 recipe)."""
        return cont * self.config.discount if self.config.cont_head.contdisc else cont

    def imagined_cont(self, feat, start_cont):
        """Continue weights (H+1, N) of an imagined trajectory feat (H+1, N, F) and the discount
        to apply on top of them. The paper's: the replayed flag at the start, the head's 0/1 mode
        after it, times `discount`. With contdisc: the head's probability at every step, which
        already is the discount, so none on top."""
        head = self.heads["cont"]
        if self.config.cont_head.contdisc:
            return head(feat).mean()[..., 0], 1.0
        return torch.cat([start_cont[None], head(feat[1:]).mode()[..., 0]], 0), self.config.discount

    @torch.no_grad()
    def video_pred(self, data, context=5, count=6):
        """Open-loop prediction: observe `context` steps, then imagine the rest from the actions.

        Returns (count, T, 3H, W, C) in [0, 1]: truth, model and error stacked vertically.
        """
        key = next(iter(self.heads["decoder"].cnn_shapes))
        data = {k: v[:count] for k, v in data.items()}
        embed = self.embed(data)
        post, _ = self.rssm.observe(embed[:, :context], data["action"][:, :context], data["is_first"][:, :context])
        recon = self.heads["decoder"](self.rssm.get_feat(post))[key].mode()
        last = {k: v[:, -1] for k, v in post.items()}
        prior = self.rssm.imagine_with_action(data["action"][:, context:], last)
        openl = self.heads["decoder"](self.rssm.get_feat(prior))[key].mode()
        model = torch.cat([recon, openl], 1).clamp(0, 1)
        truth = data[key]
        error = (model - truth + 1) / 2
        return torch.cat([truth, model, error], 2).float().cpu().numpy()



# ==================================================================================================
# 2. Returns and their normalisation
# ==================================================================================================


def lambda_return(reward, cont, value, discount, lambda_):
    """λ-returns (Eq. 7), computed backwards from the bootstrap value, time first: the imagined
    returns and the replayed ones of the replay value loss (ActorCritic.replay_loss) alike.

    Inputs are (H, N) for steps 1..H: reward r_t, continue flag c_t and value v_t; `lambda_` is a
    number or (H, N), one per step. Output (H, N) for steps 0..H-1:
    R_t = r_{t+1} + γ c_{t+1} ((1 - λ_{t+1}) v_{t+1} + λ_{t+1} R_{t+1}), with R_H = v_H.
    """
    returns, last = [], value[-1]
    for t in reversed(range(len(reward))):
        lam = lambda_[t] if isinstance(lambda_, torch.Tensor) else lambda_
        last = reward[t] + discount * cont[t] * ((1 - lam) * value[t] + lam * last)
        returns.append(last)
    return torch.stack(returns[::-1])


def replay_return(reward, is_last, is_terminal, boot, discount, lambda_):
    """The λ-returns (lambda_return) of replayed sequences, all (B, T): real rewards and
    terminations, bootstrapped at every step from `boot`; λ is 0 after an episode's last step, so
    that a sequence never bootstraps across it. Output (B, T-1) for steps 0..T-2:

        R_t = r_{t+1} + γ (1 - term_{t+1}) ((1 - c_{t+1}) boot_{t+1} + c_{t+1} R_{t+1}),
        c = λ (1 - last),  R_{T-1} = boot_{T-1}."""
    time_first = lambda x: x[:, 1:].transpose(0, 1)  # noqa: E731 - steps 1..T-1, as lambda_return takes them
    return lambda_return(time_first(reward), time_first(1 - is_terminal), time_first(boot), discount,
                         time_first(lambda_ * (1 - is_last))).transpose(0, 1)


class ReturnNorm(nn.Module):
    """Return normalisation (Eq. 8): scale S = max(1, EMA(P95) - EMA(P5)) over the batch of returns.

    Under torchrun the percentiles are those of every process's returns together (all-gathered),
    so that the EMAs stay identical on every rank and equal those of one process on the whole batch.
    """

    ranks = launch.SingleProcess()

    def __init__(self, decay=0.99, low=0.05, high=0.95, floor=1.0):
        super().__init__()
        self.decay, self.quantiles, self.floor = decay, (low, high), floor
        self.register_buffer("low", torch.zeros(()))
        self.register_buffer("high", torch.zeros(()))
        # On the device with the module: made per call, it would be a host-to-device copy per update.
        self.register_buffer("points", torch.tensor(self.quantiles), persistent=False)

    def forward(self, returns):
        """Update the EMAs with a batch of returns; return (offset, scale)."""
        flat = self.ranks.all_gather(returns.detach().float().flatten())  # (world_size * H * N,)
        q = torch.quantile(flat, self.points)
        self.low.mul_(self.decay).add_((1 - self.decay) * q[0])
        self.high.mul_(self.decay).add_((1 - self.decay) * q[1])
        return self.low.clone(), torch.clamp(self.high - self.low, min=self.floor)



# ==================================================================================================
# 3. Actor-critic
# ==================================================================================================


def rollout(rssm, actor, start, horizon, through_dynamics):
    """Roll `actor` out in `rssm` for `horizon` steps from every start state (N, ...); the
    actions feed the dynamics with their gradient only when `through_dynamics`.

    Returns feat (H+1, N, F), state dict (H+1, N, ...), action (H+1, N, A) and the actor's raw
    outputs (H+1, N, D), kept so that the actor loss need not run the actor again.
    The action at the last state is sampled too but never executed.
    """
    state = start
    feats, states, actions, outs = [], [], [], []
    for t in range(horizon + 1):
        feat = rssm.get_feat(state)
        out = actor.raw(feat.detach())
        action = actor.dist(out).sample()
        feats.append(feat)
        states.append(state)
        actions.append(action)
        outs.append(out)
        if t < horizon:  # without the dynamics gradient the imagined states record no graph
            with torch.set_grad_enabled(through_dynamics and torch.is_grad_enabled()):
                state = rssm.img_step(state, action if through_dynamics else action.detach())
    stack = lambda xs: torch.stack(xs, 0)  # noqa: E731
    states = {k: stack([s[k] for s in states]) for k in states[0]}
    return stack(feats), states, stack(actions), stack(outs)


class ActorCritic(nn.Module):
    """Actor and critic trained on trajectories imagined by the world model (Section 3).

    `reward_fn(feat, state, action) -> (H+1, N)` supplies the reward, so that the same class
    serves the task (extrinsic reward) and Plan2Explore (intrinsic reward). It holds no optimizer:
    the update that steps it builds them (Update for the task's, Plan2Explore for its own).
    """

    def __init__(self, config, world_model, act_space, reward_fn, prefix=""):
        super().__init__()
        self.config, self.prefix = config, prefix
        self.wm = [world_model]  # a list keeps the world model out of this module's parameters
        self.reward_fn = reward_fn
        feat = world_model.rssm.feat_size
        self.actor = networks.Actor(feat, act_space.shape[0], config.actor, config.units, config.act, config.norm)
        critic = config.critic
        self.critic = networks.Head(feat, (), critic.layers, config.units, config.act, config.norm,
                                    critic.dist, critic.outscale)
        networks.reinit(self.actor, config.winit)
        networks.reinit(self.critic, config.winit)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.return_norm = ReturnNorm() if config.reward_EMA else None
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def imagine(self, start):
        """Roll the policy out for imag_horizon steps from every start state (N, ...); see `rollout`.
        REINFORCE needs no gradient through the imagined dynamics: cut there, the rollout records no
        graph beyond the actor's own outputs."""
        through_dynamics = self.config.imag_gradient != "reinforce"
        return rollout(self.wm[0].rssm, self.actor, start, self.config.imag_horizon, through_dynamics)

    def loss(self, start, start_cont):
        """Imagine from the start states (N, ...) with their continue flags (N,) and return the loss
        terms {"policy": (N,), "value": (N,)} (unscaled, each the mean over the imagined steps of
        its start state), the λ-returns (H, N) and metrics, without stepping.

        The two terms send gradients only into their own network, so that one backward pass of
        their sum serves both optimizers (models.optimize): the critic's values that the actor's
        returns bootstrap from are computed with its weights detached, and the critic learns from a
        pass of its own on the detached features. The callers freeze the world model where its
        weights would otherwise receive the actor's dynamics gradient (Update.train_step)."""
        config = self.config
        wm = self.wm[0]
        through_dynamics = config.imag_gradient != "reinforce"
        with autocast(config):
            with profiled("imagination"):
                feat, state, action, policy_out = self.imagine(start)  # feat (H+1, N, F)
                # REINFORCE needs no gradient through the rewards and values of imagined states.
                with torch.set_grad_enabled(through_dynamics and torch.is_grad_enabled()):
                    # Rewards of the states reached, steps 1..H: (H, N).
                    reward = self.reward_fn(feat[1:], {k: v[1:] for k, v in state.items()}, action[1:])
                    value = self.values(feat)  # (H+1, N)
                with torch.no_grad():  # the continue flags carry no gradient
                    cont, discount = wm.imagined_cont(feat, start_cont)  # (H+1, N), float
                # The weight discounts losses of states the model believes lie past an episode end.
                weight = (torch.cumprod(discount * cont, 0) / discount).detach()
                returns = lambda_return(reward, cont[1:], value[1:], discount, config.discount_lambda)
            with profiled("actor"):
                policy = self.actor.dist(policy_out[:-1])
                # The baseline keeps its gradient, as in v1: the dynamics gradient of the advantage
                # also flows through v(s_t) of the imagined states (into the actor only).
                actor, metrics = self.actor_loss(action, returns, weight, policy, value[:-1])
            with profiled("critic"):
                critic_dist = self.critic.dist(self.critic.raw(feat.detach())[:-1])
                critic, critic_metrics = self.critic_loss(feat.detach(), returns.detach(), weight, critic_dist)
                metrics.update(critic_metrics)
        metrics.update(imag_reward=reward.detach().mean(), imag_return=returns.detach().mean(),
                       imag_value=value.detach().mean())
        return {"policy": actor, "value": critic}, returns, metrics

    def values(self, feat):
        """The critic's values of feat (..., F) with its weights detached: the λ-returns bootstrap
        from them and the actor's baseline is them, so that only the critic's own loss trains it
        while the dynamics gradient still flows through feat."""
        weights = {k: v.detach() for k, v in self.critic.named_parameters()}
        return torch.func.functional_call(self.critic, weights, (feat,), strict=True).mean()

    def actor_loss(self, action, returns, weight, policy, base):
        """Policy gradient on normalised λ-returns plus the entropy bonus (Eq. 6), per start state
        (N,): the weighted mean over the imagined steps 0..H-1 of the rollout's `action` (H+1, N, A),
        under the actor's distribution `policy` at steps 0..H-1 and the critic's values `base` there
        (`values`); the dynamics gradient flows through both the returns and the base.
        """
        config = self.config
        if self.return_norm is not None:
            offset, scale = self.return_norm(returns)
        else:
            offset, scale = returns.new_zeros(()), returns.new_ones(())
        normed_returns = (returns - offset) / scale
        advantage = normed_returns - (base - offset) / scale
        dynamics = -advantage  # v1's backprop loss: the baseline is not stop-gradded
        reinforce = -policy.log_prob(action[:-1].detach()) * advantage.detach()
        if config.imag_gradient == "dynamics":
            loss = dynamics
        elif config.imag_gradient == "reinforce":
            loss = reinforce
        elif config.imag_gradient == "both":
            mix = config.imag_gradient_mix
            loss = mix * dynamics + (1 - mix) * reinforce
        else:  # 'auto' is settled by resolve_auto before anything is built
            raise ValueError(f"imag_gradient '{config.imag_gradient}' reached the actor loss unsettled")
        entropy = policy.entropy()
        loss = loss - config.actor.entropy * entropy
        metrics = {"actor_entropy": entropy.detach().mean(), "return_scale": scale.detach(),
                   "advantage": advantage.detach().mean()}
        return (weight[:-1] * loss).mean(0), metrics

    def critic_loss(self, feat, returns, weight, dist):
        """The critic learns the imagined λ-returns (and the slow critic's predictions, `regress`),
        per start state (N,): the weighted mean over the imagined steps 0..H-1 of `dist`, its
        prediction at the features feat[:-1].
        """
        loss = self.regress(dist, feat[:-1], returns)
        return (weight[:-1] * loss).mean(0), {"critic_value": dist.mean().detach().mean()}

    def regress(self, dist, feat, returns):
        """-log p(returns) under the critic's prediction `dist` at the features `feat`; with
        slow_target also -log p of the slow critic's prediction there, which stabilises learning
        (Section 3, Critic learning). The one critic regression of imagined and replayed returns."""
        loss = -dist.log_prob(returns)
        if self.config.critic.slow_target:
            with torch.no_grad():
                slow = self.slow_critic(feat).mean()
            loss = loss - dist.log_prob(slow)
        return loss

    def replay_loss(self, feat, data, boot):
        """The replay value loss of the 2024 recipe: the critic also learns λ-returns of the replayed
        sequences, with their real rewards and terminations, bootstrapped at every step from `boot`
        (B, T), the imagined λ-return of that step's posterior state, and never across an
        episode's last step. feat (B, T, F) are the posterior features (with their graph under
        update 'joint': the loss then trains the representation too). Returns (B, T - 1): the last
        step has no replayed return; steps that end an episode weigh nothing."""
        config = self.config
        is_last = data["is_last"]  # (B, T)
        returns = replay_return(data["reward"], is_last, data["is_terminal"], boot, config.discount,
                                config.discount_lambda)  # (B, T-1)
        dist = self.critic(feat[:, :-1])
        return (1 - is_last[:, :-1]) * self.regress(dist, feat[:, :-1], returns)

    @torch.no_grad()
    def update_slow_critic(self):
        """EMA of the critic's weights every slow_target_update updates. The fraction is 0 between
        them, chosen on the device: no count is read back to the host."""
        config = self.config.critic
        mix = torch.where(self.updates % config.slow_target_update == 0, config.slow_target_fraction, 0.0)
        slow, fast = list(self.slow_critic.parameters()), list(self.critic.parameters())
        torch._foreach_mul_(slow, 1 - mix)
        torch._foreach_add_(slow, torch._foreach_mul(fast, mix))
        self.updates.add_(1)


# ==================================================================================================
# 4. The update: the whole loss in the official order, and the optimizers the update mode steps
# ==================================================================================================

def behavior_optimizers(config, behavior):
    """An actor's and a critic's optimizers ({name: (Optimizer, its terms)}), with their own
    settings (actor.lr, actor.eps, actor.grad_clip and the critic's), each stepping its terms of
    LOSS_TERMS (the critic's: value and the replay value loss)."""
    scaler, schedule = use_scaler(config), {"agc": config.agc, "warmup": config.warmup}
    scales = behavior.wm[0].scales
    return {"actor": (Optimizer("actor", behavior.actor.parameters(), config.actor.lr, config.actor.eps,
                                config.actor.grad_clip, opt=config.opt, use_scaler=scaler, **schedule),
                      terms_of("actor", scales)),
            "critic": (Optimizer("critic", behavior.critic.parameters(), config.critic.lr, config.critic.eps,
                                 config.critic.grad_clip, opt=config.opt, use_scaler=scaler, **schedule),
                       terms_of("critic", scales))}


def sequential_optimizers(config, world_model, behavior):
    """update 'sequential' (the paper's): one optimizer per network, the world model's with
    model_lr, opt_eps, grad_clip and weight_decay."""
    model = Optimizer("model", world_model.parameters(), config.model_lr, config.opt_eps, config.grad_clip,
                      config.weight_decay, config.opt, use_scaler=use_scaler(config), agc=config.agc,
                      warmup=config.warmup)
    return {"model": (model, world_model.terms), **behavior_optimizers(config, behavior)}


def joint_optimizers(config, world_model, behavior):
    """update 'joint' (the 2024 recipe's): one optimizer over the world model, actor and critic with
    the world model's settings, stepping the sum of every term. It needs REINFORCE actor gradients:
    a dynamics gradient would flow through the imagined states into the world model's weights,
    which this step trains (the sequential update freezes them for the actor's loss)."""
    if config.imag_gradient != "reinforce":
        raise tools.ConfigError(f"Invalid value '{config.imag_gradient}' for --imag_gradient: --update joint needs "
                                "reinforce (a dynamics gradient would train the world model through imagination)")
    params = [*world_model.parameters(), *behavior.actor.parameters(), *behavior.critic.parameters()]
    joint = Optimizer("joint", params, config.model_lr, config.opt_eps, config.grad_clip, config.weight_decay,
                      config.opt, use_scaler(config), config.agc, config.warmup)
    return {"joint": (joint, None)}  # None: every term


UPDATES = {"sequential": sequential_optimizers, "joint": joint_optimizers}  # config.update


def ignored_keys(config):
    """A line on the optimizer keys the chosen update mode reads nowhere: under 'joint' (without
    Plan2Explore, whose actor-critic keeps optimizers of its own) the actor's and the critic's,
    when they differ from the world model's that the joint optimizer applies instead."""
    if config.update != "joint" or config.expl_behavior == "plan2explore":
        return []
    flat = tools.flatten(config.to_dict())
    # The settings the optimizers are built with (sequential_optimizers, behavior_optimizers): the
    # world model's key of each, and the actor's and critic's, named `<group>.<setting>`.
    settings = {"lr": "model_lr", "eps": "opt_eps", "grad_clip": "grad_clip"}
    ignored = [f"--{name}.{setting} {flat[f'{name}.{setting}']:g}" for name in ("actor", "critic")
               for setting, model_key in settings.items() if flat[f"{name}.{setting}"] != flat[model_key]]
    if not ignored:
        return []
    model = ", ".join(f"--{key} {flat[key]:g}" for key in settings.values())
    return [f"{', '.join(ignored)} ignored: under --update joint one optimizer steps the world model, actor and "
            f"critic with {model}; use --update sequential for an optimizer per network"]


def check_terms(losses, scales, optimizers, batch, length):
    """Every term of the loss has a scale and every scale a term (repval only where it weighs
    anything), an optimizer steps each ({name: (Optimizer, terms)}, terms None: all), each term
    is (B, T), the replay value loss (B, T - 1) (its last step has no return)."""
    expected = {k for k in scales if k != "repval" or scales["repval"]}
    if set(losses) != expected:
        raise KeyError(f"loss terms {sorted(set(losses) - expected)} have no scale and scales "
                       f"{sorted(expected - set(losses))} no term (models.LOSS_TERMS)")
    groups = [terms for _, terms in optimizers.values()]
    unstepped = [] if None in groups else sorted(set(losses) - {term for terms in groups for term in terms})
    if unstepped:
        raise KeyError(f"loss terms {unstepped} are stepped by no optimizer (models.LOSS_TERMS)")
    for key, value in losses.items():
        shape = (batch, length - 1) if key == "repval" else (batch, length)
        assert value.shape == shape, (key, tuple(value.shape), shape)


def scaled_sum(losses, scales, terms=None):
    """The loss: the sum over `terms` (by default every one) of each term's mean times its scale,
    as the official Agent.loss sums them, in the order the terms were computed (a set's order
    changes between processes, and so would the rounding); a term not computed (repval at scale 0)
    adds nothing."""
    return sum(scales[k] * v.mean() for k, v in losses.items() if terms is None or k in terms)


def step(optimizers, losses, scales):
    """One backward pass and every optimizer's step, each on the scaled sum of its terms
    ({name: (Optimizer, terms)}); returns their metrics (<name>_loss, <name>_grad_norm)."""
    return optimize({opt: scaled_sum(losses, scales, terms) for opt, terms in optimizers.values()})


def behavior_regions(behavior, optimizers, replay=False):
    """What compile 'update' compiles whole of an actor-critic: its imagination loss, with `replay`
    its replay value loss, its optimizers' steps (`optimizers`, {name: (Optimizer, terms)}) and the
    slow critic's EMA."""
    return [(behavior, "loss"), *[(behavior, "replay_loss")] * bool(replay),
            *[(opt.opt, "step") for opt, _ in optimizers.values()], (behavior, "update_slow_critic")]


class Update:
    """One update of every learner on a replayed batch, as the official Agent.loss reads:
    `train_step` in three parts, # World model, # Imagination and # Replay, whose terms are
    checked against the one table of loss scales (loss_scales) and their (B, T) shape, scaled and
    summed; then the exploration behaviour's own learners (Plan2Explore) from the same posteriors.
    The update mode (config.update, UPDATES) decides only which optimizers step the terms: one
    per network for 'sequential' (the paper's order: the world model steps first, and imagination
    starts from its posteriors with its weights frozen), one for all for 'joint' (every term at
    the same parameters, the replay value loss training the representation too).
    """

    def __init__(self, config, world_model, behavior, context, exploration=None):
        self.config, self.wm, self.behavior = config, world_model, behavior
        self.context, self.exploration = context, exploration  # ReplayContext; None, or exploration.py's
        self.optimizers = UPDATES[config.update](config, world_model, behavior)  # {name: (Optimizer, terms)}
        self.sequential = "model" in self.optimizers

    def regions(self):
        """What compile 'update' compiles whole: the three parts' losses, every optimizer's step and
        the slow critic's EMA."""
        return [(self.wm, "loss"), *behavior_regions(self.behavior, self.optimizers, self.config.critic.repval)]

    def train_step(self, batch, data=None):
        """One update on a replayed batch (B, K + T, ...) of numpy arrays with K replay_context
        steps (`data`: the same already on the device). Returns (tensor metrics, the latents to
        write back): with K > 0 the first K steps give only the start latent, and the training
        posteriors of the T trained steps are returned to replace their stored latents
        (ReplayContext.write_back); with K = 0, None."""
        config, wm, behavior, scales = self.config, self.wm, self.behavior, self.wm.scales
        data = wm.preprocess(batch if data is None else data)
        latent, data = self.context.split(data)  # the stored start latent (None: the initial state)
        size, length = data["is_first"].shape
        losses = {}
        with autocast(config):
            # World model
            with profiled("world_model"):
                terms, post, embed, metrics = wm.loss(data, latent)  # {term: (B, T)}
            losses.update(terms)
            if self.sequential:  # the paper's order: the world model learns first, alone
                metrics.update(step({"model": self.optimizers["model"]}, losses, scales))
            # Imagination, then Replay (behavior_losses, which exploration behaviours share). The
            # actor's dynamics gradient flows through the world model; its weights need none where
            # it stepped already.
            with frozen(wm) if self.sequential else contextlib.nullcontext():
                terms, behavior_metrics = behavior_losses(behavior, post, data, bool(config.critic.repval),
                                                          replay_graph=not self.sequential)
            losses.update(terms)
            check_terms(losses, scales, self.optimizers, size, length)
            rest = {name: group for name, group in self.optimizers.items() if name != "model"}
            with profiled("backward"):
                metrics.update(step(rest, losses, scales))
        behavior.update_slow_critic()
        if not self.sequential:  # each network's share of the one loss, as the sequential update logs it
            for name in ("model", "actor", "critic"):
                metrics[f"{name}_loss"] = scaled_sum(losses, scales, terms_of(name, scales)).detach()
        metrics.update({behavior.prefix + k: v for k, v in behavior_metrics.items()})
        post = {k: v.detach() for k, v in post.items()}
        if self.exploration is not None:  # its own learners, from the same posteriors (B, T, ...)
            metrics.update(self.exploration.train_step(post, embed.detach(), data))
        return metrics, self.context.latents(post)


def behavior_losses(behavior, post, data, replay, replay_graph=False):
    """The Imagination and Replay parts of the loss for an actor-critic (the task's, or an
    exploration behaviour's): imagine from every posterior state post (B, T, ...) with its continue
    flag, and with `replay` also the replay value loss on the replayed sequences, bootstrapped from
    the imagined returns (its features keep their graph with `replay_graph`: under 'joint' the loss
    trains the representation too). Returns ({term: (B, T), repval (B, T - 1)}, metrics); the
    caller steps the terms with its optimizers."""
    size, length = data["is_first"].shape
    # Imagination: from every posterior state, with its continue flag.
    starts = {k: v.detach().reshape(size * length, *v.shape[2:]) for k, v in post.items()}
    terms, returns, metrics = behavior.loss(starts, data["cont"].reshape(-1))
    losses = {k: v.unflatten(0, (size, length)) for k, v in terms.items()}  # (N,) -> (B, T)
    # Replay: the critic also learns the replayed returns, bootstrapped from the imagined ones.
    if replay:
        feat = behavior.wm[0].rssm.get_feat(post)  # (B, T, F)
        losses["repval"] = behavior.replay_loss(feat if replay_graph else feat.detach(), data,
                                                returns[0].detach().reshape(size, length))
        metrics["critic_repval_loss"] = losses["repval"].detach().mean()
    return losses, metrics


# ==================================================================================================
# 5. Replay context
# ==================================================================================================


class ReplayContext:
    """The replay context of the 2024 recipe (replay_context K > 0), as in the official code.

    The policy's posterior latent is stored with every step it acted on (episode keys
    `latent_deter` (D,) and `latent_stoch` (S, C), or (S,) for Gaussian latents). A sampled
    sequence has K + batch_length steps: the first K only give the latent the world model starts
    from (the stored one of step K - 1; the action that leads on from it is stored with step K,
    so nothing else of the context steps is needed) and every loss, imagination start and the
    replay value loss cover the other batch_length steps. After the update the posteriors of
    these steps are written back over their stored latents, so that later sequences start from
    fresher ones. A zero latent (prefill steps, the last step of an episode, episodes stored
    without latents) is the initial state under `initial zeros`; a step marked is_first resets
    the state anyway. K = 0 (v1): nothing is stored, sequences start from the initial state.
    """

    PREFIX = storage.LATENT

    def __init__(self, config):
        self.steps = config.replay_context
        self.pending = None  # (replay, ids, storage.Fetch) of the last update's write-back (write_back)
        stoch = (config.dyn_stoch, config.dyn_discrete) if config.dyn_discrete else (config.dyn_stoch,)
        self.spec = ({self.PREFIX + "deter": ((config.dyn_deter,), np.dtype(np.float32)),
                      self.PREFIX + "stoch": (stoch, np.dtype(np.float32))} if self.steps else {})

    def entries(self, state, count):
        """What to store with the `count` steps the policy just acted on: dict of (count, ...)
        float32 arrays from its state (latent, action) as Dreamer.policy returns it; zeros for a
        policy without a latent (the random prefill, state None)."""
        if state is None:
            return {k: np.zeros((count, *shape), dtype) for k, (shape, dtype) in self.spec.items()}
        if len(state) == 3:  # Dreamer.policy's: brought to the host with its action, in one copy
            return {k: state[2][k] for k in self.spec}
        latent = state[0]
        return {self.PREFIX + k: latent[k].detach().float().cpu().numpy() for k in ("deter", "stoch")
                if self.PREFIX + k in self.spec}

    def split(self, data):
        """data (B, K + T, ...) as tensors -> the start latent {deter (B, D), stoch (B, S[, C])}
        and the data of the T trained steps without the latents; K = 0: (None, data)."""
        if not self.steps:
            return None, data
        start = {k: data[self.PREFIX + k][:, self.steps - 1] for k in ("deter", "stoch")}
        rest = {k: v[:, self.steps:] for k, v in data.items() if not k.startswith(self.PREFIX)}
        return start, rest

    def latents(self, post):
        """The training posteriors post (B, T, ...) as the latents to store for the T trained steps:
        {latent_deter: (B, T, D), latent_stoch: (B, T, S[, C])} float32 tensors; None for K = 0."""
        if not self.steps:
            return None
        return {self.PREFIX + key: post[key].detach().float() for key in ("deter", "stoch")}

    def write_back(self, replay, ids, latents):
        """Write the trained steps' `latents` (from `latents`; None: nothing) to the replay (a
        storage.Replay or Prefetcher), to the steps they were computed for; ids (B, 2) are the sampled
        sequences' first steps (Replay.sample).

        One update late, as the official code fetches an update's outputs (embodied/jax/agent.py:
        `train` returns the `pending_outs` of the update before and starts fetching its own): this
        update's latents are copied to the host in one copy that does not wait (storage.Fetch), and
        the previous update's are written now, their copy long done. `flush` writes what is pending
        (before a checkpoint is taken, so that a resumed run finds in the replay what the straight
        run wrote)."""
        previous = self.pending
        self.pending = None
        if latents is not None:
            ids = np.array(ids)
            ids[:, 1] += self.steps
            self.pending = (replay, ids, storage.Fetch(latents, getattr(replay, "on_host", True)))
        if previous is not None:
            self._write(*previous)

    def flush(self):
        """Write the pending write-back now (write_back)."""
        if self.pending is not None:
            previous, self.pending = self.pending, None
            self._write(*previous)

    @staticmethod
    def _write(replay, ids, fetched):
        replay.update(ids, fetched.result())



# ==================================================================================================
# 6. Optimizers
# ==================================================================================================


class ClippedOptimizer(torch.optim.Optimizer):
    """The base of Adam, AdamW and LaProp here: each `step` clips the gradients (a global norm
    `clip`, 0 for none, and/or adaptive clipping `agc`, 0 for none), ramps the learning rate up
    over `warmup` updates (the first update has rate 0, as in the official code) and then updates
    every parameter with a gradient, all in a few multi-tensor (`torch._foreach_*`) operations.

    Every number that changes between updates is a tensor on the parameters' device: the count of
    steps taken (`updates`, which the bias corrections and the warm-up read) and `grad_norm`, the
    last step's norm before clipping. So a compiled `step` (compile 'update') is one graph that
    neither reads a value back to the host nor recompiles. The moments are kept per parameter
    under torch.optim.Adam's names; the step count is one for all (torch keeps one per parameter,
    equal for parameters that get a gradient at every step, as all of these do).
    """

    STATE = ()  # the moment buffers per parameter

    def __init__(self, params, lr, eps, betas, weight_decay, clip=0.0, agc=0.0, warmup=0):
        super().__init__(params, dict(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay))
        self.clip, self.agc, self.warmup = clip, agc, warmup
        self.updates = torch.zeros((), dtype=torch.int64)  # moved to the parameters' device by init_state
        self.grad_norm = torch.zeros(())
        self.ready = False  # whether init_state ran since construction or loading

    def __getstate__(self):  # torch.optim.Optimizer's keeps only its own attributes: a copy would lose these
        return dict(self.__dict__)

    def load_state_dict(self, state_dict):
        """Also a torch.optim.Adam state: its per-parameter step counts give the count."""
        super().load_state_dict(state_dict)
        steps = [float(state.pop("step")) for state in self.state.values() if "step" in state]
        if steps:
            self.updates = torch.tensor(int(max(steps)))
        self.ready = False

    def init_state(self):
        """Create the moments of every parameter and move the counters to the parameters' device,
        before the first step and outside any compiled region; a loaded state is kept."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in self.STATE:
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        device = self.param_groups[0]["params"][0].device
        self.updates, self.grad_norm = self.updates.to(device), self.grad_norm.to(device)
        self.ready = True

    def rate(self, group):
        """The learning rate of this update: lr, times min(1, updates / warmup) in the warm-up."""
        if not self.warmup:
            return group["lr"]
        return group["lr"] * torch.clamp(self.updates.float() / self.warmup, max=1.0)

    @torch.no_grad()
    def step(self, closure=None):
        if not self.ready:  # compile 'update' runs it before the first compiled step
            self.init_state()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # In place: a compiled step mutates its inputs, and sets no attributes.
        if grads:
            self.grad_norm.copy_(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        else:
            self.grad_norm.zero_()
        if self.clip:  # torch.nn.utils.clip_grad_norm_'s rule
            torch._foreach_mul_(grads, torch.clamp(self.clip / (self.grad_norm + 1e-6), max=1.0))
        if self.agc:
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            agc_(params, grads, self.agc)
        count = (self.updates + 1).double()  # this step's number, t = 1, 2, ...
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                state = [self.state[p] for p in params]
                self.update(group, self.rate(group), count, params, [p.grad for p in params],
                            *[[s[key] for s in state] for key in self.STATE])
        self.updates.add_(1)

    @staticmethod
    def bias_correction(beta, count):
        """1 - beta ** t as a float64 tensor, so that it loses nothing (a 0-dim tensor does not
        change the dtype of the moments it scales)."""
        return 1 - torch.pow(beta, count)


def agc_(params, grads, clip, floor=1e-3):
    """Adaptive gradient clipping, per tensor: scale each gradient down to at most
    clip * max(floor, |param|) in L2 norm (the 2024 recipe, with clip 0.3)."""
    upper = clip * torch.clamp(torch.stack(torch._foreach_norm(params)), min=floor)
    scale = 1 / torch.clamp(torch.stack(torch._foreach_norm(grads)) / upper, min=1.0)
    torch._foreach_mul_(grads, list(scale.unbind()))


class Adam(ClippedOptimizer):
    """Adam (Kingma and Ba 2015), as torch.optim.Adam computes it; `decoupled` weight decay makes
    it AdamW (Loshchilov and Hutter 2019)."""

    STATE = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def update(self, group, lr, count, params, grads, exp_avg, exp_avg_sq):
        beta1, beta2 = group["betas"]
        if group["weight_decay"] and self.decoupled:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        elif group["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, torch.sqrt(self.bias_correction(beta2, count)))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_mul_(denom, self.bias_correction(beta1, count) / lr)  # divided by the step size
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-1.0)


class AdamW(Adam):
    decoupled = True


class LaProp(ClippedOptimizer):
    """LaProp (Ziyin et al. 2020), the 2024 recipe's optimizer: each gradient is divided by the
    root of its bias-corrected second-moment EMA first, and the momentum averages these
    normalised steps (Adam averages the raw gradients, then divides):

        nu = b2 nu + (1 - b2) g^2,   u = g / (sqrt(nu / (1 - b2^t)) + eps),
        mu = b1 mu + (1 - b1) u,     p -= lr (mu / (1 - b1^t) + weight_decay p).
    """

    STATE = ("nu", "mu")

    def update(self, group, lr, count, params, grads, nu, mu):
        beta1, beta2 = group["betas"]
        torch._foreach_mul_(nu, beta2)
        torch._foreach_addcmul_(nu, grads, grads, 1 - beta2)
        denom = torch._foreach_div(nu, self.bias_correction(beta2, count))
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_lerp_(mu, torch._foreach_div(grads, denom), 1 - beta1)
        update = torch._foreach_div(mu, self.bias_correction(beta1, count))
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        torch._foreach_mul_(update, lr)
        torch._foreach_sub_(params, update)


OPTIMIZERS = {"adam": Adam, "adamw": AdamW, "laprop": LaProp}


class Optimizer:
    """One learner's optimizer (config `opt`: Adam, AdamW or LaProp) with its clipping, warm-up
    (see ClippedOptimizer) and, for float16, a gradient scaler.

    `optimize({optimizer: loss, ...})` steps several learners on one backward pass; calling an
    Optimizer on a loss steps it alone. Metrics stay tensors so that an update never waits on the
    device.

    Under torchrun `ranks` (see Dreamer.distribute) averages the gradients over processes between
    the backward pass and the clipping: an explicit all-reduce of the flattened gradients rather than
    DistributedDataParallel, because the losses backpropagate into chosen parameters only
    (`backward(inputs=...)`), which DDP's hooks on whole modules do not model. Clipping and the
    scaler then see the averaged gradient.
    """

    ranks = launch.SingleProcess()

    SETTINGS = ("lr", "eps", "weight_decay")  # taken from the config, also on resume

    def __init__(self, name, params, lr, eps, clip, weight_decay=0.0, opt="adam", use_scaler=False, agc=0.0,
                 warmup=0):
        self.name, self.clip, self.agc, self.warmup, self.lr = name, clip, agc, warmup, lr
        self.params = [p for p in params if p.requires_grad]
        self.opt = OPTIMIZERS[opt](self.params, lr, eps, (0.9, 0.999), weight_decay, clip, agc, warmup)
        self.scaler = torch.amp.GradScaler(enabled=use_scaler)

    @property
    def updates(self):  # for the warm-up; saved in state_dict
        return int(self.opt.updates)

    def __call__(self, loss):
        """Backpropagate `loss` into this optimizer's parameters only (no gradient is computed for
        any other module the loss depends on), clip and step."""
        return optimize({self: loss})

    def step(self, loss):
        """After the backward pass: average over processes, unscale, clip and step; metrics."""
        if not self.opt.ready:
            self.opt.init_state()
        self.ranks.average_(p.grad for p in self.params if p.grad is not None)
        self.scaler.unscale_(self.opt)
        self.scaler.step(self.opt)  # opt.step, skipped by the float16 scaler on an overflow
        self.scaler.update()
        return {f"{self.name}_loss": loss.detach(), f"{self.name}_grad_norm": self.opt.grad_norm.clone()}

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "scaler": self.scaler.state_dict(), "updates": self.updates,
                "base_lr": self.lr}

    def load_state_dict(self, state):
        """Load the moments and step counts, but keep this run's settings (lr, eps, weight decay):
        a user who changed them on resume means them. Returns one line per setting that differs
        from the saved one."""
        settings = [{k: group[k] for k in self.SETTINGS} for group in self.opt.param_groups]
        self.opt.load_state_dict(state["opt"])
        self.scaler.load_state_dict(state["scaler"])
        if "updates" in state:  # checkpoints from before the warm-up have none (the moments' step counts serve)
            self.opt.updates = torch.tensor(state["updates"])
        changes = []
        for group, current in zip(self.opt.param_groups, settings):
            if "base_lr" in state:  # older checkpoints saved a ramped rate mid warm-up: compare the target
                group["lr"] = state["base_lr"]
            for key, value in current.items():
                if group[key] != value:
                    changes.append(f"{self.name} {key} {group[key]:g} -> {value:g}")
                group[key] = value
        return changes


def optimize(losses):
    """One backward pass of the sum of `losses` ({Optimizer: loss}) into the parameters of their
    optimizers only, then each optimizer's step. The losses must not send gradients into each
    other's parameters (ActorCritic.loss keeps the actor's and the critic's apart), since
    each optimizer takes every gradient its parameters receive. Returns the metrics of all."""
    params = [p for opt in losses for p in opt.params]
    for opt in losses:
        opt.opt.zero_grad(set_to_none=True)
    sum(opt.scaler.scale(loss) for opt, loss in losses.items()).backward(inputs=params)
    metrics = {}
    for opt, loss in losses.items():
        metrics.update(opt.step(loss))
    return metrics


# ==================================================================================================
# 7. Compilation: `compile True` (step by step) and `compile update` (the whole update)
# ==================================================================================================


CompileError = networks.CompileError  # of both compile modes: a failure is never an eager fallback


class Region:
    """One function compiled whole as one graph (fullgraph: a graph break is an error, never a
    silent eager fallback), for compile 'update'. On CUDA the graph is captured as a CUDA graph
    (mode 'reduce-overhead'); its outputs then live in memory the next replay overwrites, so they
    are cloned for the caller (metrics are kept until the log interval)."""

    def __init__(self, fn, name, cuda_graphs):
        self.eager, self.name, self.cuda_graphs = fn, name, cuda_graphs
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                      mode="reduce-overhead" if cuda_graphs else None)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if self.cuda_graphs:  # the outputs of the last replay were cloned: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        try:
            result = self.compiled(*args, **kwargs)
        except networks.COMPILE_FAILURES as e:
            raise networks.compile_failure("'update'", self.name, e, "--compile True compiles step by step, "
                                           "--compile False runs eagerly", how=" as one graph") from e
        self.calls += 1
        if self.cuda_graphs:
            result = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, result)
        return result


def compile_steps(agent, bodies):
    """compile True: the functions that do the work of every update and every policy step, each
    compiled on its own: the RSSM transitions (run once per time step) and the bodies of every
    network a preset builds (`bodies`: networks.COMPILED and exploration.COMPILED). Between them
    the update runs eagerly, one kernel per operator. Returns the compiled functions."""
    # One MLP.forward serves every MLP, each seen with and without gradients and with its own
    # input shapes: about twenty variants, beyond dynamo's default limit of 8 per function
    # (past which the rest would silently run eagerly).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # past it: a CompileError, never eager
    rssm = agent.wm.rssm
    rssm.img_step = networks.Compiled(rssm.img_step, "rssm.img_step")
    rssm.obs_step = networks.Compiled(rssm.obs_step, "rssm.obs_step")
    compiled = [rssm.img_step, rssm.obs_step]
    for name, module in agent.named_modules():
        # The critic runs under torch.func.functional_call for the actor's values (its weights
        # detached, ActorCritic.loss), which swaps its parameters on every call.
        if name.endswith(".critic.mlp"):  # not slow_critic.mlp: that one only runs forward
            continue
        if isinstance(module, bodies):
            module.forward = networks.Compiled(module.forward, name)
            compiled.append(module.forward)
    return compiled


def compile_update(agent, bodies=None):
    """compile 'update': every update as a few whole graphs, as few as its autograd structure
    allows. Each loss region (the world model's, the actor-critic's, their sum in update 'joint',
    Plan2Explore's ensemble; `agent.regions()`) is compiled forward and, by AOTAutograd, backward;
    the backward pass between them is one call of the compiled backward graph; every optimizer's
    step (clipping, adaptive clipping, warm-up and the update, ClippedOptimizer) and every slow
    critic's EMA is a region too, and so is the policy step. The 64-step observe and the
    imagination are unrolled into their graphs. Nothing inside reads a value back to the host, so
    that on CUDA each region is captured as a CUDA graph. Returns the regions."""
    cuda_graphs = torch.device(agent.config.device).type == "cuda"
    # An update's regions run each with one set of shapes; a few variants (the policy's batch of
    # training and evaluation environments, with and without gradients) stay within the limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # past it: a CompileError, never eager
    regions = []
    for owner, method in agent.regions():
        name = f"{type(owner).__name__}.{method}"
        region = Region(getattr(owner, method), name, cuda_graphs)
        setattr(owner, method, region)  # an instance attribute: the class's method stays eager
        regions.append(region)
    return regions


# compile: what each value does to an agent; False runs eagerly.
COMPILERS = {True: compile_steps, False: None, "update": compile_update}


# ==================================================================================================
# The `auto` values
# ==================================================================================================

# -- compile auto: whether compiling pays for the run at hand ----------------------------------------
#
# On a CPU `compile auto` compiles when the run is predicted to make enough updates for the time
# compile saves to repay its warm-up: predicted updates x saved seconds per update > warm-up seconds.
# Measured with benchmarks/train_speed.py on a shared 2-core CPU (AVX2), one torch thread, batch
# 16x64, float32:
#   recipe2024 size1m, dmc_cartpole_balance: eager 1.42-1.49 s/update, --compile True 1.06-1.16 s
#     (0.33 s saved; ~2.9e10 FLOPs per update by update_flops); with --compare (torch 2.13): eager
#     1.69 s, compiled 1.07 s, warm-up of the first 2 updates 4.7 s eager and 377 s compiled;
#   v1 default size, dmc_proprio walker: eager 11.61 s, compiled 10.58 s (1.03 s saved; ~5.0e11
#     FLOPs), for 80 s more warm-up.
# The saved time per estimated FLOP is the smaller (1.03 / 5.0e11 = 2.1e-12 s; size1m's is 1.1e-11)
# and the warm-up the larger (~370 s), so that the rule errs towards eager, which costs no warm-up.
# compile 'update' (the whole update) is not chosen on a CPU: at recipe2024 size1m, 16x64, it saved more
# (eager 1.71 s, compiled 0.96 s) for a warm-up of 1,399 s, and nothing at other sizes was measured to
# scale the rule by; a long CPU run can ask for it.
# Not measured: more threads, vision models (update_flops counts a conv layer's weights once, an
# underestimate, so that they too err towards eager) and Plan2Explore's ensemble.
COMPILE_SAVED_S_PER_FLOP = 2.1e-12
COMPILE_WARMUP_S = 370.0


def parameter_counts(obs_space, act_space, config):
    """The parameters of the world model, its RSSM and the task actor and critic that `config`
    builds, counted on the meta device (no memory, no random numbers drawn)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        wm = WorldModel(obs_space, act_space, config)
        behavior = ActorCritic(config, wm, act_space, reward_fn=None)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return {"world_model": count(wm), "rssm": count(wm.rssm), "actor": count(behavior.actor),
            "critic": count(behavior.critic)}


def update_flops(config, counts):
    """Estimated floating-point operations of one update from the parameter counts: 2 per weight
    and token forward, 4 backward. The world model runs forward and backward on the B x T replayed
    steps; imagination starts from each of them and runs H + 1 steps of the RSSM (forward), the
    actor (forward and backward), the critic (forward and backward) and the slow critic (forward)."""
    tokens = config.batch_size * config.batch_length
    imagined = tokens * (config.imag_horizon + 1)
    return (6 * counts["world_model"] * tokens
            + imagined * (2 * counts["rssm"] + 6 * counts["actor"] + 8 * counts["critic"]))


def compile_choice(config, counts, saved_s_per_flop=COMPILE_SAVED_S_PER_FLOP, warmup_s=COMPILE_WARMUP_S):
    """What `compile auto` settles to, and why: (decision, reason). On CUDA always (fused kernels,
    fewer launches); on a CPU by the rule above, for the parameter counts `counts` (None: the model
    is not known, eager)."""
    if torch.device(config.device).type == "cuda":
        found = launch.torchrun_rank()
        if found is not None and found[1] > 1:  # compile_update refuses to run under torchrun
            return True, "on CUDA under torchrun the steps are compiled, with fewer launches per update"
        return "update", "on CUDA the whole update runs as a few CUDA graphs, with the fewest launches"
    if counts is None:
        return False, "on a CPU without the model to estimate its gain"
    updates = tools.total_updates(config)
    saved = saved_s_per_flop * update_flops(config, counts)
    decision = updates * saved > warmup_s
    verdict = "more" if decision else "less"
    return decision, (f"on a CPU: {updates:,} updates x ~{saved:.3g} s saved each = {updates * saved:,.0f} s, "
                      f"{verdict} than the ~{warmup_s:.0f} s warm-up")


def resolve_auto(config, act_space, obs_space=None):
    """Settle the 'auto' keys this module owns: the actor's distribution and gradient from the
    action space (v1's actor_dist_disc/cont and actor_grad_disc/cont: discrete -> onehot +
    reinforce, continuous -> normal + dynamics) and compile by compile_choice (for the model that
    `obs_space` gives). Explicit values stay; an actor distribution that contradicts the action
    space is a ConfigError. Returns the settled config (a new one) and {key that was 'auto': why it
    settled so ('' when the reason is the key's own rule)}, for the start-up summary. A settled
    config settles to itself."""
    discrete = bool(getattr(act_space, "discrete", False))
    dist, gradient = ("onehot", "reinforce") if discrete else ("normal", "dynamics")
    changes, resolved = {}, {}
    if config.actor.dist == "auto":
        changes["actor.dist"], resolved["actor.dist"] = dist, "from the action space"
    if config.imag_gradient == "auto":
        changes["imag_gradient"], resolved["imag_gradient"] = gradient, "from the action space"
    chosen = changes.get("actor.dist", config.actor.dist)
    if chosen != dist:
        kind = "discrete" if discrete else "continuous"
        raise tools.ConfigError(f"Invalid value '{chosen}' for --actor.dist: task '{config.task}' has {kind} "
                                f"actions; use --actor.dist {dist} (or auto)")
    if chosen == "normal" and config.actor.std != "learned":
        try:
            valid = float(config.actor.std) > 0
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise tools.ConfigError(f"Invalid value '{config.actor.std}' for --actor.std: the normal actor takes "
                                    "'learned' or a fixed standard deviation > 0 ('none' is for onehot actors)")
    if config.compile == "auto":
        provisional = config.replace(changes) if changes else config
        counts = parameter_counts(obs_space, act_space, provisional) if obs_space is not None else None
        changes["compile"], resolved["compile"] = compile_choice(provisional, counts)
    return (config.replace(changes) if changes else config), resolved
