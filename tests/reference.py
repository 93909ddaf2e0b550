"""The DreamerV3 update written out a second time, independently of the product, for the tests.

One update of the world model, the actor and the critic on a replayed batch, for the paper's recipe (v1: update
'sequential', Adam with a global-norm clip, symlog two-hot reward and critic, the continue flag as the target) and
the 2024 recipe (update 'joint', LaProp with adaptive clipping, symexp-spaced two-hot bins, the discount as the
continue target, the replay value loss `repval` and the replay context), from the paper (arXiv 2301.04104) and the
official code (danijar/dreamerv3: Agent.loss, imag_loss, repl_loss, lambda_return, the percentile return norm).

Every formula is written here in plain tensor arithmetic: the preprocessing, the RSSM's filtering with its resets
at episode starts and its straight-through categorical samples, symlog, the two-hot encoding, the decoder, reward
and continue losses, the KL balancing with free nats, imagination, the continue weights, the λ-returns, the
percentile EMA, the actor loss with its entropy bonus, the critic loss against the slow critic, the replay value
loss, the optimizers' clipping and steps and the slow critic's EMA. What it takes from the product is weights:
the networks' layers (`agent.wm.encoder`, the RSSM's `img_in`, `cell`, `img_out`, `img_stats`, `obs_out`,
`obs_stats`, the heads' `mlp` and `out`, the decoder's `cnn`, `mlp` and `mlp_out`), called as functions of their
inputs, and the config's numbers. It imports nothing of the product (tests/test_reference.py checks that): no
distribution, loss, return, normaliser, optimizer or update of the product is called.

Random numbers are drawn from torch's global generator in the order the product draws them (per observed step
the prior's then the posterior's categorical noise; per imagined step the action's Gaussian noise, then the next
prior's), so that with the same seed both sample the same latents and actions.
"""

import math

import torch

BINS = 255


# ==================================================================================================
# Formulas
# ==================================================================================================


def symlog(x):
    return torch.sign(x) * torch.log(1 + torch.abs(x))


def symexp(x):
    return torch.sign(x) * (torch.exp(torch.abs(x)) - 1)


def bins_of(kind, device=None):
    """The 255 bins of a two-hot head: equally spaced in [-20, 20] (the paper's symlog_disc, whose target and
    prediction are in symlog space) or symexp of those points (the 2024 recipe's symexp_twohot)."""
    points = torch.linspace(-20.0, 20.0, BINS, device=device)
    return points if kind == "symlog_disc" else symexp(points)


def twohot(x, bins):
    """(...) -> (..., bins): weight on the two bins around x, by linear interpolation; at the ends all on one."""
    x = x.clamp(bins[0], bins[-1])
    above = torch.searchsorted(bins, x.contiguous(), right=True).clamp(1, len(bins) - 1)
    below = above - 1
    frac = ((x - bins[below]) / (bins[above] - bins[below])).clamp(0, 1)
    out = torch.zeros(*x.shape, len(bins), device=x.device)
    out.scatter_add_(-1, below[..., None], (1 - frac)[..., None])
    out.scatter_add_(-1, above[..., None], frac[..., None])
    return out


def twohot_log_prob(logits, kind, value):
    """log p(value) of a two-hot head: the cross-entropy of softmax(logits) against the two-hot target of
    symlog(value) (symlog_disc) or of value itself (symexp_twohot)."""
    bins = bins_of(kind, logits.device)
    target = twohot(symlog(value) if kind == "symlog_disc" else value, bins)
    return (target * torch.log_softmax(logits.float(), -1)).sum(-1)


def twohot_mean(logits, kind):
    bins = bins_of(kind, logits.device)
    expected = (torch.softmax(logits.float(), -1) * bins).sum(-1)
    return symexp(expected) if kind == "symlog_disc" else expected


def bernoulli_log_prob(logit, target):
    return target * torch.nn.functional.logsigmoid(logit) + (1 - target) * torch.nn.functional.logsigmoid(-logit)


def mixed_probs(logits, mix):
    """softmax(logits) with `mix` of the uniform distribution mixed in."""
    probs = torch.softmax(logits.float(), -1)
    return (1 - mix) * probs + mix / logits.shape[-1]


def straight_through(index, probs):
    """The one-hot vectors of `index` whose gradient is that of `probs`."""
    onehot = torch.zeros_like(probs).scatter_(-1, index[..., None], 1.0)
    return onehot + probs - probs.detach()


