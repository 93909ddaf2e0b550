"""Steering: `steering_reach`, a tiny task on which learning shows within two minutes of one CPU thread
(benchmarks/learns.py, the `steering` preset).

A point on a line starts at 0 and must reach a target drawn per episode, on either side, that it
observes. Every step pays 1 - |position - target|: dense, so that a tiny world model learns the reward
within a few hundred updates, and a policy that steers there and stays scores close to the episode's
length. Random actions wander about the start and score far less; any constant action goes to one end
and scores less still, since half the targets lie on the other side.

Evaluation environments go through GOALS in turn instead of random targets, so that every evaluation of
len(GOALS) episodes scores the same targets and two agents' returns differ by their policies alone.
"""

import gymnasium
import numpy as np

from envs import wrappers

TASKS = ("reach",)
# Evaluation targets: both sides at five distances, each twice (20 episodes).
GOALS = tuple(side * distance for side in (-1, 1) for distance in (0.5, 0.625, 0.75, 0.875, 1.0)) * 2


def check(name):
    if name not in TASKS:
        raise wrappers.TaskError(f"Unknown Steering task 'steering_{name}'; valid: "
                                 + ", ".join(f"steering_{t}" for t in TASKS))


class Steering:
    """Position x in [-1, 1] starts at 0; the action a in [-1, 1] moves it by `speed * a`; the target g
    is uniform in 0.5 <= |g| <= 1, its side at random. Observation `state` = (x, g); reward
    1 - |x - g| after each step (summed over `repeat` steps per action); episodes of `length` steps end
    by truncation (never terminal). With `goals`, the targets are those, in turn, instead of random ones."""

    obs_space = {"state": gymnasium.spaces.Box(-1, 1, (2,), np.float32),
                 **{k: gymnasium.spaces.Box(0, 1, (), bool) for k in ("is_first", "is_last", "is_terminal")}}
    act_space = gymnasium.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, seed, length=20, speed=0.25, goals=None, repeat=1):
        self.rng = np.random.default_rng(seed)
        self.length, self.speed, self.repeat = length, speed, int(repeat)
        self.goals = list(goals) if goals is not None else None  # given: episode k's target is goals[k % len]
        self.episodes = 0
        self.t, self.x, self.goal = 0, 0.0, 0.0

    def obs(self):
        return {"state": np.array([self.x, self.goal], np.float32), "is_first": self.t == 0,
                "is_last": self.t == self.length, "is_terminal": False}

    def reset(self):
        self.t, self.x = 0, 0.0
        if self.goals is None:
            self.goal = float(self.rng.choice([-1.0, 1.0]) * self.rng.uniform(0.5, 1.0))
        else:
            self.goal = float(self.goals[self.episodes % len(self.goals)])
        self.episodes += 1
        return self.obs()

    def step(self, action):
        action = float(np.clip(np.asarray(action, np.float64).reshape(-1)[0], -1, 1))
        reward = 0.0
        for _ in range(self.repeat):
            self.t += 1
            self.x = float(np.clip(self.x + self.speed * action, -1, 1))
            reward += 1.0 - abs(self.x - self.goal)
            if self.t == self.length:
                break
        return self.obs(), reward, self.t == self.length, {}

    def close(self):
        pass


def make(name, config, mode, seed):
    check(name)
    return wrappers.wrap(Steering(seed, goals=GOALS if mode == "eval" else None, repeat=config.action_repeat), config)
