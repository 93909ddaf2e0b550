"""The world model and the actor-critic that learns inside it (Sections 2 and 3 of the paper).

In the order a reader looks for them: 1. the world model and the one table of loss scales, 2. the
λ-return and return normalisation, 3. the actor-critic, 4. the update: `Update.train_step`, the
whole loss in the official order (# World model, # Imagination, # Replay) and the optimizers each
update mode steps it with, 5. the replay context. The optimizers live in optim.py, the dtypes in
precision.py, compilation and the settling of `auto` values in compilation.py.
"""

import contextlib
import copy

import numpy as np
import torch
from torch import nn

import launch
import networks
import optim
import precision
import storage
import tools

# ==================================================================================================
# Helpers of the update
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
    """Encoder, RSSM and prediction heads (decoder, reward, continue), trained on replayed sequences.

    A head is a row of HEADS (its network, from the feature size, the observation space and the
    config) and one of HEAD_LOSSES (its loss terms); each term is a row of LOSS_TERMS. Every head
    trains the representation, as in the official code, unless named in stop_grad_heads."""

    HEADS = {
        "decoder": lambda feat, obs_space, config: networks.MultiDecoder(feat, obs_space, config.decoder,
                                                                        config.dyn_deter),
        "reward": lambda feat, obs_space, config: networks.Head(
            feat, (), config.reward_head.layers, config.units, config.act, config.norm, config.reward_head.dist,
            config.reward_head.outscale),
        "cont": lambda feat, obs_space, config: networks.Head(
            feat, (1,), config.cont_head.layers, config.units, config.act, config.norm, "binary",
            config.cont_head.outscale),
    }

    def __init__(self, obs_space, act_space, config):
        super().__init__()
        self.config = config
        self.encoder = networks.MultiEncoder(obs_space, config.encoder)
        self.rssm = networks.RSSM(config, self.encoder.outdim, act_space.shape[0])
        feat = self.rssm.feat_size
        self.heads = nn.ModuleDict({name: build(feat, obs_space, config) for name, build in self.HEADS.items()})
        for name in config.stop_grad_heads:
            if name not in self.heads:
                raise tools.ConfigError(f"Invalid value '{name}' for --stop_grad_heads; valid: {', '.join(self.heads)}")
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
        embed = self.embed(data)  # (B, T, E)
        post = self.rssm.observe(embed, data["action"], data["is_first"], start)
        losses, metrics = self.loss_terms(data, post)
        return losses, post, embed, metrics

    def loss_terms(self, data, post):
        """The terms and metrics of `loss` from the posteriors (B, T, ...) of the observed
        sequence: the heads' losses and the KL terms against the priors of the same steps,
        computed here from every step at once, as the official code does after its filter."""
        config, scales = self.config, self.scales
        feat = self.rssm.get_feat(post)  # (B, T, F)
        prior = self.rssm.prior(post["deter"])  # (B, T, ...)
        losses = {}  # term: (B, T)
        for name, head in self.heads.items():
            pred = head(feat.detach() if name in config.stop_grad_heads else feat)
            losses.update(self.HEAD_LOSSES[name](self, pred, data))
        metrics = {f"{k}_loss": (v * scales[k]).detach().mean() for k, v in losses.items()}
        losses["dyn"], losses["rep"], dyn, rep = self.rssm.kl_loss(post, prior, config.kl_free)
        kl = scales["dyn"] * losses["dyn"] + scales["rep"] * losses["rep"]
        metrics.update(kl_loss=kl.detach().mean(), dyn_loss=dyn.detach().mean(), rep_loss=rep.detach().mean(),
                       prior_entropy=self.rssm.dist(prior).entropy().detach().mean(),
                       post_entropy=self.rssm.dist(post).entropy().detach().mean())
        return losses, metrics

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
        post = self.rssm.observe(embed[:, :context], data["action"][:, :context], data["is_first"][:, :context])
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


