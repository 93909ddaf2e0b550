"""The world model and the actor-critic that learns inside it (Sections 2 and 3 of the paper)."""

import contextlib
import copy

import numpy as np
import torch
from torch import nn

import networks
import tools


class Optimizer:
    """Adam(W) with gradient-norm clipping and, for float16, a gradient scaler.

    Metrics stay tensors so that an update never waits on the device. Under torchrun `ranks`
    (see Dreamer.distribute) averages the gradients over processes between the backward pass and
    the clipping: an explicit all-reduce of the flattened gradients rather than
    DistributedDataParallel, because the losses backpropagate into chosen parameters only
    (`backward(inputs=...)`) and the actor's pass keeps the graph for the critic's, which DDP's
    hooks on whole modules do not model. Clipping and the scaler then see the averaged gradient.
    """

    ranks = tools.SingleProcess()

    SETTINGS = ("lr", "eps", "weight_decay")  # taken from the config, also on resume

    def __init__(self, name, params, lr, eps, clip, weight_decay=0.0, opt="adam", use_scaler=False):
        self.name, self.clip = name, clip
        self.params = [p for p in params if p.requires_grad]
        if opt not in ("adam", "adamw"):
            raise ValueError(f"Unknown opt '{opt}'; valid: adam, adamw")
        cls = torch.optim.AdamW if opt == "adamw" else torch.optim.Adam
        self.opt = cls(self.params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)
        self.scaler = torch.amp.GradScaler(enabled=use_scaler)

    def __call__(self, loss, retain_graph=False):
        """Backpropagate `loss` into this optimizer's parameters only (no gradient is computed for
        any other module the loss depends on), clip and step."""
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward(inputs=self.params, retain_graph=retain_graph)
        self.ranks.average_(p.grad for p in self.params if p.grad is not None)
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()
        return {f"{self.name}_loss": loss.detach(), f"{self.name}_grad_norm": norm.detach()}

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        """Load the moments and step counts, but keep this run's settings (lr, eps, weight decay):
        a user who changed them on resume means them. Returns one line per setting that differs
        from the saved one."""
        settings = [{k: group[k] for k in self.SETTINGS} for group in self.opt.param_groups]
        self.opt.load_state_dict(state["opt"])
        self.scaler.load_state_dict(state["scaler"])
        changes = []
        for group, current in zip(self.opt.param_groups, settings):
            for key, value in current.items():
                if group[key] != value:
                    changes.append(f"{self.name} {key} {group[key]:g} -> {value:g}")
                group[key] = value
        return changes


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


def autocast(config):
    """bfloat16 autocast on CPU, float16 on CUDA, when precision is 16."""
    if config.precision == 32:
        return contextlib.nullcontext()
    device = torch.device(config.device).type
    return torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16)


