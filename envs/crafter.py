"""Crafter: `crafter_reward` (the benchmark's reward) and `crafter_noreward` (reward always 0).

Episodes are Crafter's full length of 10000 steps unless the player dies first; dying is a
termination, reaching the length a truncation. Each achievement's unlock count in the current episode
is an observation key `log_achievement_<name>`: recorded with the episodes, never seen by the agent.
`episode_metrics` turns them into per-achievement success rates and the Crafter score.
"""

import gymnasium
import numpy as np

from envs import wrappers

NOOP_ACTION = 0  # Crafter's 'noop': padded actions of a run of several tasks map to it
TASKS = ("reward", "noreward")
LENGTH = 10000  # Crafter's standard episode length, in steps


def _crafter():
    return wrappers.import_quietly(["crafter"], "Crafter tasks need the crafter package: pip install crafter==1.8.3 "
                                   "(or pip install -r requirements.txt)")[0]


def check(name):
    if name not in TASKS:
        raise wrappers.TaskError(f"Unknown Crafter task 'crafter_{name}'; valid: "
                                 + ", ".join(f"crafter_{t}" for t in TASKS))


class Crafter:
    """One Crafter world, rendered at Crafter's native 64x64 and resized to `size` if that differs
    (Crafter cannot draw its item bar at much smaller sizes)."""

    def __init__(self, task, size=(64, 64), repeat=1, seed=0):
        check(task)
        crafter = _crafter()
        self.env = crafter.Env(area=(64, 64), view=(9, 9), size=(64, 64), reward=task == "reward", length=LENGTH,
                               seed=seed)
        self.achievements = tuple(crafter.constants.achievements)
        self.size, self.repeat = tuple(size), int(repeat)

    @property
    def obs_space(self):
        spaces = {"image": gymnasium.spaces.Box(0, 255, self.size + (3,), dtype=np.uint8)}
        for name in self.achievements:
            spaces[f"log_achievement_{name}"] = gymnasium.spaces.Box(0, 2**31 - 1, (), dtype=np.int32)
        return {**spaces, **wrappers.flag_spaces()}

    @property
    def act_space(self):
        return gymnasium.spaces.Discrete(self.env.action_space.n)

    def reset(self):
        image = self.env.reset()
        return self._obs(image, dict.fromkeys(self.achievements, 0), is_first=True)

    def step(self, action):
        reward = 0.0
        for _ in range(self.repeat):
            image, step_reward, done, info = self.env.step(int(action))
            reward += step_reward
            if done:
                break
        # Crafter reports death as discount 0; an episode that ends alive has reached its length.
        dead = info["discount"] == 0
        obs = self._obs(image, info["achievements"], is_last=done, is_terminal=done and dead)
        return obs, np.float32(reward), bool(done), {}

    def _obs(self, image, achievements, is_first=False, is_last=False, is_terminal=False):
        if image.shape[:2] != self.size:
            import cv2

            image = cv2.resize(image, self.size[::-1], interpolation=cv2.INTER_AREA)
        obs = {"image": image, "is_first": is_first, "is_last": bool(is_last), "is_terminal": bool(is_terminal)}
        for name in self.achievements:
            obs[f"log_achievement_{name}"] = np.int32(achievements[name])
        return obs

    def close(self):
        pass


def episode_metrics(episodes):
    """Success rate (percent of the given episodes that unlocked it at least once) of every achievement,
    and the Crafter score: the geometric mean of the success rates, offset by one so that achievements
    nobody unlocked count (Hafner 2021, "Benchmarking the Spectrum of Agent Capabilities")."""
    names = sorted({key[len("log_achievement_"):] for episode in episodes for key in episode
                    if key.startswith("log_achievement_")})
    if not names:
        return {}
    rates = {}
    for name in names:
        unlocked = [np.max(episode[f"log_achievement_{name}"]) > 0 for episode in episodes]
        rates[name] = 100.0 * float(np.mean(unlocked))
    score = float(np.exp(np.mean(np.log(1.0 + np.array(list(rates.values()))))) - 1.0)
    return {"crafter_score": score, **{f"achievement_{name}": rate for name, rate in rates.items()}}


def make(name, config, mode, seed):
    return wrappers.wrap(Crafter(name, config.size, config.action_repeat, seed), config)
