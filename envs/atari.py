"""Atari 2600 games through the Arcade Learning Environment: `atari_<game>`, e.g. atari_pong.

Task names are snake_case ALE ROM ids (atari_ms_pacman, atari_private_eye, atari_up_n_down), plus
aliases where the usual name differs from the ROM id (atari_james_bond -> jamesbond).

The frame protocol is implemented here on top of `ale_py.ALEInterface` rather than inherited from a
gymnasium wrapper stack, so every detail is visible in one place (the `atari100k` preset sets it):
  - every policy step repeats its action for `action_repeat` emulator frames, sums the (unclipped)
    rewards and returns the pixel-wise maximum of the last two frames, which removes the flicker of
    sprites that are drawn only every other frame;
  - reset() starts a new game and then plays between 0 and `noops` (inclusive) no-op frames, drawn
    uniformly, so that deterministic games do not always start from the same state;
  - sticky actions (the emulator repeats the previous action with probability 0.25 on every frame)
    are on when `sticky` is True and off otherwise;
  - `actions`: 'needed' uses the game's minimal action set, 'all' the 18 legal actions;
  - `lives`: 'unused' ignores lives. 'discount' marks a step that loses a life as terminal
    (is_terminal, so the world model learns that the value stops there) while the episode and the
    game go on (not is_last), as DreamerV3 does. 'reset' ends the episode when a life is lost (is_last
    and is_terminal); the next reset() then continues the same game from where it was, as in the
    common EpisodicLife practice, and only starts a new game once the game is over;
  - images are resized to `size` with OpenCV's INTER_AREA ('opencv') or Pillow's bilinear filter
    ('pillow'), RGB or, with `grayscale`, the emulator's luminance as a single channel (H, W, 1);
  - the episode cap is `time_limit` frames (108000, i.e. 30 minutes, for Atari 100k), applied by the
    shared TimeLimit wrapper as a truncation.
"""

import difflib

import gymnasium
import numpy as np

from envs import wrappers

# The 26 games of the Atari 100k benchmark, by task name.
ATARI100K = (
    "alien", "amidar", "assault", "asterix", "bank_heist", "battle_zone", "boxing", "breakout",
    "chopper_command", "crazy_climber", "demon_attack", "freeway", "frostbite", "gopher", "hero",
    "james_bond", "kangaroo", "krull", "kung_fu_master", "ms_pacman", "pong", "private_eye", "qbert",
    "road_runner", "seaquest", "up_n_down",
)

# Task names whose ALE ROM id is spelled differently; every ROM id is a valid task name as well.
# ALE's NOOP is index 0 of the legal and of every minimal action set: padded actions of a run of
# several tasks map to it (envs.common_spaces).
NOOP_ACTION = 0
ALIASES = {"james_bond": "jamesbond", "montezumas_revenge": "montezuma_revenge"}


def _ale_py():
    try:
        import ale_py
    except ImportError as e:
        raise ImportError("Atari tasks need the Arcade Learning Environment, which ships the ROMs: "
                          "pip install ale-py==0.12.1 (or pip install -r requirements.txt)") from e
    return ale_py


def _rom_ids():
    return list(_ale_py().roms.get_all_rom_ids())


def rom_id(name):
    """Task name (after 'atari_') -> ALE ROM id; raises TaskError naming close valid tasks."""
    rom = ALIASES.get(name, name)
    roms = _rom_ids()
    if rom in roms:
        return rom
    valid = sorted(set(roms) | set(ALIASES))
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    hint = ", ".join(f"atari_{c}" for c in close) if close else "the Atari 100k games: " + ", ".join(
        f"atari_{g}" for g in ATARI100K)
    raise wrappers.TaskError(f"Unknown Atari task 'atari_{name}'; closest valid: {hint}")


def check(name):
    rom_id(name)


