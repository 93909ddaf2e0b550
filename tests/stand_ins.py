"""Stand-ins shared by several test files: an environment that counts its steps and a policy whose
latent is a function of what it saw, so that a test can tell which step each stored value belongs to."""

import gymnasium
import numpy as np
import torch


class CountingEnv:
    """Observation x = t; episodes of `length` steps after the first."""

    obs_space = {"x": gymnasium.spaces.Box(-np.inf, np.inf, (), np.float32)}
    act_space = gymnasium.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, length):
        self.length, self.t = length, 0

    def obs(self):
        return {"x": np.float32(self.t), "is_first": self.t == 0, "is_last": self.t == self.length,
                "is_terminal": False}

    def reset(self):
        self.t = 0
        obs = self.obs()
        return lambda: obs

    def step(self, action):
        self.t += 1
        obs = self.obs()
        return lambda: (obs, 1.0, self.t == self.length, {})


def latent_policy(obs, state):
    """A stand-in policy whose latent is a function of the step it saw: deter = x + 0.5 (never 0)."""
    x = torch.as_tensor(obs["x"])
    latent = {"deter": (x + 0.5)[:, None].repeat(1, 3), "stoch": (x + 0.25)[:, None, None].repeat(1, 2, 2)}
    return np.zeros((len(x), 1), np.float32), (latent, None)