def sample_categorical(probs):
    """One sample per categorical by the inverse CDF of one uniform number each (as the product draws them)."""
    cdf = probs.detach().cumsum(-1)
    noise = torch.rand(*cdf.shape[:-1], 1, device=probs.device)
    index = (cdf < noise * cdf[..., -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
    return straight_through(index, probs)


def categorical_kl(p, q):
    """KL[p || q] of independent categoricals given by their probabilities (..., S, C), summed: (...)."""
    return (p * (torch.log(p) - torch.log(q))).sum((-2, -1))


def normal_log_prob(x, mean, std):
    return (-0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)


def normal_entropy(std):
    return (0.5 * torch.log(2 * math.pi * math.e * std ** 2)).sum(-1)


def lambda_returns(reward, cont, value, discount, lam):
    """reward, cont, value (H, N) of steps 1..H -> R_0..R_{H-1} (H, N), lam a number or (H, N):
    R_t = r_{t+1} + γ c_{t+1} ((1 - λ_{t+1}) v_{t+1} + λ_{t+1} R_{t+1}), R_H = v_H."""
    lam = torch.as_tensor(lam, dtype=reward.dtype).expand_as(reward)
    out = [None] * len(reward)
    following = value[-1]
    for t in range(len(reward) - 1, -1, -1):
        following = reward[t] + discount * cont[t] * ((1 - lam[t]) * value[t] + lam[t] * following)
        out[t] = following
    return torch.stack(out)


def percentile_ema(returns, low, high, decay=0.99):
    """The return normalisation: EMAs of the 5th and 95th percentile of the batch of returns. Returns the new
    (low, high), the offset (low) and the scale max(1, high - low)."""
    flat = returns.detach().flatten()
    low = decay * low + (1 - decay) * torch.quantile(flat, 0.05)
    high = decay * high + (1 - decay) * torch.quantile(flat, 0.95)
    return low, high, low, torch.clamp(high - low, min=1.0)


# ==================================================================================================
# Networks, called as functions of the product's weights
# ==================================================================================================


def out_layer(layer, x, detach=False):
    """An output layer written out where it is one dense layer: its weight and bias applied as stored,
    so that the two-hot heads' logits come in the bins' ascending order (the layer itself emits them
    mirrored)."""
    if isinstance(layer, torch.nn.Linear):
        weight, bias = layer.weight, layer.bias
        if detach:
            weight, bias = weight.detach(), bias.detach()
        return torch.nn.functional.linear(x, weight, bias)
    if detach:
        return torch.func.functional_call(layer, {k: v.detach() for k, v in layer.named_parameters()}, (x,))
    return layer(x)


def mlp_head(head, x):
    return out_layer(head.out, head.mlp(x))


def detached_head(head, x):
    """The head's output at x with its weights detached: a gradient reaches x, none the weights."""
    x = torch.func.functional_call(head.mlp, {k: v.detach() for k, v in head.mlp.named_parameters()}, (x,))
    return out_layer(head.out, x, detach=True)


def actor_dist(actor, config, feat):
    """(mean, std) of the actor's Gaussian at feat: tanh mean, std in [min_std, max_std] through a sigmoid
    shifted by 2 (learned std, the continuous actions of both recipes)."""
    assert config.actor.dist == "normal" and config.actor.std == "learned", config.actor.dist
    mean, std = mlp_head(actor, feat).chunk(2, -1)
    low, high = config.actor.min_std, config.actor.max_std
    return torch.tanh(mean), (high - low) * torch.sigmoid(std + 2.0) + low


def sample_action(mean, std, absmax):
    """mean + std * noise; with absmax the sample scaled back into [-absmax, absmax] with a straight-through
    gradient, without it (2024) left for the environment to clip."""
    sample = mean + torch.empty(mean.shape, device=mean.device).normal_() * std
    if absmax:
        sample = sample * (absmax / torch.clamp(sample.abs(), min=absmax)).detach()
    return sample


class RSSM:
    """The RSSM's transitions over the product's layers: discrete latents (S categoricals of C classes)."""

    def __init__(self, rssm, config):
        assert config.dyn_discrete, "the reference covers the discrete latents of both recipes"
        self.net, self.config = rssm, config
        self.stoch, self.classes, self.deter = config.dyn_stoch, config.dyn_discrete, config.dyn_deter

    def probs(self, x):
        return mixed_probs(x.reshape(*x.shape[:-1], self.stoch, self.classes), self.config.unimix_ratio)

    def initial(self, batch):
        if self.config.initial == "zeros":
            deter = torch.zeros(batch, self.deter)
            return {"deter": deter, "stoch": torch.zeros(batch, self.stoch, self.classes)}
        deter = torch.tanh(self.net.initial_deter).expand(batch, self.deter)
        probs = self.probs(self.net.img_stats(self.net.img_out(deter)))
        return {"deter": deter, "stoch": straight_through(probs.argmax(-1), probs)}

    def feat(self, state):
        return torch.cat([state["stoch"].flatten(-2), state["deter"]], -1)

    def recurrent(self, state, action):
        x = self.net.img_in(torch.cat([state["stoch"].flatten(-2), action], -1))
        deter = state["deter"]
        for _ in range(self.config.dyn_rec_depth):
            deter = self.net.cell(x, deter)
        return deter

    def prior(self, state, action):
        deter = self.recurrent(state, action)
        probs = self.probs(self.net.img_stats(self.net.img_out(deter)))
        return {"deter": deter, "stoch": sample_categorical(probs), "probs": probs}

    def observe(self, embed, action, is_first, start):
        """Filter (B, T) steps from `start` (None: the initial state); at an episode start the state and the
        action before it are reset to the initial ones. Returns posterior and prior, dicts of (B, T, ...); the
        prior is computed after the filter from every step's deter and drawn from nowhere (official rssm.loss)."""
        init = self.initial(embed.shape[0])
        state = init if start is None else start
        posts = []
        for t in range(embed.shape[1]):
            keep = 1 - is_first[:, t]
            state = {k: state[k] * keep.reshape(-1, *[1] * (state[k].dim() - 1))
                     + init[k] * (1 - keep).reshape(-1, *[1] * (init[k].dim() - 1)) for k in ("deter", "stoch")}
            deter = self.recurrent(state, action[:, t] * keep[:, None])
            probs = self.probs(self.net.obs_stats(self.net.obs_out(torch.cat([deter, embed[:, t]], -1))))
            state = {"deter": deter, "stoch": sample_categorical(probs), "probs": probs}
            posts.append(state)
        post = {k: torch.stack([s[k] for s in posts], 1) for k in posts[0]}
        return post, {"deter": post["deter"], "probs": self.probs(self.net.img_stats(self.net.img_out(post["deter"])))}


# ==================================================================================================
# The losses
# ==================================================================================================


def preprocess(batch, context):
    """numpy batch (B, K + T, ...) -> float tensors: images in [0, 1], cont = 1 - is_terminal; the start latent
    of the replay context (the stored latent of step K - 1; None for K = 0) and the T trained steps."""
    data = {}
    for key, value in batch.items():
        value = torch.as_tensor(value)
        data[key] = value.float() / 255 if value.dtype == torch.uint8 else value.float()
    data["cont"] = 1 - data["is_terminal"]
    if not context:
        return None, data
    start = {"deter": data["latent_deter"][:, context - 1], "stoch": data["latent_stoch"][:, context - 1]}
    return start, {k: v[:, context:] for k, v in data.items() if not k.startswith("latent_")}


def world_model_loss(agent, data, start):
    """The world model's terms (B, T), unscaled: one per decoded key (squared error of the image, of symlog of
    a vector), rew (two-hot), con (Bernoulli of the flag or, with contdisc, of flag x discount), dyn and rep
    (KL balancing with free nats); and the posterior, with its features."""
    config, wm = agent.config, agent.wm
    rssm = RSSM(wm.rssm, config)
    batch, length = data["is_first"].shape
    flat = {k: v.flatten(0, 1) for k, v in data.items()}
    embed = wm.encoder(flat).unflatten(0, (batch, length))
    post, prior = rssm.observe(embed, data["action"], data["is_first"], start)
    feat = rssm.feat(post)
    # A head's loss trains the representation unless the head is named in stop_grad_heads (as in the official code).
    inputs = {name: feat.detach() if name in config.stop_grad_heads else feat for name in ("decoder", "reward", "cont")}
    decoder, terms = wm.heads["decoder"], {}
    if decoder.cnn_shapes:
        image = decoder.cnn(inputs["decoder"])
        for key, part in zip(decoder.cnn_shapes, image.split([s[-1] for s in decoder.cnn_shapes.values()], -1)):
            terms[key] = ((part - data[key]) ** 2).sum((-3, -2, -1))
    if decoder.mlp_shapes:
        out = decoder.mlp_out(decoder.mlp(inputs["decoder"]))
        assert config.decoder.vector_dist == "symlog_mse", config.decoder.vector_dist
        for key, part in zip(decoder.mlp_shapes, out.split(decoder.sizes, -1)):
            terms[key] = ((part - symlog(data[key].reshape(part.shape))) ** 2).sum(-1)
    logits = mlp_head(wm.heads["reward"], inputs["reward"])
    terms["rew"] = -twohot_log_prob(logits, config.reward_head.dist, data["reward"])
    target = data["cont"] * config.discount if config.cont_head.contdisc else data["cont"]
    terms["con"] = -bernoulli_log_prob(mlp_head(wm.heads["cont"], inputs["cont"])[..., 0], target)
    sg = lambda x: x.detach()  # noqa: E731
    raw_dyn = categorical_kl(sg(post["probs"]), prior["probs"])
    raw_rep = categorical_kl(post["probs"], sg(prior["probs"]))
    terms["dyn"] = torch.clamp(raw_dyn, min=config.kl_free)
    terms["rep"] = torch.clamp(raw_rep, min=config.kl_free)
    return terms, post, feat, {"dyn_loss": raw_dyn.mean(), "rep_loss": raw_rep.mean()}


def imagine(agent, start, through_dynamics):
    """Roll the actor out for imag_horizon steps from the start states (N, ...): features (H+1, N, F) and
    actions (H+1, N, A); the actions feed the dynamics with their gradient only when `through_dynamics`."""
    config, wm = agent.config, agent.wm
    rssm = RSSM(wm.rssm, config)
    state, feats, actions = start, [], []
    for t in range(config.imag_horizon + 1):
        feat = rssm.feat(state)
        mean, std = actor_dist(agent.task_behavior.actor, config, feat.detach())
        action = sample_action(mean, std, config.actor.absmax)
        feats.append(feat)
        actions.append(action)
        if t < config.imag_horizon:
            with torch.set_grad_enabled(through_dynamics):
                state = rssm.prior(state, action if through_dynamics else action.detach())
    return torch.stack(feats), torch.stack(actions)


def behavior_loss(agent, post, data, norm_state):
    """The actor's and the critic's terms (N,) from every posterior state, the λ-returns (H, N), the new state
    of the return normalisation and metrics."""
    config, wm, ac = agent.config, agent.wm, agent.task_behavior
    through_dynamics = config.imag_gradient != "reinforce"
    start = {k: post[k].detach().flatten(0, 1) for k in ("deter", "stoch")}
    start_cont = data["cont"].flatten()
    feat, action = imagine(agent, start, through_dynamics)
    with torch.set_grad_enabled(through_dynamics):
        reward = twohot_mean(mlp_head(wm.heads["reward"], feat[1:]), config.reward_head.dist)
        value = twohot_mean(detached_head(ac.critic, feat), config.critic.dist)  # the baseline trains no critic
    with torch.no_grad():
        logit = mlp_head(wm.heads["cont"], feat)[..., 0]
        if config.cont_head.contdisc:  # the head's probability is the discount itself
            cont, discount = torch.sigmoid(logit), 1.0
        else:  # the replayed flag at the start, then the head's mode, times γ
            cont, discount = torch.cat([start_cont[None], (logit[1:] > 0).float()]), config.discount
    weight = torch.cumprod(discount * cont, 0) / discount
    returns = lambda_returns(reward, cont[1:], value[1:], discount, config.discount_lambda)
    if config.reward_EMA:
        low, high, offset, scale = percentile_ema(returns, *norm_state)
    else:
        low, high, offset, scale = *norm_state, torch.zeros(()), torch.ones(())
    mean, std = actor_dist(ac.actor, config, feat[:-1].detach())
    advantage = (returns - offset) / scale - (value[:-1] - offset) / scale
    reinforce = -normal_log_prob(action[:-1].detach(), mean, std) * advantage.detach()
    mix = {"dynamics": 1.0, "reinforce": 0.0, "both": config.imag_gradient_mix}[config.imag_gradient]
    policy = mix * -advantage + (1 - mix) * reinforce if mix else reinforce
    policy = policy - config.actor.entropy * normal_entropy(std)
    critic_logits = mlp_head(ac.critic, feat[:-1].detach())
    critic = -twohot_log_prob(critic_logits, config.critic.dist, returns.detach())
    if config.critic.slow_target:
        with torch.no_grad():
            slow = twohot_mean(mlp_head(ac.slow_critic, feat[:-1].detach()), config.critic.dist)
        critic = critic - twohot_log_prob(critic_logits, config.critic.dist, slow)
    terms = {"policy": (weight[:-1] * policy).mean(0), "value": (weight[:-1] * critic).mean(0)}
    return terms, returns, (low, high), {"return_scale": scale}


def replay_value_loss(agent, feat, data, boot):
    """The 2024 recipe's replay value loss (B, T - 1): the critic at the posterior features of steps 0..T-2
    learns the λ-returns of the replayed rewards and terminations, bootstrapped at every step from `boot` (the
    imagined λ-return from that step's posterior), λ 0 after an episode's last step; steps that end an episode
    weigh nothing; with the slow critic's regulariser."""
    config, ac = agent.config, agent.task_behavior
    is_last, term = data["is_last"], data["is_terminal"]
    returns = torch.zeros_like(boot[:, :-1])
    following = boot[:, -1]
    for t in range(boot.shape[1] - 2, -1, -1):  # R_t from step t + 1
        lam = config.discount_lambda * (1 - is_last[:, t + 1])
        following = data["reward"][:, t + 1] + config.discount * (1 - term[:, t + 1]) * (
            (1 - lam) * boot[:, t + 1] + lam * following)
        returns[:, t] = following
    logits = mlp_head(ac.critic, feat[:, :-1])
    loss = -twohot_log_prob(logits, config.critic.dist, returns)
    if config.critic.slow_target:
        with torch.no_grad():
            slow = twohot_mean(mlp_head(ac.slow_critic, feat[:, :-1]), config.critic.dist)
        loss = loss - twohot_log_prob(logits, config.critic.dist, slow)
    return (1 - is_last[:, :-1]) * loss


# ==================================================================================================
# Optimizers and the update
# ==================================================================================================


def clip_and_step(params, grads, lr, eps, clip, config, updates=0):
    """One optimizer step from fresh moments (Adam or LaProp, config.opt) of the parameters that have a gradient:
    the global norm clipped to `clip` (0: none), each tensor's gradient clipped to agc * max(1e-3, |param|)
    (config.agc, 0: none), the rate ramped over config.warmup updates. Changes the parameters in place; returns
    the clipped gradients and the norm before clipping."""
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for _, g in pairs)).float()
    clipped = []
    for p, g in pairs:
        if clip:
            g = g * torch.clamp(clip / (norm + 1e-6), max=1.0)
        if config.agc:
            upper = config.agc * torch.clamp(torch.linalg.vector_norm(p.detach()), min=1e-3)
            g = g / torch.clamp(torch.linalg.vector_norm(g) / upper, min=1.0)
        clipped.append(g)
    rate = lr * min(1.0, updates / config.warmup) if config.warmup else lr
    b1, b2, decay = 0.9, 0.999, config.weight_decay
    with torch.no_grad():
        for (p, _), g in zip(pairs, clipped):
            if config.opt == "adam":  # first step: m / (1 - b1) = g, v / (1 - b2) = g^2
                g = g + decay * p if decay else g
                m, v = (1 - b1) * g, (1 - b2) * g * g
                p.sub_(rate * (m / (1 - b1)) / (torch.sqrt(v / (1 - b2)) + eps))
            elif config.opt == "laprop":  # the normalised gradient is averaged, not the gradient
                nu = (1 - b2) * g * g
                mu = (1 - b1) * g / (torch.sqrt(nu / (1 - b2)) + eps)
                p.sub_(rate * (mu / (1 - b1) + decay * p))
            else:
                raise ValueError(f"the reference has no optimizer '{config.opt}'")
    return [g.detach() for g in clipped], norm


