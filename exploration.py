"""Exploration behaviours: uniform random actions and Plan2Explore (Sekar et al., 2020).

A behaviour offers `actor(feat) -> distribution` for acting and `train_step(start, start_cont,
post, embed, data) -> metrics` for learning. The task actor-critic (greedy) lives in models.py.
"""

import torch
from torch import nn

import models
import networks
import tools


class Random(nn.Module):
    """Uniform random actions over the action space; learns nothing."""

    def __init__(self, config, act_space):
        super().__init__()
        self.discrete = config.actor.dist == "onehot"
        self.size = act_space.shape[0]

    def actor(self, feat):  # (..., F) -> distribution over (..., A)
        shape = (*feat.shape[:-1], self.size)
        if self.discrete:
            return tools.OneHot(torch.zeros(shape, device=feat.device))
        low, high = -torch.ones(shape, device=feat.device), torch.ones(shape, device=feat.device)
        return torch.distributions.Independent(torch.distributions.Uniform(low, high), 1)

    def train_step(self, start, start_cont, post, embed, data):
        return {}


class Ensemble(nn.Module):
    """`models` MLPs evaluated in one batched matmul per layer; linear outputs fit unbounded targets."""

    def __init__(self, models_, inp, out, layers, units, act):
        super().__init__()
        sizes = [inp] + [units] * layers + [out]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for i, o in zip(sizes[:-1], sizes[1:]):
            weight = torch.empty(models_, i, o)
            for m in range(models_):  # each member gets its own fan-average initialisation
                layer = networks.init_(nn.Linear(i, o))
                weight[m] = layer.weight.detach().T
            self.weights.append(nn.Parameter(weight))
            self.biases.append(nn.Parameter(torch.zeros(models_, 1, o)))
        self.act = networks.ACTIVATIONS[act]()

    def forward(self, x):  # (N, inp) -> (models, N, out)
        x = x.unsqueeze(0).expand(len(self.weights[0]), -1, -1)
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if i < len(self.weights) - 1:
                x = self.act(x)
        return x


class Plan2Explore(nn.Module):
    """Ensemble disagreement as intrinsic reward, optimised by its own actor-critic in imagination.

    Each member predicts `disag_target` (stoch, deter, embed or feat) `disag_offset` steps ahead from
    the model feature (and the action when `disag_action_cond`). The reward is the variance across
    members averaged over target dimensions (its log when `disag_log`), times `expl_intr_scale`,
    plus `expl_extr_scale` times the world model's reward prediction.
    """

    TARGETS = ("stoch", "deter", "embed", "feat")

    def __init__(self, config, world_model, act_space):
        super().__init__()
        self.config = config
        self.wm = [world_model]
        if config.disag_target not in self.TARGETS:
            raise ValueError(f"Unknown disag_target '{config.disag_target}'; valid: {', '.join(self.TARGETS)}")
        rssm = world_model.rssm
        stoch = rssm.stoch * rssm.discrete if rssm.discrete else rssm.stoch
        sizes = {"stoch": stoch, "deter": rssm.deter, "embed": world_model.encoder.outdim,
                 "feat": rssm.feat_size}
        self.target_size = sizes[config.disag_target]
        inp = rssm.feat_size + (act_space.shape[0] if config.disag_action_cond else 0)
        self.ensemble = Ensemble(config.disag_models, inp, self.target_size, config.disag_layers,
                                 config.disag_units, config.act)
        self.optimizer = models.Optimizer("expl_ensemble", self.ensemble.parameters(), config.model_lr,
                                          config.opt_eps, config.grad_clip, opt=config.opt)
        self.behavior = models.ActorCritic(config, world_model, act_space, self.intrinsic_reward, prefix="expl_")
        self.actor = self.behavior.actor

    def inputs(self, feat, action):
        return torch.cat([feat, action], -1) if self.config.disag_action_cond else feat

    def target(self, post, embed):
        feat = self.wm[0].rssm.get_feat(post)
        if self.config.disag_target == "embed":
            return embed
        if self.config.disag_target == "feat":
            return feat
        if self.config.disag_target == "deter":
            return post["deter"]
        return feat[..., :self.target_size]  # the stochastic part comes first in the feature

    def disagreement(self, inputs):  # (..., inp) -> (...)
        lead = inputs.shape[:-1]
        preds = self.ensemble(inputs.reshape(-1, inputs.shape[-1]))  # (M, N, D)
        return preds.var(0).mean(-1).reshape(lead)

    def intrinsic_reward(self, feat, state, action):  # (H+1, N, ...) -> (H+1, N)
        config = self.config
        disag = self.disagreement(self.inputs(feat, action))
        if config.disag_log:
            disag = torch.log(disag)
        reward = config.expl_intr_scale * disag
        if config.expl_extr_scale:
            reward = reward + config.expl_extr_scale * self.wm[0].heads["reward"](feat).mean()
        return reward

    def ensemble_loss(self, post, embed, action):
        """Every member regresses the target `disag_offset` steps ahead (B, T - offset, D)."""
        offset = self.config.disag_offset
        feat = self.wm[0].rssm.get_feat(post).detach()
        # The replayed action at t+1 is the one taken after observing step t.
        next_action = torch.cat([action[:, 1:], torch.zeros_like(action[:, :1])], 1)
        inputs = self.inputs(feat, next_action)[:, :-offset]
        target = self.target(post, embed).detach()[:, offset:]
        preds = self.ensemble(inputs.reshape(-1, inputs.shape[-1]))  # (M, N, D)
        return ((preds - target.reshape(1, -1, target.shape[-1])) ** 2).mean()

    def train_step(self, start, start_cont, post, embed, data):
        loss = self.ensemble_loss(post, embed, data["action"])
        metrics = self.optimizer(loss)
        metrics.update(self.behavior.train_step(start, start_cont))
        return metrics
