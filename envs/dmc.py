"""DeepMind Control Suite: `dmc_<domain>_<task>`, e.g. dmc_walker_walk, dmc_ball_in_cup_catch."""

import difflib
import re

import gymnasium
import numpy as np

from envs import wrappers

# Domains whose default camera does not follow the agent.
CAMERAS = {"quadruped": 2}


def _suite():
    wrappers.headless_rendering()  # before MuJoCo is imported; a value the user set wins
    from dm_control import suite

    return suite


def _split(name):
    """'ball_in_cup_catch' -> ('ball_in_cup', 'catch') using the suite's own task list."""
    for domain, task in _suite().ALL_TASKS:
        if f"{domain}_{task}" == name:
            return domain, task
    valid = [f"dmc_{d}_{t}" for d, t in _suite().ALL_TASKS]
    close = difflib.get_close_matches(f"dmc_{name}", valid, n=3)
    raise wrappers.TaskError(f"Unknown DMC task 'dmc_{name}'; closest valid: "
                             f"{', '.join(close) or ', '.join(valid[:5])}")


def check(name):
    _split(name)


class DeepMindControl:
    """One dm_control task with action repeat; renders a 64x64 `image` only when asked to."""

    def __init__(self, name, action_repeat=1, size=(64, 64), camera=None, seed=0, image=True):
        domain, task = _split(name)
        self.env = _suite().load(domain, task, task_kwargs={"random": seed})
        self.action_repeat, self.size, self.image = action_repeat, tuple(size), image
        self.camera = CAMERAS.get(domain, 0) if camera is None else camera
        if image:
            # Cheaper rendering (smaller shadow map, no multisampling): same picture at 64x64.
            quality = self.env.physics.model.vis.quality
            quality.shadowsize, quality.offsamples = 512, 0

    @property
    def obs_space(self):
        spaces = {}
        for key, spec in self.env.observation_spec().items():
            size = int(np.prod(spec.shape)) if spec.shape else 1
            spaces[key] = gymnasium.spaces.Box(-np.inf, np.inf, (size,), dtype=np.float32)
        if self.image:
            spaces["image"] = gymnasium.spaces.Box(0, 255, self.size + (3,), dtype=np.uint8)
        return {**spaces, **wrappers.flag_spaces()}

    @property
    def act_space(self):
        spec = self.env.action_spec()
        return gymnasium.spaces.Box(spec.minimum.astype(np.float32), spec.maximum.astype(np.float32),
                                    dtype=np.float32)

    def _obs(self, time_step, is_first):
        obs = {k: np.asarray(v, np.float32).reshape(-1) for k, v in time_step.observation.items()}
        if self.image:
            obs["image"] = self.env.physics.render(*self.size, camera_id=self.camera)
        obs["is_first"] = is_first
        obs["is_last"] = time_step.last()
        obs["is_terminal"] = time_step.last() and time_step.discount == 0
        return obs

    def reset(self):
        return self._obs(self.env.reset(), True)

    def step(self, action):
        reward = 0.0
        for _ in range(self.action_repeat):
            time_step = self.env.step(action)
            reward += time_step.reward or 0.0
            if time_step.last():
                break
        obs = self._obs(time_step, False)
        return obs, np.float32(reward), bool(time_step.last()), {}

    def close(self):
        self.env.close()
        # Free the rendering context now, on this thread: MuJoCo's EGL context stays bound to the
        # thread that last rendered, and freeing it at exit from another one fails (EGL_BAD_ACCESS).
        self.env.physics.free()


def make(name, config, mode, seed):
    # Proprio runs never render, except to film the policy for --eval_only.
    wants_image = bool(re.match(config.encoder.cnn_keys, "image")) or (mode == "eval" and config.eval_only)
    env = DeepMindControl(name, config.action_repeat, config.size, seed=seed, image=wants_image)
    return wrappers.wrap(env, config)
