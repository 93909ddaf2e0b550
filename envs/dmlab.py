"""DeepMind Lab: the DMLab-30 levels as `dmlab_<level>`, e.g. dmlab_explore_goal_locations_small.

DeepMind Lab is not in requirements.txt: it is built from source with Bazel; see INSTALL below.

  - actions: the 9 discrete actions of IMPALA (move, strafe, look left/right by 20, look and move,
    fire), each held for `action_repeat` frames by DeepMind Lab itself (num_steps), rewards summed;
  - observations: `image`, the RGB frame at `size`, single-channel with `grayscale`;
  - every DMLab-30 level ends on its own timer and the agent never sees the clock, so the end of an
    episode is a truncation (is_last, not is_terminal); `time_limit` can cap episodes further;
  - evaluation environments use the held-out test variant of the two levels that have one
    (rooms_*_train -> rooms_*_test) and the benchmark's evaluation mixer seed, as in DMLab-30;
    training environments always use the training variant.
Language levels run without their instruction text (the INSTR observation is not requested).
"""

import difflib

import gymnasium
import numpy as np

from envs import wrappers

INSTALL = ("DMLab tasks need DeepMind Lab, which requirements.txt does not install: build its Python "
           "package from source (https://github.com/google-deepmind/lab, docs/users/build.md): "
           "bazel build -c opt --python_version=PY3 //python/pip_package:build_pip_package, then "
           "./bazel-bin/python/pip_package/build_pip_package /tmp/dmlab_pkg and "
           "pip install /tmp/dmlab_pkg/deepmind_lab-*.whl")

LEVELS = (
    "rooms_collect_good_objects_train", "rooms_exploit_deferred_effects_train", "rooms_select_nonmatching_object",
    "rooms_watermaze", "rooms_keys_doors_puzzle", "language_select_described_object",
    "language_select_located_object", "language_execute_random_task", "language_answer_quantitative_question",
    "lasertag_one_opponent_small", "lasertag_three_opponents_small", "lasertag_one_opponent_large",
    "lasertag_three_opponents_large", "natlab_fixed_large_map", "natlab_varying_map_regrowth",
    "natlab_varying_map_randomized", "skymaze_irreversible_path_hard", "skymaze_irreversible_path_varied",
    "psychlab_arbitrary_visuomotor_mapping", "psychlab_continuous_recognition", "psychlab_sequential_comparison",
    "psychlab_visual_search", "explore_object_locations_small", "explore_object_locations_large",
    "explore_obstructed_goals_small", "explore_obstructed_goals_large", "explore_goal_locations_small",
    "explore_goal_locations_large", "explore_object_rewards_few", "explore_object_rewards_many",
)
# The held-out variants that evaluation uses; also valid task names of their own.
TEST_LEVELS = {"rooms_collect_good_objects_train": "rooms_collect_good_objects_test",
               "rooms_exploit_deferred_effects_train": "rooms_exploit_deferred_effects_test"}
EVAL_MIXER_SEED = 0x600D5EED  # the DMLab-30 evaluation seed

# IMPALA's action set; DeepMind Lab actions are 7 integers: look left/right (pixels per frame), look
# up/down, strafe left/right, move back/forward, fire, jump, crouch.
ACTIONS = (
    (0, 0, 0, 1, 0, 0, 0),  # forward
    (0, 0, 0, -1, 0, 0, 0),  # backward
    (0, 0, -1, 0, 0, 0, 0),  # strafe left
    (0, 0, 1, 0, 0, 0, 0),  # strafe right
    (-20, 0, 0, 0, 0, 0, 0),  # look left
    (20, 0, 0, 0, 0, 0, 0),  # look right
    (-20, 0, 0, 1, 0, 0, 0),  # look left and forward
    (20, 0, 0, 1, 0, 0, 0),  # look right and forward
    (0, 0, 0, 0, 1, 0, 0),  # fire
)


def check(name):
    valid = LEVELS + tuple(TEST_LEVELS.values())
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
        raise wrappers.TaskError(f"Unknown DMLab task 'dmlab_{name}'; closest valid: "
                         + ", ".join(f"dmlab_{c}" for c in (close or valid[:5])))


def _deepmind_lab():
    try:
        import deepmind_lab
    except ImportError as e:
        raise ImportError(INSTALL) from e
    return deepmind_lab


class DMLab:
    """One DMLab-30 level with IMPALA's discrete actions (see module doc)."""

    def __init__(self, level, mode="train", repeat=4, size=(64, 64), grayscale=False, seed=0):
        check(level)
        deepmind_lab = _deepmind_lab()
        train_level = {test: train for train, test in TEST_LEVELS.items()}.get(level, level)
        config = {"width": size[1], "height": size[0], "logLevel": "WARN"}
        if mode == "eval":
            level = TEST_LEVELS.get(train_level, train_level)
            config.update(allowHoldOutLevels="true", mixerSeed=EVAL_MIXER_SEED)
        else:
            level = train_level
        self.level = level
        # DeepMind Lab wants every setting as a string.
        self.lab = deepmind_lab.Lab(f"contributed/dmlab30/{level}", ["RGB_INTERLEAVED"],
                                    config={k: str(v) for k, v in config.items()})
        self.repeat, self.size, self.grayscale = int(repeat), tuple(size), grayscale
        self.rng = np.random.default_rng(seed)
        self.image = None

    @property
    def obs_space(self):
        return wrappers.image_obs_space(self.size, self.grayscale)

    @property
    def act_space(self):
        return gymnasium.spaces.Discrete(len(ACTIONS))

    def reset(self):
        self.lab.reset(seed=int(self.rng.integers(0, 2**31 - 1)))
        return self._obs(is_first=True)

    def step(self, action):
        reward = self.lab.step(np.array(ACTIONS[int(action)], np.intc), num_steps=self.repeat)
        done = not self.lab.is_running()
        return self._obs(is_last=done), np.float32(reward), done, {}

    def _obs(self, is_first=False, is_last=False):
        # A finished episode has no observations left; the last frame stands in for the final one.
        if self.lab.is_running():
            image = np.asarray(self.lab.observations()["RGB_INTERLEAVED"], np.uint8)
            if self.grayscale:
                import cv2

                image = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)[..., None]
            self.image = image
        return {"image": self.image, "is_first": is_first, "is_last": is_last, "is_terminal": False}

    def close(self):
        self.lab.close()


def make(name, config, mode, seed):
    env = DMLab(name, mode, config.action_repeat, config.size, config.grayscale, seed)
    return wrappers.wrap(env, config)