class WorldModel(nn.Module):
    """Encoder, RSSM and prediction heads (decoder, reward, continue), trained on replayed sequences."""

    def __init__(self, obs_space, act_space, config):
        super().__init__()
        self.config = config
        self.encoder = networks.MultiEncoder(obs_space, config.encoder)
        self.rssm = networks.RSSM(config, self.encoder.outdim, act_space.shape[0])
        feat = self.rssm.feat_size
        self.heads = nn.ModuleDict({
            "decoder": networks.MultiDecoder(feat, obs_space, config.decoder),
            "reward": networks.Head(feat, (), config.reward_head.layers, config.units, config.act, config.norm,
                                    config.reward_head.dist, config.reward_head.outscale),
            "cont": networks.Head(feat, (1,), config.cont_head.layers, config.units, config.act, config.norm,
                                  "binary", config.cont_head.outscale),
        })
        for name in config.grad_heads:
            if name not in self.heads:
                raise ValueError(f"Unknown grad_heads entry '{name}'; valid: {', '.join(self.heads)}")
        self.loss_scales = {"reward": config.reward_head.loss_scale, "cont": config.cont_head.loss_scale}
        self.optimizer = Optimizer("model", self.parameters(), config.model_lr, config.opt_eps, config.grad_clip,
                                   config.weight_decay, config.opt, use_scaler=use_scaler(config))

    def preprocess(self, obs):
        """numpy/tensor batch -> float tensors on the device; images to [0, 1], cont = 1 - terminal."""
        device = self.rssm.img_stats.weight.device
        data = {}
        for key, value in obs.items():
            if key.startswith("log_"):
                continue
            value = torch.as_tensor(np.asarray(value), device=device)
            data[key] = value.float() / 255.0 if value.dtype == torch.uint8 else value.float()
        if "is_terminal" in data:
            data["cont"] = 1.0 - data["is_terminal"]
        return data

    def embed(self, data):  # dict of (B, T, ...) -> (B, T, E)
        lead = data["is_first"].shape
        flat = {k: v.reshape(-1, *v.shape[len(lead):]) for k, v in data.items()}
        return self.encoder(flat).reshape(*lead, -1)

    def loss(self, data):
        """World-model loss (Eq. 4-5) on a batch (B, T, ...); returns loss, posterior, embed, metrics."""
        config = self.config
        embed = self.embed(data)  # (B, T, E)
        post, prior = self.rssm.observe(embed, data["action"], data["is_first"])
        kl, dyn, rep = self.rssm.kl_loss(post, prior, config.kl_free, config.dyn_scale, config.rep_scale)
        feat = self.rssm.get_feat(post)  # (B, T, F)
        losses = {}
        for name, head in self.heads.items():
            pred = head(feat if name in config.grad_heads else feat.detach())
            if name == "decoder":
                for key, dist in pred.items():
                    losses[key] = -dist.log_prob(data[key])
            elif name == "reward":
                losses["reward"] = -pred.log_prob(data["reward"]) * self.loss_scales["reward"]
            else:
                losses["cont"] = -pred.log_prob(data["cont"][..., None]) * self.loss_scales["cont"]
        loss = (sum(losses.values()) + kl).mean()
        metrics = {f"{k}_loss": v.detach().mean() for k, v in losses.items()}
        metrics.update(kl_loss=kl.detach().mean(), dyn_loss=dyn.detach().mean(), rep_loss=rep.detach().mean(),
                       prior_entropy=self.rssm.dist(prior).entropy().detach().mean(),
                       post_entropy=self.rssm.dist(post).entropy().detach().mean())
        return loss, post, embed, metrics

    def train_step(self, data):
        """One world-model update; returns the detached posterior and embedding (B, T, ...)."""
        with profiled("world_model"), autocast(self.config):
            loss, post, embed, metrics = self.loss(data)
            metrics.update(self.optimizer(loss))
        return {k: v.detach() for k, v in post.items()}, embed.detach(), metrics

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


def use_scaler(config):
    return config.precision == 16 and torch.device(config.device).type == "cuda"


def lambda_return(reward, cont, value, discount, lambda_):
    """λ-returns (Eq. 7), computed backwards from the bootstrap value.

    Inputs are (H, N) for imagined steps 1..H: reward r_t, continue flag c_t and value v_t.
    Output (H, N) for steps 0..H-1: R_t = r_{t+1} + γ c_{t+1} ((1 - λ) v_{t+1} + λ R_{t+1}),
    with R_H = v_H.
    """
    returns, last = [], value[-1]
    for t in reversed(range(len(reward))):
        last = reward[t] + discount * cont[t] * ((1 - lambda_) * value[t] + lambda_ * last)
        returns.append(last)
    return torch.stack(returns[::-1])


class ReturnNorm(nn.Module):
    """Return normalisation (Eq. 8): scale S = max(1, EMA(P95) - EMA(P5)) over the batch of returns.

    Under torchrun the percentiles are those of every process's returns together (all-gathered),
    so that the EMAs stay identical on every rank and equal those of one process on the whole batch.
    """

    ranks = tools.SingleProcess()

    def __init__(self, decay=0.99, low=0.05, high=0.95, floor=1.0):
        super().__init__()
        self.decay, self.quantiles, self.floor = decay, (low, high), floor
        self.register_buffer("low", torch.zeros(()))
        self.register_buffer("high", torch.zeros(()))

    def forward(self, returns):
        """Update the EMAs with a batch of returns; return (offset, scale)."""
        flat = self.ranks.all_gather(returns.detach().float().flatten())  # (world_size * H * N,)
        q = torch.quantile(flat, torch.tensor(self.quantiles, device=flat.device))
        self.low.mul_(self.decay).add_((1 - self.decay) * q[0])
        self.high.mul_(self.decay).add_((1 - self.decay) * q[1])
        return self.low.clone(), torch.clamp(self.high - self.low, min=self.floor)


