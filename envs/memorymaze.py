"""Memory Maze: `memorymaze_9x9`, `memorymaze_11x11`, `memorymaze_13x13`, `memorymaze_15x15`.

The package's standard tasks (`MemoryMaze-<size>-v0`): 64x64 first-person images with the target
colour drawn as a border, 6 discrete actions, control at 4 Hz, and episodes of 1000, 2000, 3000 and
4000 environment steps by size. Those episodes end on the package's timer only, so every episode end
is a truncation; nothing in a maze ever terminates. `action_repeat` repeats each action for that
many environment steps, and the episode cap in the config (`time_limit`, in environment steps) comes
on top of the package's own; set it to 0 to keep the standard lengths for the larger mazes.

Rendering goes through MuJoCo; MUJOCO_GL defaults to egl (headless) unless the user set it.
"""


import gymnasium
import numpy as np

from envs import wrappers

# Maze size -> the package's episode length in environment steps (its time limit x 4 Hz control).
NOOP_ACTION = 0  # Memory Maze's 'noop': padded actions of a run of several tasks map to it
LENGTHS = {"9x9": 1000, "11x11": 2000, "13x13": 3000, "15x15": 4000}


def _gym():
    wrappers.headless_rendering()  # before MuJoCo is imported; a value the user set wins
    # memory_maze registers its MemoryMaze-* environments with gym on import.
    gym, _ = wrappers.import_quietly(["gym", "memory_maze"], "Memory Maze tasks need memory-maze and gym: "
                                     "pip install memory-maze==1.0.3 gym==0.26.2 (or pip install -r requirements.txt)")
    return gym


def check(name):
    if name not in LENGTHS:
        raise wrappers.TaskError(f"Unknown Memory Maze task 'memorymaze_{name}'; valid: "
                         + ", ".join(f"memorymaze_{size}" for size in LENGTHS))


class MemoryMaze:
    """One maze with action repeat; images resized to `size` when that is not the native 64x64."""

    def __init__(self, name, repeat=1, size=(64, 64), seed=0):
        check(name)
        gym = _gym()
        # The passive environment checker of gym 0.26 uses np.bool8, which numpy 2 removed.
        self.env = gym.make(f"MemoryMaze-{name}-v0", disable_env_checker=True, seed=int(seed))
        self.repeat, self.size = int(repeat), tuple(size)

    @property
    def obs_space(self):
        return {"image": gymnasium.spaces.Box(0, 255, self.size + (3,), dtype=np.uint8), **wrappers.flag_spaces()}

    @property
    def act_space(self):
        return gymnasium.spaces.Discrete(int(self.env.action_space.n))

    def reset(self):
        return self._obs(self.env.reset(), is_first=True)

    def step(self, action):
        reward = 0.0
        for _ in range(self.repeat):
            image, step_reward, done, info = self.env.step(int(action))
            reward += step_reward
            if done:
                break
        # The package marks the end of its timer as a truncation (the gym 0.21 convention).
        terminal = done and not info.get("TimeLimit.truncated", False)
        return self._obs(image, is_last=done, is_terminal=terminal), np.float32(reward), bool(done), {}

    def _obs(self, image, is_first=False, is_last=False, is_terminal=False):
        if image.shape[:2] != self.size:
            import cv2

            image = cv2.resize(image, self.size[::-1], interpolation=cv2.INTER_AREA)
        return {"image": image, "is_first": is_first, "is_last": bool(is_last), "is_terminal": bool(is_terminal)}

    def close(self):
        self.env.close()


def make(name, config, mode, seed):
    return wrappers.wrap(MemoryMaze(name, config.action_repeat, config.size, seed), config)