def rollout(rssm, actor, state, steps, through_dynamics):
    """Roll `actor` out in `rssm` for `steps` steps from every state (N, ...); the actions feed the
    dynamics with their gradient only when `through_dynamics`.

    Returns the state reached and, for the `steps` states it started from, a tuple of feat (K, N, F),
    action (K, N, A) and the actor's raw outputs (K, N, D), kept so that the actor loss need not
    run the actor again. The states themselves are not kept: everything after the rollout reads
    the features, and stacking the states too would copy the deterministic state twice more.
    """
    feats, actions, outs = [], [], []
    for _ in range(steps):
        feat, out, action = act_in(rssm, actor, state)
        feats.append(feat)
        actions.append(action)
        outs.append(out)
        with torch.set_grad_enabled(through_dynamics and torch.is_grad_enabled()):  # else no graph is recorded
            state = rssm.img_step(state, action if through_dynamics else action.detach())
    stack = lambda xs: torch.stack(xs, 0)  # noqa: E731
    # Contiguous like the start states, so that every chunk of a rollout is called with the strides
    # of the first and one compiled graph serves them all (the RSSM's latents are class-major views).
    state = {k: v.contiguous() for k, v in state.items()}
    return state, (stack(feats), stack(actions), stack(outs))


def act_in(rssm, actor, state):
    """The feature of `state` (N, ...), the actor's raw outputs there and the action it samples."""
    feat = rssm.get_feat(state)
    out = actor.raw(feat.detach())
    return feat, out, actor.dist(out).sample()


