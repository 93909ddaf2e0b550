"""Exploration behaviours: uniform random actions and Plan2Explore (Sekar et al., 2020).

A behaviour offers `actor(feat) -> distribution` for acting and `train_step(post, embed, data) ->
metrics` for learning, from the task update's posteriors (models.Update.train_step). The task
actor-critic (greedy) lives in models.py; it keeps learning the extrinsic reward whichever
behaviour collects the data, and it is the one that is evaluated.
"""

import torch
from torch import nn

import distributions
import launch
import models
import networks
import optim


class Random(nn.Module):
    """Uniform random actions over the action space (the box [-1, 1]^A or one of A one-hot
    actions); learns nothing."""

    def __init__(self, config, act_space):
        super().__init__()
        self.discrete = config.actor.dist == "onehot"
        self.size = act_space.shape[0]

    def actor(self, feat):  # (..., F) -> distribution over (..., A); only feat's shape is used
        shape = (*feat.shape[:-1], self.size)
        if self.discrete:
            return distributions.OneHot(torch.zeros(shape, device=feat.device))
        low = torch.full(shape, -1.0, device=feat.device)
        return distributions.Uniform(low, -low)

    def train_step(self, post, embed, data):
        return {}


class Ensemble(nn.Module):
    """`count` MLPs of `layers` hidden layers evaluated in one batched matmul per layer.

    The output layer is linear, so that the members can fit unbounded targets (deter, embed).
    There is no normalisation layer: members should differ only by their initialisation and
    stay free to extrapolate differently away from the training data, which is what makes their
    disagreement a measure of novelty.
    """

    def __init__(self, count, inp, out, layers, units, act):
        super().__init__()
        sizes = [inp] + [units] * layers + [out]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for i, o in zip(sizes[:-1], sizes[1:]):
            # Each member gets its own draw of the usual fan-average initialisation.
            weight = torch.stack([networks.init_(nn.Linear(i, o)).weight.detach().T for _ in range(count)])
            self.weights.append(nn.Parameter(weight))  # (count, i, o)
            self.biases.append(nn.Parameter(torch.zeros(count, 1, o)))
        self.act = networks.ACTIVATIONS[act]()

    def forward(self, x):  # (N, inp) -> (count, N, out)
        x = x.unsqueeze(0).expand(len(self.weights[0]), -1, -1)
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if i < len(self.weights) - 1:
                x = self.act(x)
        return x