class ActorCritic(nn.Module):
    """Actor and critic trained on trajectories imagined by the world model (Section 3).

    `reward_fn(feat, state, action) -> (H+1, N)` supplies the reward, so that the same class
    serves the task (extrinsic reward) and Plan2Explore (intrinsic reward).
    """

    def __init__(self, config, world_model, act_space, reward_fn, prefix=""):
        super().__init__()
        self.config, self.prefix = config, prefix
        self.wm = [world_model]  # a list keeps the world model out of this module's parameters
        self.reward_fn = reward_fn
        feat = world_model.rssm.feat_size
        actor_config = copy.copy(config.actor)
        actor_config.units = config.units
        self.actor = networks.Actor(feat, act_space.shape[0], actor_config, config.act, config.norm)
        critic = config.critic
        if critic.dist not in ("symlog_disc", "symlog_mse"):
            raise ValueError(f"Unknown critic.dist '{critic.dist}'; valid: symlog_disc, symlog_mse")
        self.critic = networks.Head(feat, (), critic.layers, config.units, config.act, config.norm,
                                    critic.dist, critic.outscale)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.return_norm = ReturnNorm() if config.reward_EMA else None
        if config.imag_gradient not in ("dynamics", "reinforce", "both"):
            raise ValueError(f"Unknown imag_gradient '{config.imag_gradient}'; valid: dynamics, reinforce, both")
        scaler = use_scaler(config)
        self.actor_opt = Optimizer("actor", self.actor.parameters(), config.actor.lr, config.actor.eps,
                                   config.actor.grad_clip, opt=config.opt, use_scaler=scaler)
        self.critic_opt = Optimizer("critic", self.critic.parameters(), config.critic.lr,
                                    config.critic.eps, config.critic.grad_clip, opt=config.opt, use_scaler=scaler)
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def imagine(self, start):
        """Roll the policy out for imag_horizon steps from every start state (N, ...).

        Returns feat (H+1, N, F), state dict (H+1, N, ...), action (H+1, N, A) and the actor's raw
        outputs (H+1, N, D), kept so that the actor loss need not run the actor again.
        The action at the last state is sampled too but never executed.
        """
        rssm = self.wm[0].rssm
        # REINFORCE needs no gradient through the imagined dynamics; cut there, the rollout records
        # no graph beyond the actor's own outputs.
        through_dynamics = self.config.imag_gradient != "reinforce"
        state = start
        feats, states, actions, outs = [], [], [], []
        for t in range(self.config.imag_horizon + 1):
            feat = rssm.get_feat(state)
            out = self.actor.raw(feat.detach())
            action = self.actor.dist(out).sample()
            feats.append(feat)
            states.append(state)
            actions.append(action)
            outs.append(out)
            if t < self.config.imag_horizon:
                state = rssm.img_step(state, action if through_dynamics else action.detach())
        stack = lambda xs: torch.stack(xs, 0)  # noqa: E731
        states = {k: stack([s[k] for s in states]) for k in states[0]}
        return stack(feats), states, stack(actions), stack(outs)

    def train_step(self, start, start_cont):
        """One actor and one critic update from posterior states start (N, ...) with their
        continue flags start_cont (N,)."""
        config = self.config
        wm = self.wm[0]
        with frozen(wm), autocast(config):
            with profiled("imagination"):
                feat, state, action, policy_out = self.imagine(start)
                # Rewards of the states reached, steps 1..H: (H, N).
                reward = self.reward_fn(feat[1:], {k: v[1:] for k, v in state.items()}, action[1:])
                with torch.no_grad():  # the continue flags carry no gradient (Bernoulli mode)
                    cont = torch.cat([start_cont[None], wm.heads["cont"](feat[1:]).mode()[..., 0]], 0)
                # The weight discounts losses of states the model believes lie past an episode end.
                weight = (torch.cumprod(config.discount * cont, 0) / config.discount).detach()
                # One critic pass serves both losses: its values bootstrap the returns (the actor's
                # dynamics gradient flows through them into feat) and its outputs at steps 0..H-1
                # are what the critic loss trains. Each optimizer backpropagates into its own
                # parameters only, so neither loss leaks into the other network.
                critic_out = self.critic.raw(feat)  # (H+1, N, bins)
                value = self.critic.dist(critic_out).mean()  # (H+1, N)
                returns = lambda_return(reward, cont[1:], value[1:], config.discount, config.discount_lambda)
            with profiled("actor"):  # includes the backward pass through the imagined trajectories
                policy = self.actor.dist(policy_out[:-1])
                # The baseline keeps its gradient, as in v1: the dynamics gradient of the advantage
                # also flows through v(s_t) of the imagined states (into the actor only).
                actor_loss, metrics = self.actor_loss(feat, action, returns, weight, policy, value[:-1])
                metrics.update(self.actor_opt(actor_loss, retain_graph=True))  # the critic's graph is reused
            with profiled("critic"):
                critic_dist = self.critic.dist(critic_out[:-1])
                critic_loss, critic_metrics = self.critic_loss(feat.detach(), returns.detach(), weight, critic_dist)
                metrics.update(critic_metrics)
                metrics.update(self.critic_opt(critic_loss))
        self.update_slow_critic()
        metrics.update(imag_reward=reward.detach().mean(), imag_return=returns.detach().mean(),
                       imag_value=value.detach().mean())
        return {self.prefix + k: v for k, v in metrics.items()}

    def actor_loss(self, feat, action, returns, weight, policy=None, base=None):
        """Policy gradient on normalised λ-returns plus the entropy bonus (Eq. 6), per step 0..H-1.

        `policy` and `base` (the critic's values) at steps 0..H-1 are computed from feat unless given;
        the dynamics gradient flows through both the returns and the base.
        """
        config = self.config
        if policy is None:
            policy = self.actor(feat[:-1].detach())
        if base is None:
            base = self.critic(feat[:-1]).mean()
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
        else:
            mix = config.imag_gradient_mix
            loss = mix * dynamics + (1 - mix) * reinforce
        entropy = policy.entropy()
        loss = loss - config.actor.entropy * entropy
        metrics = {"actor_entropy": entropy.detach().mean(), "return_scale": scale.detach(),
                   "advantage": advantage.detach().mean()}
        return (weight[:-1] * loss).mean(), metrics

    def critic_loss(self, feat, returns, weight, dist=None):
        """Critic learns the λ-returns; with slow_target it is also pulled to the slow critic's
        predictions, which stabilises learning (Section 3, Critic learning).

        `dist`, the critic's prediction at steps 0..H-1, is computed from feat unless given.
        """
        if dist is None:
            dist = self.critic(feat[:-1])
        loss = -dist.log_prob(returns)
        if self.config.critic.slow_target:
            with torch.no_grad():
                slow = self.slow_critic(feat[:-1]).mean()
            loss = loss - dist.log_prob(slow)
        return (weight[:-1] * loss).mean(), {"critic_value": dist.mean().detach().mean()}

    @torch.no_grad()
    def update_slow_critic(self):
        """EMA of the critic's weights every slow_target_update updates."""
        config = self.config.critic
        if self.updates % config.slow_target_update == 0:
            mix = config.slow_target_fraction
            for slow, fast in zip(self.slow_critic.parameters(), self.critic.parameters()):
                slow.mul_(1 - mix).add_(mix * fast)
        self.updates += 1

    def optimizer_state(self):
        return {"actor": self.actor_opt.state_dict(), "critic": self.critic_opt.state_dict()}

    def load_optimizer_state(self, state):
        """Returns the settings that differ from the saved ones (see Optimizer.load_state_dict)."""
        return self.actor_opt.load_state_dict(state["actor"]) + self.critic_opt.load_state_dict(state["critic"])