class ActorCritic(nn.Module):
    """Actor and critic trained on trajectories imagined by the world model (Section 3).

    `reward_fn(feat, action) -> (reward (H, N), metrics)` supplies the reward of imagined
    states 1..H, so that the same class serves the task (extrinsic reward) and Plan2Explore
    (intrinsic reward); its metrics are returned with the loss's, not kept as a side effect, so
    that a compiled loss has none. It holds no optimizer:
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
        """Roll the policy out for imag_horizon steps H from every start state (N, ...), in chunks of
        networks.chunk_length(H) steps (imagine_steps, which compile 'update' compiles as one
        graph). Returns feat (H+1, N, F), action (H+1, N, A) and the actor's raw outputs
        (H+1, N, D) (see `rollout`); the action at the last state is sampled too but never
        executed."""
        horizon = self.config.imag_horizon
        size, state, chunks = networks.chunk_length(horizon), start, []
        for _ in range(0, horizon, size):
            state, chunk = self.imagine_steps(state, size)
            chunks.append(chunk)
        feat, out, action = act_in(self.wm[0].rssm, self.actor, state)
        chunks.append((feat[None], action[None], out[None]))
        feats, actions, outs = zip(*chunks)
        return torch.cat(feats), torch.cat(actions), torch.cat(outs)

    def imagine_steps(self, state, steps):
        """`steps` steps of the rollout from `state` (N, ...); see `rollout`. REINFORCE needs no
        gradient through the imagined dynamics: cut there, the rollout records no graph beyond the
        actor's own outputs."""
        through_dynamics = self.config.imag_gradient != "reinforce"
        return rollout(self.wm[0].rssm, self.actor, state, steps, through_dynamics)

    def loss(self, start, start_cont):
        """Imagine from the start states (N, ...) with their continue flags (N,) and return the loss
        terms {"policy": (N,), "value": (N,)} (unscaled, each the mean over the imagined steps of
        its start state), the λ-returns (H, N) and metrics, without stepping.

        The two terms send gradients only into their own network, so that one backward pass of
        their sum serves both optimizers (optim.optimize): the critic's values that the actor's
        returns bootstrap from are computed with its weights detached, and the critic learns from a
        pass of its own on the detached features. The callers freeze the world model where its
        weights would otherwise receive the actor's dynamics gradient (Update.train_step)."""
        with precision.autocast(self.config), profiled("imagination"):
            feat, action, policy_out = self.imagine(start)  # feat (H+1, N, F)
        return self.imagined_loss(feat, action, policy_out, start_cont)

    def imagined_loss(self, feat, action, policy_out, start_cont):
        """`loss` from the imagined trajectories (`imagine`'s outputs, (H+1, N, ...))."""
        config = self.config
        wm = self.wm[0]
        through_dynamics = config.imag_gradient != "reinforce"
        with precision.autocast(config):
            with profiled("imagination"):
                # REINFORCE needs no gradient through the rewards and values of imagined states.
                with torch.set_grad_enabled(through_dynamics and torch.is_grad_enabled()):
                    # Rewards of the states reached, steps 1..H: (H, N).
                    reward, reward_metrics = self.reward_fn(feat[1:], action[1:])
                # The critic's prediction on the detached features trains the critic. Under
                # REINFORCE no gradient flows through the values either, so they are that same
                # prediction, detached, as the official code reads both from one pass; the
                # dynamics gradient needs a second pass, through feat (`values`).
                critic_out = self.critic.raw(feat.detach())
                if through_dynamics:
                    value = self.values(feat)  # (H+1, N)
                else:
                    value = self.critic.dist(critic_out.detach()).mean()
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
                critic_dist = self.critic.dist(critic_out[:-1])
                critic = self.critic_loss(feat.detach(), returns.detach(), weight, critic_dist)
        # critic_value: the critic's prediction at steps 0..H-1, which the values are (`values`).
        metrics.update(imag_reward=reward.detach().mean(), imag_return=returns.detach().mean(),
                       imag_value=value.detach().mean(), critic_value=value[:-1].detach().mean(), **reward_metrics)
        return {"policy": actor, "value": critic}, returns, metrics

    def values(self, feat):
        """The critic's values of feat (..., F) with its weights detached, for the dynamics
        gradient: the λ-returns bootstrap from them and the actor's baseline is them, so that only
        the critic's own loss trains it while the dynamics gradient still flows through feat."""
        weights = {k: v.detach() for k, v in self.critic.named_parameters()}
        weights.update(self.critic.named_buffers())
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
        else:  # both (its 'auto' is settled by compilation.resolve_auto before anything is built)
            mix = config.imag_gradient_mix
            loss = mix * dynamics + (1 - mix) * reinforce
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
        return (weight[:-1] * loss).mean(0)

    def regress(self, dist, feat, returns):
        """-log p(returns) under the critic's prediction `dist` at the features `feat`; with
        slow_target also -log p of the slow critic's prediction there, which stabilises learning
        (Section 3, Critic learning). The one critic regression of imagined and replayed returns."""
        targets = [returns]
        if self.config.critic.slow_target:
            with torch.no_grad():
                targets.append(self.slow_critic(feat).mean())
        return -dist.log_prob_sum(targets)

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
    scaler, schedule = precision.use_scaler(config), {"agc": config.agc, "warmup": config.warmup}
    scales = behavior.wm[0].scales
    return {"actor": (optim.Optimizer("actor", behavior.actor.parameters(), config.actor.lr, config.actor.eps,
                                      config.actor.grad_clip, opt=config.opt, use_scaler=scaler, **schedule),
                      terms_of("actor", scales)),
            "critic": (optim.Optimizer("critic", behavior.critic.parameters(), config.critic.lr, config.critic.eps,
                                       config.critic.grad_clip, opt=config.opt, use_scaler=scaler, **schedule),
                       terms_of("critic", scales))}