class Plan2Explore(nn.Module):
    """Ensemble disagreement as intrinsic reward, optimised by its own actor-critic in imagination.

    Each ensemble member predicts `disag_target` of step t + `disag_offset` from the model feature
    of step t (and, with `disag_action_cond`, the action taken at step t). The intrinsic reward of
    a state is the variance of the members' predictions, averaged over target dimensions (Eq. 5 of
    the paper), or its log with `disag_log`. The exploration actor-critic maximises
    expl_intr_scale * intrinsic + expl_extr_scale * predicted extrinsic reward.
    """

    TARGETS = ("stoch", "deter", "embed", "feat")
    ranks = launch.SingleProcess()  # see Dreamer.distribute and ensemble_loss
    LOG_EPS = 1e-8  # floor inside log(variance): members that agree exactly give a finite reward

    def __init__(self, config, world_model, act_space):
        super().__init__()
        self.config = config
        self.wm = [world_model]  # a list keeps the world model out of this module's parameters
        rssm = world_model.rssm
        stoch = rssm.stoch * rssm.discrete if rssm.discrete else rssm.stoch
        sizes = {"stoch": stoch, "deter": rssm.deter, "embed": world_model.encoder.outdim, "feat": rssm.feat_size}
        self.target_size = sizes[config.disag_target]
        inp = rssm.feat_size + (act_space.shape[0] if config.disag_action_cond else 0)
        self.ensemble = Ensemble(config.disag_models, inp, self.target_size, config.disag_layers,
                                 config.disag_units, config.act)
        self.optimizer = optim.Optimizer("expl_ensemble", self.ensemble.parameters(), config.model_lr,
                                         config.opt_eps, config.grad_clip, opt=config.opt, agc=config.agc,
                                         warmup=config.warmup)
        self.behavior = models.ActorCritic(config, world_model, act_space, self.intrinsic_reward, prefix="expl_")
        self.optimizers = models.behavior_optimizers(config, self.behavior)  # {name: (Optimizer, terms)}

    def actor(self, feat):
        return self.behavior.actor(feat)

    def inputs(self, feat, action):
        return torch.cat([feat, action], -1) if self.config.disag_action_cond else feat

    def target(self, post, embed):  # -> (B, T, target_size)
        name = self.config.disag_target
        if name == "embed":
            return embed
        if name == "deter":
            return post["deter"]
        feat = self.wm[0].rssm.get_feat(post)
        if name == "feat":
            return feat
        return feat[..., :self.target_size]  # stoch: get_feat puts it first

    def disagreement(self, inputs):  # (..., inp) -> (...)
        """Variance across members (unbiased, 1/(K-1) as in the paper), averaged over dimensions.

        Computed in float32 outside autocast: the variance of nearly equal predictions is lost
        in 16-bit precision.
        """
        lead = inputs.shape[:-1]
        with torch.autocast(inputs.device.type, enabled=False):
            preds = self.ensemble(inputs.reshape(-1, inputs.shape[-1]).float())  # (K, N, D)
        return preds.var(0).mean(-1).reshape(lead)

    def intrinsic_reward(self, feat, action):  # (H, N, ...) -> (H, N), metrics
        """Reward of the exploration actor-critic for imagined states, and the intrinsic part's
        mean, std and max; action[t] is the action taken at feat[t], as in the ensemble's
        training pairs."""
        config = self.config
        disag = self.disagreement(self.inputs(feat, action))
        if config.disag_log:
            disag = torch.log(disag + self.LOG_EPS)
        intr = config.expl_intr_scale * disag
        stats = intr.detach()
        # Returned, not stored: the exploration actor-critic's loss runs this inside a compiled
        # region, whose outputs may live in memory that the next CUDA-graph replay overwrites.
        metrics = {"intr_reward_mean": stats.mean(), "intr_reward_std": stats.std(), "intr_reward_max": stats.max()}
        if not config.expl_extr_scale:
            return intr, metrics
        return intr + config.expl_extr_scale * self.wm[0].heads["reward"](feat).mean(), metrics

    def ensemble_loss(self, post, embed, action, is_first):
        """Mean squared error of every member on the pairs (input at t, target at t + offset).

        Replayed sequences (B, T) may cross episode boundaries; pairs that straddle one are not
        transitions of the environment and are left out. In the replay, action[t + 1] is the
        action taken after observing step t, so action conditioning needs step t + 1 too.
        """
        offset = self.config.disag_offset
        span = max(offset, 1) if self.config.disag_action_cond else offset
        length = post["deter"].shape[1] - span
        feat = self.wm[0].rssm.get_feat(post).detach()
        inputs = self.inputs(feat[:, :length], action[:, 1:1 + length])
        target = self.target(post, embed).detach()[:, offset:offset + length]
        resets = torch.cumsum(is_first, 1)
        valid = (resets[:, span:span + length] == resets[:, :length]).float()  # no reset in (t, t + span]
        preds = self.ensemble(inputs.reshape(-1, inputs.shape[-1]))  # (K, B * length, D)
        error = ((preds - target.reshape(1, -1, self.target_size)) ** 2).mean((0, 2))
        # Under torchrun the pairs are counted over all ranks (their mean count), so that the averaged
        # gradient is the whole batch's even when the ranks' batches hold different numbers of pairs.
        count = valid.sum()
        self.ranks.average_([count])
        return (error * valid.reshape(-1)).sum() / count.clamp(min=1)

    def regions(self):
        """What compile 'update' compiles whole (compilation.compile_update): the ensemble's loss and
        optimizer step, and the exploration actor-critic's (models.behavior_regions)."""
        return [(self, "ensemble_loss"), (self.optimizer.opt, "step"),
                *models.behavior_regions(self.behavior, self.optimizers)]

    def train_step(self, post, embed, data):
        """The ensemble's step on the posteriors post (B, T, ...) and embeddings, then its
        actor-critic's from the same states (models.loss's Imagination, as the task's, stepped as
        models.run_update steps it), its world model and ensemble frozen. Returns metrics."""
        loss = self.ensemble_loss(post, embed, data["action"], data["is_first"])
        metrics = self.optimizer(loss)
        behavior, scales = self.behavior, self.wm[0].scales
        # The actor's dynamics gradient flows through the world model and the ensemble; their
        # weights need none.
        with models.frozen(self.ensemble):
            losses, _, _, behavior_metrics = models.run_update(
                self.config, models.BEHAVIOR_PARTS,
                lambda part, _: models.loss(behavior, data, part=part, post=post, replay=False),
                lambda names, losses: {behavior.prefix + k: v for k, v in models.step(
                    {name: self.optimizers[name] for name in names}, losses, scales).items()})
        models.after_steps(behavior, losses, behavior_metrics)
        metrics.update(behavior_metrics)
        return metrics


# expl_behavior -> its behaviour, built from (config, world_model, act_space); greedy has none:
# the task actor-critic collects.
BEHAVIORS = {"greedy": lambda config, world_model, act_space: None,
             "random": lambda config, world_model, act_space: Random(config, act_space),
             "plan2explore": lambda config, world_model, act_space: Plan2Explore(config, world_model, act_space)}


def make_behavior(config, world_model, act_space):
    """The exploration behaviour `expl_behavior` names: None for greedy (the task actor-critic
    collects), else the Random or Plan2Explore module."""
    return BEHAVIORS[config.expl_behavior](config, world_model, act_space)


COMPILED = (Ensemble,)  # compiled like networks.COMPILED when compile is on
