"""Any registered Gymnasium environment: `gym_<EnvId>`, e.g. gym_CartPole-v1, gym_Pendulum-v1.

`gym_<module>:<EnvId>` first imports `module`, so an environment that module registers (with
`gymnasium.register`) becomes available, e.g. gym_my_package.envs:MyEnv-v0 or gym_ale_py:ALE/Pong-v5.

Observations become the keys the agent knows:
  - a uint8 Box of rank 3 (H, W, C) or rank 2 (H, W) is an image, resized to `size` with OpenCV's
    INTER_AREA and given a channel axis when it has none: key `image`;
  - any other Box, Discrete (one-hot), MultiBinary or MultiDiscrete is a flat float32 vector: key `vector`;
  - a Dict maps each of its entries the same way under the entry's own name; entries named log_*
    are recorded with the episodes but not shown to the agent, like the other suites' log keys.
Discrete and Box actions are supported. `action_repeat` repeats each action and sums rewards.
Gymnasium's `terminated` becomes is_terminal and `truncated` an episode end without it (is_last only),
so time limits registered with the environment stay truncations.
"""

import difflib
import importlib

import gymnasium
import numpy as np

from envs import wrappers

RESERVED = ("is_first", "is_last", "is_terminal", "reward", "action", "task")  # task: see parallel.Collector


def _resolve(name):
    """'CartPole-v1' or 'module:EnvId' -> the registered id, importing the module first if named."""
    module, _, env_id = name.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise wrappers.TaskError(f"Task 'gym_{name}' names module '{module}', which cannot be imported: "
                                     f"{e}") from None
    if env_id not in gymnasium.registry:
        close = difflib.get_close_matches(env_id, list(gymnasium.registry), n=3, cutoff=0.6)
        raise wrappers.TaskError(f"Unknown Gymnasium task 'gym_{name}': '{env_id}' is not registered; closest valid: "
                         + (", ".join(f"gym_{c}" for c in close) or "none close")
                         + ". Use gym_<module>:<EnvId> to import the module that registers it.")
    return env_id


def check(name):
    _resolve(name)


def _is_image(space):
    return isinstance(space, gymnasium.spaces.Box) and space.dtype == np.uint8 and len(space.shape) in (2, 3)


def _vector_size(space, key):
    if isinstance(space, gymnasium.spaces.Discrete):
        return int(space.n)
    if isinstance(space, (gymnasium.spaces.Box, gymnasium.spaces.MultiBinary, gymnasium.spaces.MultiDiscrete)):
        return int(np.prod(space.shape))
    raise wrappers.TaskError(f"Unsupported observation space for '{key}': {space}; supported: Box, Discrete, "
                     "MultiBinary, MultiDiscrete, or a Dict of those")


class Gym:
    """A Gymnasium environment with action repeat and observations as image / vector keys."""

    def __init__(self, name, repeat=1, size=(64, 64), seed=0):
        self.env = gymnasium.make(_resolve(name))
        self.repeat, self.size, self.seed = int(repeat), tuple(size), int(seed)
        space = self.env.observation_space
        entries = space.spaces.items() if isinstance(space, gymnasium.spaces.Dict) else [(None, space)]
        self.entries = []  # (key in the raw observation or None, our key, raw space)
        spaces = {}
        for source, raw in entries:
            key = source if source is not None else ("image" if _is_image(raw) else "vector")
            if key in RESERVED:
                raise wrappers.TaskError(f"Observation key '{key}' of gym_{name} clashes with a key the agent reserves")
            if _is_image(raw):
                channels = raw.shape[2] if len(raw.shape) == 3 else 1
                spaces[key] = gymnasium.spaces.Box(0, 255, self.size + (channels,), dtype=np.uint8)
            else:
                spaces[key] = gymnasium.spaces.Box(-np.inf, np.inf, (_vector_size(raw, key),), dtype=np.float32)
            self.entries.append((source, key, raw))
        self._obs_space = {**spaces, **wrappers.flag_spaces()}
        action = self.env.action_space
        if not isinstance(action, (gymnasium.spaces.Discrete, gymnasium.spaces.Box)):
            raise wrappers.TaskError(f"Unsupported action space of gym_{name}: {action}; supported: Discrete, Box")
        self.first_reset = True

    @property
    def obs_space(self):
        return self._obs_space

    @property
    def act_space(self):
        space = self.env.action_space
        if isinstance(space, gymnasium.spaces.Discrete):
            return gymnasium.spaces.Discrete(int(space.n))
        return gymnasium.spaces.Box(space.low.reshape(-1).astype(np.float32), space.high.reshape(-1).astype(np.float32),
                                    dtype=np.float32)

    def reset(self):
        # Seed once; later resets continue the environment's own random stream.
        seed, self.first_reset = (self.seed if self.first_reset else None), False
        obs, _ = self.env.reset(seed=seed)
        return self._obs(obs, is_first=True)

    def step(self, action):
        space = self.env.action_space
        if isinstance(space, gymnasium.spaces.Discrete):
            action = int(action) + int(space.start)
        else:
            action = np.asarray(action, space.dtype).reshape(space.shape)
        reward, terminated, truncated = 0.0, False, False
        for _ in range(self.repeat):
            obs, step_reward, terminated, truncated, _ = self.env.step(action)
            reward += float(step_reward)
            if terminated or truncated:
                break
        done = bool(terminated or truncated)
        return self._obs(obs, is_last=done, is_terminal=bool(terminated)), np.float32(reward), done, {}

    def _obs(self, raw, is_first=False, is_last=False, is_terminal=False):
        obs = {}
        for source, key, space in self.entries:
            value = raw if source is None else raw[source]
            obs[key] = self._image(value) if _is_image(space) else self._vector(value, space)
        return {**obs, "is_first": is_first, "is_last": is_last, "is_terminal": is_terminal}

    def _image(self, value):
        image = np.asarray(value, np.uint8)
        if image.shape[:2] != self.size:
            import cv2

            image = cv2.resize(image, self.size[::-1], interpolation=cv2.INTER_AREA)
        return image.reshape(self.size + (-1,))  # rank-2 images, and OpenCV's single-channel output

    @staticmethod
    def _vector(value, space):
        if isinstance(space, gymnasium.spaces.Discrete):
            vector = np.zeros(int(space.n), np.float32)
            vector[int(value) - int(space.start)] = 1.0
            return vector
        return np.asarray(value, np.float32).reshape(-1)

    def close(self):
        self.env.close()


def make(name, config, mode, seed):
    return wrappers.wrap(Gym(name, config.action_repeat, config.size, seed), config)