def sequential_optimizers(config, world_model, behavior):
    """update 'sequential' (the paper's): one optimizer per network, the world model's with
    model_lr, opt_eps, grad_clip and weight_decay."""
    model = optim.Optimizer("model", world_model.parameters(), config.model_lr, config.opt_eps, config.grad_clip,
                            config.weight_decay, config.opt, use_scaler=precision.use_scaler(config), agc=config.agc,
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
    joint = optim.Optimizer("joint", params, config.model_lr, config.opt_eps, config.grad_clip, config.weight_decay,
                            config.opt, precision.use_scaler(config), config.agc, config.warmup)
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
    return optim.optimize({opt: scaled_sum(losses, scales, terms) for opt, terms in optimizers.values()})


def behavior_regions(behavior, optimizers, replay=False):
    """What compile 'update' compiles whole of an actor-critic: its imagination in chunks of steps
    and its loss on the imagined trajectories, with `replay` its replay value loss, its optimizers'
    steps (`optimizers`, {name: (Optimizer, terms)}) and the slow critic's EMA."""
    return [(behavior, "imagine_steps"), (behavior, "imagined_loss"), *[(behavior, "replay_loss")] * bool(replay),
            *[(opt.opt, "step") for opt, _ in optimizers.values()], (behavior, "update_slow_critic")]


def loss(behavior, data, start=None, part="all", post=None, replay=True):
    """The loss as the official Agent.loss computes it, on replayed data (B, T, ...) filtered from
    the latent `start` (None: the initial state): ({term: (B, T), repval (B, T - 1)} unscaled,
    the posteriors (B, T, ...), the embedding, metrics). `part` (PARTS): 'all' the three parts;
    'world_model' the first; 'behavior' Imagination and Replay from the given posteriors `post`,
    the world model frozen (it stepped already). `replay` False leaves the replay value loss out
    (Plan2Explore's actor-critic); it is computed only where critic.repval weighs it.
    `behavior` is the actor-critic (the task's, or an exploration behaviour's); its metrics are
    named with its prefix."""
    config, wm = behavior.config, behavior.wm[0]
    losses, metrics, embed = {}, {}, None
    if part != "behavior":
        # World model
        with profiled("world_model"):
            losses, post, embed, metrics = wm.loss(data, start)  # {term: (B, T)}
    if part == "world_model":
        return losses, post, embed, metrics
    size, length = data["is_first"].shape
    # The actor's dynamics gradient flows through the world model; its weights need none where it
    # stepped already (update 'sequential').
    with frozen(wm) if part == "behavior" else contextlib.nullcontext():
        # Imagination: from every posterior state, with its continue flag.
        starts = {k: v.detach().reshape(size * length, *v.shape[2:]) for k, v in post.items()}
        terms, returns, found = behavior.loss(starts, data["cont"].reshape(-1))
        losses.update({k: v.unflatten(0, (size, length)) for k, v in terms.items()})  # (N,) -> (B, T)
        # Replay: the critic also learns the replayed returns, bootstrapped from the imagined ones;
        # under 'all' (update joint) through the posteriors' graph, training the representation too.
        if replay and config.critic.repval:
            feat = wm.rssm.get_feat(post)  # (B, T, F)
            losses["repval"] = behavior.replay_loss(feat if part == "all" else feat.detach(), data,
                                                    returns[0].detach().reshape(size, length))
            found["critic_repval_loss"] = losses["repval"].detach().mean()
    metrics.update({behavior.prefix + k: v for k, v in found.items()})
    return losses, post, embed, metrics


# update -> the parts of the loss in the order they are computed, each with the optimizers that
# step once it is computed: 'sequential' (the paper's) steps the world model first, then imagines
# from its posteriors with its weights frozen; 'joint' (the 2024 recipe's) computes every part at
# the same parameters and steps one optimizer on their sum.
PARTS = {"sequential": (("world_model", ("model",)), ("behavior", ("actor", "critic"))),
         "joint": (("all", ("joint",)),)}
BEHAVIOR_PARTS = (("behavior", ("actor", "critic")),)  # an actor-critic with optimizers of its own


def run_update(config, parts, compute, apply, check=None):
    """The one order of every update (the task's Update, Plan2Explore's actor-critic and every
    seed's in seeds.BatchedUpdate): for each (part, optimizer names) of `parts` (PARTS),
    compute(part, post) -> (terms, post, embed, metrics) from the last part's posteriors, then
    apply(names, losses) -> metrics steps those optimizers on the terms so far; check(losses) runs
    before the last step. Returns (losses, post, embed, metrics)."""
    losses, metrics, post, embed = {}, {}, None, None
    with precision.autocast(config):
        for i, (part, names) in enumerate(parts):
            terms, post, found, part_metrics = compute(part, post)
            embed = embed if found is None else found
            losses.update(terms)
            metrics.update(part_metrics)
            if check is not None and i == len(parts) - 1:
                check(losses)
            with profiled("backward"):
                metrics.update(apply(names, losses))
    return losses, post, embed, metrics


def after_steps(behavior, losses, metrics, shares=False):
    """What an update does after its steps: the slow critic's EMA; with `shares` (update 'joint')
    each network's share of the one loss, logged as the sequential update logs it."""
    behavior.update_slow_critic()
    if shares:
        scales = behavior.wm[0].scales
        for name in ("model", "actor", "critic"):
            metrics[f"{name}_loss"] = scaled_sum(losses, scales, terms_of(name, scales)).detach()


class Update:
    """One update of every learner on a replayed batch: `loss` in its parts (PARTS[config.update]),
    each part's optimizers stepped once it is computed (run_update), the terms checked against the
    one table of loss scales and their shapes before the last step; then the exploration
    behaviour's own learners (Plan2Explore) from the same posteriors. The update mode decides only
    the parts and the optimizers (UPDATES): one per network for 'sequential', one for all for
    'joint' (every term at the same parameters, the replay value loss training the representation
    too)."""

    def __init__(self, config, world_model, behavior, context, exploration=None):
        self.config, self.wm, self.behavior = config, world_model, behavior
        self.context, self.exploration = context, exploration  # ReplayContext; None, or exploration.py's
        self.optimizers = UPDATES[config.update](config, world_model, behavior)  # {name: (Optimizer, terms)}

    def regions(self):
        """What compile 'update' compiles whole: the three parts' losses (the world model's as its
        encoder, its observe in chunks of steps and its loss terms; the recurrences in chunks, so
        that no graph grows with batch_length or imag_horizon), every optimizer's step and the slow
        critic's EMA."""
        return [(self.wm, "embed"), (self.wm.rssm, "observe_chunk"), (self.wm, "loss_terms"),
                *behavior_regions(self.behavior, self.optimizers, self.config.critic.repval)]

    def train_step(self, batch, data=None):
        """One update on a replayed batch (B, K + T, ...) of numpy arrays with K replay_context
        steps (`data`: the same already on the device). Returns (tensor metrics, the latents to
        write back): with K > 0 the first K steps give only the start latent, and the training
        posteriors of the T trained steps are returned to replace their stored latents
        (ReplayContext.write_back); with K = 0, None."""
        config, wm, behavior, scales = self.config, self.wm, self.behavior, self.wm.scales
        data = wm.preprocess(batch if data is None else data)
        start, data = self.context.split(data)  # the stored start latent (None: the initial state)
        size, length = data["is_first"].shape
        losses, post, embed, metrics = run_update(
            config, PARTS[config.update],
            lambda part, post: loss(behavior, data, start, part, post),
            lambda names, losses: step({name: self.optimizers[name] for name in names}, losses, scales),
            lambda losses: check_terms(losses, scales, self.optimizers, size, length))
        after_steps(behavior, losses, metrics, shares=config.update == "joint")
        post = {k: v.detach() for k, v in post.items()}
        if self.exploration is not None:  # its own learners, from the same posteriors (B, T, ...)
            metrics.update(self.exploration.train_step(post, embed.detach(), data))
        return metrics, self.context.latents(post)


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