class Atari:
    """One ALE game with action repeat, max-pooling, no-op starts and lives handling (see module doc)."""

    def __init__(self, name, repeat=4, size=(64, 64), grayscale=False, noops=0, lives="unused", sticky=True,
                 actions="all", resize="opencv", seed=0):
        if lives not in ("unused", "discount", "reset"):
            raise wrappers.TaskError(f"Invalid lives '{lives}'; valid: unused, discount, reset")
        if actions not in ("all", "needed"):
            raise wrappers.TaskError(f"Invalid actions '{actions}'; valid: all, needed")
        if resize not in ("opencv", "pillow"):
            raise wrappers.TaskError(f"Invalid resize '{resize}'; valid: opencv, pillow")
        ale_py = _ale_py()
        self.repeat, self.size, self.grayscale = int(repeat), tuple(size), grayscale
        self.noops, self.lives, self.resize = int(noops), lives, resize
        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no ROM banner per environment
        self.ale = ale_py.ALEInterface()
        # The ALE seeds its own generator (used by sticky actions) from an int32.
        self.ale.setInt("random_seed", int(seed) % (2**31))
        self.ale.setFloat("repeat_action_probability", 0.25 if sticky else 0.0)
        self.ale.setInt("frame_skip", 1)  # frame skipping happens in step(), with max-pooling
        self.ale.loadROM(ale_py.roms.get_rom_path(rom_id(name)))
        self.actions = self.ale.getMinimalActionSet() if actions == "needed" else self.ale.getLegalActionSet()
        self.noop = ale_py.Action.NOOP
        self.rng = np.random.default_rng(seed)
        self.game_running = False  # whether reset() may continue the current game (lives='reset')
        self.lives_left = 0

    @property
    def obs_space(self):
        return wrappers.image_obs_space(self.size, self.grayscale)

    @property
    def act_space(self):
        return gymnasium.spaces.Discrete(len(self.actions))

    def reset(self):
        if not (self.lives == "reset" and self.game_running):
            self.ale.reset_game()
            for _ in range(self.rng.integers(0, self.noops + 1)):
                self.ale.act(self.noop)
                if self.ale.game_over():
                    self.ale.reset_game()
        self.game_running = True
        self.lives_left = self.ale.lives()
        return self._obs([self._screen()], is_first=True)

    def step(self, action):
        action = self.actions[int(action)]
        reward, screens, over, lost_life = 0.0, [], False, False
        for frame in range(self.repeat):
            reward += self.ale.act(action)
            over = self.ale.game_over()
            lives = self.ale.lives()
            lost_life = self.lives != "unused" and lives < self.lives_left
            self.lives_left = lives
            # Only the last two frames of the repeat are pooled, so only they are read out; an
            # episode or life that ends early keeps the frames it has.
            if frame >= self.repeat - 2 or over or lost_life:
                screens.append(self._screen())
            if over or lost_life:
                break
        is_last = over or (lost_life and self.lives == "reset")
        if over:
            self.game_running = False
        obs = self._obs(screens[-2:], is_last=is_last, is_terminal=over or lost_life)
        return obs, np.float32(reward), is_last, {}

    def _screen(self):
        return self.ale.getScreenGrayscale() if self.grayscale else self.ale.getScreenRGB()

    def _obs(self, screens, is_first=False, is_last=False, is_terminal=False):
        image = np.maximum.reduce(screens) if len(screens) > 1 else screens[0]
        return {"image": self._resize(image), "is_first": is_first, "is_last": is_last, "is_terminal": is_terminal}

    def _resize(self, image):
        height, width = self.size
        if self.resize == "opencv":
            import cv2

            image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
        else:
            from PIL import Image

            image = np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR))
        return image.reshape(self.size + (-1,))  # grayscale screens and resizes drop the channel axis

    def close(self):
        self.ale = None


def make(name, config, mode, seed):
    env = Atari(name, config.action_repeat, config.size, config.grayscale, config.noops, config.lives,
                config.sticky, config.actions, config.resize, seed)
    return wrappers.wrap(env, config)