def update(agent, batch, norm_state=None):
    """One update of `agent` (a copy: its weights are changed in place) on a numpy batch (B, K + T, ...).

    Sequential (v1): the world model steps on its terms first; imagination starts from its posteriors with the
    stepped weights; the actor and the critic step on theirs. Joint (2024): every term at the starting weights,
    one step of one optimizer over the world model, actor and critic on their scaled sum. Then the slow critic's
    EMA. `norm_state`: (low, high) of the return normalisation before the update (the agent's buffers' values).
    Returns {name: value} losses and metrics as the product names them, the clipped gradients {parameter name:
    gradient} (prefixed wm., actor., critic.), the posterior (deter, stoch) and the new normaliser state."""
    config, wm, ac = agent.config, agent.wm, agent.task_behavior
    for module in (wm, ac.actor, ac.critic):  # every weight of the three learners learns, whatever its flag says
        module.requires_grad_(True)
    norm_state = (torch.zeros(()), torch.zeros(())) if norm_state is None else norm_state
    start, data = preprocess(batch, config.replay_context)
    terms, post, feat, metrics = world_model_loss(agent, data, start)
    scales = {"rew": config.reward_head.loss_scale, "con": config.cont_head.loss_scale, "dyn": config.dyn_scale,
              "rep": config.rep_scale}
    model_loss = sum(scales.get(k, 1.0) * v.mean() for k, v in terms.items())
    metrics.update({f"{k}_loss": scales.get(k, 1.0) * v.mean() for k, v in terms.items() if k not in ("dyn", "rep")})
    metrics["kl_loss"] = (scales["dyn"] * terms["dyn"] + scales["rep"] * terms["rep"]).mean()
    metrics["model_loss"] = model_loss
    groups = {"wm": dict(wm.named_parameters()), "actor": dict(ac.actor.named_parameters()),
              "critic": dict(ac.critic.named_parameters())}
    grads = {}
    if config.update == "sequential":
        names, params = zip(*groups["wm"].items())
        found = torch.autograd.grad(model_loss, params, allow_unused=True)
        clipped, metrics["model_grad_norm"] = clip_and_step(params, found, config.model_lr, config.opt_eps,
                                                            config.grad_clip, config)
        grads.update({f"wm.{n}": g for n, g in zip([n for n, g in zip(names, found) if g is not None], clipped)})
    behavior, returns, norm_state, behavior_metrics = behavior_loss(agent, post, data, norm_state)
    metrics.update(behavior_metrics)
    batch_size, length = data["is_first"].shape
    actor_loss, critic_loss = behavior["policy"].mean(), behavior["value"].mean()
    if config.critic.repval:
        boot = returns[0].detach().reshape(batch_size, length)
        repval = replay_value_loss(agent, feat if config.update == "joint" else feat.detach(), data, boot)
        metrics["critic_repval_loss"] = repval.mean()
        critic_loss = critic_loss + config.critic.repval * repval.mean()
    metrics.update(actor_loss=actor_loss, critic_loss=critic_loss)
    if config.update == "sequential":
        for group, loss, lr, eps, clip in (("actor", actor_loss, config.actor.lr, config.actor.eps,
                                            config.actor.grad_clip),
                                           ("critic", critic_loss, config.critic.lr, config.critic.eps,
                                            config.critic.grad_clip)):
            names, params = zip(*groups[group].items())
            found = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            clipped, metrics[f"{group}_grad_norm"] = clip_and_step(params, found, lr, eps, clip, config)
            grads.update({f"{group}.{n}": g for n, g in zip([n for n, g in zip(names, found) if g is not None],
                                                            clipped)})
    else:
        names = [f"{group}.{n}" for group, params in groups.items() for n in params]
        params = [p for params in groups.values() for p in params.values()]
        found = torch.autograd.grad(model_loss + actor_loss + critic_loss, params, allow_unused=True)
        clipped, metrics["update_grad_norm"] = clip_and_step(params, found, config.model_lr, config.opt_eps,
                                                             config.grad_clip, config)
        grads.update(zip([n for n, g in zip(names, found) if g is not None], clipped))
    with torch.no_grad():  # the slow critic's EMA every slow_target_update updates, counted from 0
        every = config.critic.slow_target_update
        mix = config.critic.slow_target_fraction if int(ac.updates) % every == 0 else 0.0
        for slow, fast in zip(ac.slow_critic.parameters(), ac.critic.parameters()):
            slow.copy_((1 - mix) * slow + mix * fast)
    metrics = {k: float(v.detach()) for k, v in metrics.items()}
    latents = {"deter": post["deter"].detach(), "stoch": post["stoch"].detach()}
    return metrics, grads, latents, norm_state
