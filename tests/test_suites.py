"""The benchmark suites besides DMC: protocol details, contracts, errors, metrics, and a short debug
training run per suite that is installed here.

Atari, Crafter, Memory Maze and Gymnasium run for real. MineRL and DeepMind Lab cannot be installed
here, so their wrappers run against stand-ins that speak the same interface (FakeMineRL, FakeLab).
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

import envs
from envs import wrappers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def config(*presets, **flags):
    """The merged config dreamer.py would run with: presets in order, then --key value flags."""
    import config as cfg

    argv = ["--configs", *presets, "--logdir", "unused"]
    for key, value in flags.items():
        argv += [f"--{key}", ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return cfg.parse(argv)


def onehot(index, size):
    action = np.zeros(size, np.float32)
    action[index] = 1.0
    return action


def check_obs(env, obs):
    """Every key of the observation space is present, with the space's shape and dtype."""
    assert set(obs) == set(env.obs_space)
    for key, space in env.obs_space.items():
        value = np.asarray(obs[key])
        assert value.shape == space.shape, (key, value.shape, space.shape)
        assert value.dtype == space.dtype, (key, value.dtype, space.dtype)


def time_limit_of(env):
    while not isinstance(env, wrappers.TimeLimit):
        env = env.env
    return env.duration


# ==================================================================================================
# Atari (ale-py, real)
# ==================================================================================================


def test_atari_spaces_and_step_contract():
    from envs import atari

    env = atari.make("pong", config("atari100k"), "train", 0)
    assert env.obs_space["image"].shape == (64, 64, 3) and env.obs_space["image"].dtype == np.uint8
    assert env.act_space.discrete and env.act_space.shape == (6,)  # Pong's minimal action set
    assert time_limit_of(env) == 108000 // 4
    obs = env.reset()
    check_obs(env, obs)
    assert obs["is_first"] and not obs["is_last"] and not obs["is_terminal"]
    obs, reward, done, info = env.step(onehot(1, 6))
    check_obs(env, obs)
    assert not obs["is_first"] and isinstance(reward, np.float32) and done is False and info == {}
    full = atari.make("pong", config("atari100k", actions="all", grayscale=True), "train", 0)
    assert full.act_space.shape == (18,) and full.obs_space["image"].shape == (64, 64, 1)
    check_obs(full, full.reset())


def test_atari_noop_starts_within_range():
    from envs.atari import Atari

    env = Atari("pong", noops=30, sticky=False, seed=3)
    frames = []
    for _ in range(40):
        env.reset()
        frames.append(env.ale.getEpisodeFrameNumber())  # emulator frames played since reset_game
    assert min(frames) >= 0 and max(frames) <= 30 and len(set(frames)) > 10
    env = Atari("pong", noops=0, seed=3)
    env.reset()
    assert env.ale.getEpisodeFrameNumber() == 0


def test_atari_action_repeat_and_max_pooling_of_last_two_frames():
    import cv2

    from envs.atari import Atari

    env = Atari("pong", repeat=4, sticky=False, noops=0, actions="needed", seed=0)
    env.reset()
    rng = np.random.default_rng(0)
    pooling_mattered = False
    for _ in range(60):
        action = int(rng.integers(6))
        state, start = env.ale.cloneState(), env.ale.getEpisodeFrameNumber()
        screens = []
        for _ in range(4):  # replay the same step by hand and keep every frame
            env.ale.act(env.actions[action])
            screens.append(env.ale.getScreenRGB())
        env.ale.restoreState(state)
        obs, _, _, _ = env.step(action)
        assert env.ale.getEpisodeFrameNumber() - start == 4
        expected = cv2.resize(np.maximum(screens[2], screens[3]), (64, 64), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(obs["image"], expected)
        last_only = cv2.resize(screens[3], (64, 64), interpolation=cv2.INTER_AREA)
        pooling_mattered |= not np.array_equal(expected, last_only)
    assert pooling_mattered


def test_atari_sticky_actions_off_and_on():
    from envs.atari import Atari

    def trajectory(sticky, seed):
        env = Atari("pong", sticky=sticky, noops=0, actions="needed", seed=seed)
        assert env.ale.getFloat("repeat_action_probability") == (0.25 if sticky else 0.0)
        images = [env.reset()["image"]]
        rng = np.random.default_rng(0)  # the same actions for every run
        for _ in range(150):
            images.append(env.step(int(rng.integers(6)))[0]["image"])
        return np.stack(images)

    # Without sticky actions the game is deterministic given the actions, whatever the seed.
    np.testing.assert_array_equal(trajectory(False, 1), trajectory(False, 2))
    assert not np.array_equal(trajectory(True, 1), trajectory(True, 2))


@pytest.mark.parametrize("lives", ["unused", "discount", "reset"])
def test_atari_lives(lives):
    from envs.atari import Atari

    env = Atari("breakout", lives=lives, sticky=False, noops=0, actions="needed", seed=0)
    env.reset()
    start_lives = env.ale.lives()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        obs, _, done, _ = env.step(int(rng.integers(4)))
        if env.ale.lives() < start_lives:
            break
    assert env.ale.lives() == start_lives - 1
    if lives == "unused":
        assert not obs["is_terminal"] and not obs["is_last"] and not done
    elif lives == "discount":  # terminal for the value, but the episode and the game go on
        assert obs["is_terminal"] and not obs["is_last"] and not done
        assert not env.step(0)[0]["is_first"]
    else:  # the episode ends; the next one continues the same game
        assert obs["is_terminal"] and obs["is_last"] and done
        assert env.reset()["is_first"] and env.ale.lives() == start_lives - 1


def test_atari_game_over_is_terminal_and_time_limit_is_truncation():
    from envs import atari

    env = atari.make("pong", config("atari100k", time_limit=400), "train", 0)
    env.reset()
    steps = 0
    for _ in range(1000):
        obs, _, done, _ = env.step(onehot(0, 6))
        steps += 1
        if done:
            break
    assert steps == 400 // 4 and obs["is_last"] and not obs["is_terminal"]
    env = atari.make("pong", config("atari100k", time_limit=0), "train", 0)
    env.reset()
    for _ in range(25_000):  # a random player loses Pong 0:21 in a few thousand frames (4 per step)
        obs, reward, done, _ = env.step(env.act_space.sample())
        assert reward in (-1.0, 0.0, 1.0)  # unclipped, but Pong only scores single points
        if done:
            break
    assert done, "a random player's game of Pong did not end within 100K frames"
    assert obs["is_last"] and obs["is_terminal"]


def test_atari_resize_methods_and_task_names():
    from envs import atari

    images = {}
    for method in ("opencv", "pillow"):
        env = atari.Atari("pong", size=(64, 48), resize=method, seed=0)
        images[method] = env.reset()["image"]
        assert images[method].shape == (64, 48, 3)
    assert not np.array_equal(images["opencv"], images["pillow"])
    for game in atari.ATARI100K:  # every Atari 100k game has a ROM under its snake_case name
        atari.check(game)
    assert atari.rom_id("james_bond") == "jamesbond"
    with pytest.raises(ValueError, match="atari_pong"):
        envs.check_task("atari_pongg")
    with pytest.raises(ValueError, match="atari_ms_pacman"):
        envs.check_task("atari_mspacman")


# ==================================================================================================
# Crafter (real)
# ==================================================================================================


@pytest.mark.slow  # Crafter's world generation and rendering
def test_crafter_spaces_contract_and_achievements():
    from envs import crafter

    env = crafter.make("reward", config("crafter"), "train", 0)
    assert env.act_space.discrete and env.act_space.shape == (17,)
    assert time_limit_of(env) == 10000
    log_keys = [k for k in env.obs_space if k.startswith("log_achievement_")]
    assert len(log_keys) == 22 and "log_achievement_collect_wood" in log_keys
    obs = env.reset()
    check_obs(env, obs)
    assert obs["image"].shape == (64, 64, 3) and all(obs[k] == 0 for k in log_keys)
    rng = np.random.default_rng(0)
    unlocked, rewards = set(), []
    for _ in range(300):
        obs, reward, done, _ = env.step(onehot(rng.integers(17), 17))
        check_obs(env, obs)
        rewards.append(reward)
        unlocked |= {k for k in log_keys if obs[k] > 0}
        if done:
            break
    assert unlocked and any(rewards)
    small = crafter.make("noreward", config("crafter", size=[16, 16]), "train", 0)
    assert small.reset()["image"].shape == (16, 16, 3)
    rng = np.random.default_rng(0)
    for _ in range(300):  # the same actions as above, which earned rewards there
        _, reward, done, _ = small.step(onehot(rng.integers(17), 17))
        assert reward == 0.0
        if done:
            break


@pytest.mark.slow  # Crafter's world generation and rendering
def test_crafter_death_is_terminal_and_length_is_truncation():
    from envs.crafter import LENGTH, Crafter

    assert LENGTH == 10000
    env = Crafter("reward", seed=0)
    env.reset()
    env.env._length = 3  # Crafter's own episode length, shortened to reach it quickly
    results = [env.step(0) for _ in range(3)]
    assert [r[2] for r in results] == [False, False, True]
    assert results[-1][0]["is_last"] and not results[-1][0]["is_terminal"]
    env.reset()
    env.env._player.health = 0  # the player dies on the next step
    obs, _, done, _ = env.step(0)
    assert done and obs["is_last"] and obs["is_terminal"]


def test_crafter_episode_metrics_match_hand_computed_score():
    from envs import crafter

    names = ["collect_wood", "place_table"] + [f"other_{i}" for i in range(20)]  # 22 achievements

    def episode(unlocked_at):
        # Counts over 5 steps; an achievement unlocked at step t has count 1 from t on.
        return {f"log_achievement_{n}": np.array([int(unlocked_at.get(n, 99) <= t) for t in range(5)])
                for n in names} | {"reward": np.zeros(5, np.float32)}

    episodes = [episode({"collect_wood": 1, "place_table": 3}), episode({"collect_wood": 2}),
                episode({"collect_wood": 4})]
    metrics = crafter.episode_metrics(episodes)
    assert metrics["achievement_collect_wood"] == pytest.approx(100.0)
    assert metrics["achievement_place_table"] == pytest.approx(100.0 / 3)
    assert metrics["achievement_other_0"] == 0.0
    # exp(mean(log(1 + rate))) - 1 with rates 100, 33.33 and twenty zeros:
    # exp((ln 101 + ln 34.333) / 22) - 1 = 0.448474
    assert metrics["crafter_score"] == pytest.approx(0.448474, abs=1e-5)
    assert envs.episode_metrics("crafter_reward", episodes) == metrics
    with pytest.raises(ValueError, match="crafter_reward"):
        envs.check_task("crafter_rewards")


# ==================================================================================================
# Memory Maze (real; rendering through MuJoCo)
# ==================================================================================================


@pytest.fixture(scope="module")
def maze():
    os.environ.setdefault("MUJOCO_GL", "egl")
    from envs import memorymaze

    env = memorymaze.make("9x9", config("memorymaze"), "train", 0)
    yield env
    env.close()


def _inner_gym_env(env):
    """The suite's own environment under the shared wrappers."""
    while isinstance(env, wrappers.Wrapper):
        env = env.env
    return env


@pytest.mark.slow  # builds and renders Memory Maze
def test_memorymaze_spaces_contract_and_action_repeat(maze, monkeypatch):
    assert maze.act_space.discrete and maze.act_space.shape == (6,)
    assert maze.obs_space["image"].shape == (64, 64, 3)
    obs = maze.reset()
    check_obs(maze, obs)
    assert obs["is_first"]
    inner = _inner_gym_env(maze)
    assert inner.repeat == 2  # the memorymaze preset
    calls = []
    original = inner.env.step
    monkeypatch.setattr(inner.env, "step", lambda action: calls.append(action) or original(action))
    obs, reward, done, _ = maze.step(onehot(1, 6))
    check_obs(maze, obs)
    assert calls == [1, 1] and isinstance(reward, np.float32) and not done


@pytest.mark.slow  # builds and renders Memory Maze
def test_memorymaze_episode_end_is_truncation(maze):
    from dm_control import composer

    inner = _inner_gym_env(maze)
    dm_env = inner.env.unwrapped.env
    while not isinstance(dm_env, composer.Environment):
        dm_env = dm_env._env if hasattr(dm_env, "_env") else dm_env.env
    step_time = dm_env.control_timestep()
    # The package's standard length for 9x9: 250 s at 4 Hz.
    assert round(dm_env._time_limit / step_time) == 1000
    standard = dm_env._time_limit
    dm_env._time_limit = 5 * step_time - 1e-3  # shorten the package's timer to 5 environment steps
    try:
        maze.reset()
        results = [maze.step(onehot(1, 6)) for _ in range(3)]  # 2 + 2 + 1 environment steps
    finally:  # the module's environment, as the other tests see it
        dm_env._time_limit = standard
        maze.reset()
    assert [r[2] for r in results] == [False, False, True]
    assert results[-1][0]["is_last"] and not results[-1][0]["is_terminal"]


def test_memorymaze_standard_lengths_and_names(monkeypatch):
    os.environ.setdefault("MUJOCO_GL", "egl")
    from envs import memorymaze

    memorymaze._gym()
    from memory_maze import tasks

    limits = {}
    monkeypatch.setattr(tasks, "_memory_maze", lambda size, targets, limit, **kw: limits.setdefault(size, limit))
    for name in memorymaze.LENGTHS:
        getattr(tasks, f"memory_maze_{name}")()
    assert {f"{s}x{s}": limit * tasks.DEFAULT_CONTROL_FREQ for s, limit in limits.items()} == memorymaze.LENGTHS
    with pytest.raises(ValueError, match="memorymaze_9x9"):
        envs.check_task("memorymaze_10x10")


# ==================================================================================================
# Minecraft (wrapper against a MineRL stand-in)
# ==================================================================================================

MC_ITEMS = ["air", "dirt", "log", "log2", "planks", "stick", "crafting_table", "wooden_pickaxe", "cobblestone",
            "stone_pickaxe", "iron_ore", "furnace", "iron_ingot", "iron_pickaxe", "diamond"]
MC_EQUIP = ["air", "wooden_pickaxe", "stone_pickaxe", "other"]


class FakeMineRL:
    """Stand-in for a MineRL 0.4.4 environment: nested dict observations, dict actions, scripted
    inventory. `script[t]` updates the observation after the t-th step (1-based)."""

    def __init__(self, script=None, start=None, pov=(64, 64), die_after=None):
        self.script, self.start, self.pov, self.die_after = script or {}, start or {}, pov, die_after
        self.commands, self.seeded, self.closed = [], None, False

    def seed(self, seed):
        self.seeded = seed

    def reset(self):
        self.t = 0
        self.inventory = {item: 0 for item in MC_ITEMS} | self.start
        self.life, self.equipped = 20.0, "air"
        return self._obs()

    def step(self, command):
        self.t += 1
        self.commands.append(command)
        for key, value in self.script.get(self.t, {}).items():
            if key == "life":
                self.life = value
            elif key == "equip":
                self.equipped = value
            else:
                self.inventory[key] = value
        return self._obs(), 0.0, self.die_after is not None and self.t >= self.die_after, {}

    def _obs(self):
        return {"pov": np.full(self.pov + (3,), self.t, np.uint8),
                "inventory": {k: np.array(v) for k, v in self.inventory.items()},
                "equipped_items": {"mainhand": {"type": self.equipped, "damage": 0, "maxDamage": 0}},
                "life_stats": {"life": np.array(self.life), "food": np.array(10.0), "air": np.array(300.0)}}

    def close(self):
        self.closed = True


def minecraft(task="diamond", break_speed=100.0, repeat=1, **fake):
    from envs.minecraft import Minecraft

    fake_env = FakeMineRL(**fake)
    return Minecraft(task, fake_env, MC_ITEMS, MC_EQUIP, (64, 64), repeat, break_speed), fake_env


def test_minecraft_make_spaces_and_contract(monkeypatch):
    from envs import minecraft as suite

    fake_env = FakeMineRL(pov=(32, 48))
    made = []
    monkeypatch.setattr(suite, "_minerl_env", lambda size, speed: made.append((size, speed)) or (
        fake_env, MC_ITEMS, MC_EQUIP))
    env = suite.make("diamond", config("minecraft", break_speed=50), "train", 7)
    assert made == [([64, 64], 50.0)] and fake_env.seeded == 7
    assert time_limit_of(env) == 36000
    assert env.act_space.discrete and env.act_space.shape == (25,)
    pattern = config("minecraft").encoder.mlp_keys
    assert {k for k in env.obs_space if k not in ("image", "is_first", "is_last", "is_terminal")
            and not k.startswith("log_")} == set(pattern.split("|"))
    assert env.obs_space["inventory"].shape == (len(MC_ITEMS) - 1,)  # log2 is counted as log
    assert env.obs_space["equipped"].shape == (len(MC_EQUIP),)
    obs = env.reset()
    check_obs(env, obs)
    assert obs["image"].shape == (64, 64, 3)  # the stand-in renders 32x48; resized
    assert obs["health"][0] == 1.0 and obs["hunger"][0] == 0.5 and obs["breath"][0] == 1.0
    names = suite.Minecraft("diamond", fake_env, MC_ITEMS, MC_EQUIP).action_names
    index = names.index("craft_wooden_pickaxe")
    obs, reward, done, _ = env.step(onehot(index, 25))
    check_obs(env, obs)
    assert fake_env.commands[-1]["nearbyCraft"] == "wooden_pickaxe" and fake_env.commands[-1]["craft"] == "none"
    assert suite.make("wood", config("minecraft"), "train", 0).act_space.shape == (12,)
    env.close()
    assert fake_env.closed


def test_minecraft_diamond_rewards_once_per_milestone():
    env, _ = minecraft("diamond", start={"dirt": 5}, script={
        1: {"log": 1}, 2: {"log": 3}, 3: {"log2": 1, "planks": 4}, 4: {"log": 0, "planks": 0},
        5: {"log": 1, "stick": 2, "dirt": 9}, 6: {"life": 10.0}, 7: {"diamond": 1, "equip": "wooden_pickaxe"}})
    obs = env.reset()
    rewards, observations = [], []
    for _ in range(7):
        obs, reward, _, _ = env.step(0)
        rewards.append(reward)
        observations.append(obs)
    # log, (more log: nothing), planks, (lost: nothing), stick (log again: nothing), health -0.5, diamond
    np.testing.assert_allclose(rewards, [1, 0, 1, 0, 1, 0.01 * -0.5, 1], atol=1e-6)
    items = [item for item in MC_ITEMS if item != "log2"]
    inventory = observations[2]["inventory"]
    assert inventory[items.index("log")] == 4  # log + log2
    assert observations[3]["inventory"][items.index("planks")] == 0
    assert observations[3]["inventory_max"][items.index("planks")] == 4
    assert observations[3]["inventory_max"][items.index("log")] == 4
    assert observations[-1]["equipped"].tolist() == [0, 1, 0, 0]
    assert observations[-1]["log_inventory_diamond"] == 1
    env.reset()  # a new episode earns its milestones again
    assert env.step(0)[1] == 1


def test_minecraft_wood_rewards_every_log():
    env, _ = minecraft("wood", script={1: {"log": 2}, 2: {"log": 2, "log2": 1}, 3: {"log": 0}})
    env.reset()
    assert [env.step(0)[1] for _ in range(3)] == [2, 1, 0]


def test_minecraft_sticky_attack_jump_and_pitch_limit():
    from envs.minecraft import Minecraft

    names = list(Minecraft("diamond", FakeMineRL(), MC_ITEMS, MC_EQUIP).action_names)
    env, fake = minecraft("diamond", break_speed=1.0)
    env.reset()
    env.step(names.index("attack"))
    for _ in range(35):
        env.step(names.index("noop"))
    attacks = [c["attack"] for c in fake.commands]
    assert attacks == [1] * 30 + [0] * 6  # sticky for 30 steps at normal breaking speed
    env, fake = minecraft("diamond", break_speed=100.0)
    env.reset()
    env.step(names.index("attack"))
    env.step(names.index("jump"))
    for _ in range(10):
        env.step(names.index("noop"))
    assert [c["attack"] for c in fake.commands][:2] == [1, 0]  # no sticky attack with fast breaking
    assert [c["jump"] for c in fake.commands] == [0] + [1] * 10 + [0]
    assert all(c["forward"] for c in fake.commands[1:11])
    for _ in range(6):
        env.step(names.index("turn_up"))
    pitches = [float(c["camera"][0]) for c in fake.commands[-6:]]
    assert pitches == [-15.0] * 4 + [0.0, 0.0]  # stops at -60 degrees
    env.step(names.index("turn_down"))
    assert float(fake.commands[-1]["camera"][0]) == 15.0


def test_minecraft_action_repeat_death_and_truncation():
    env, fake = minecraft("diamond", repeat=3, die_after=4)
    names = list(env.action_names)
    env.reset()
    env.step(names.index("craft_planks"))
    assert [c["craft"] for c in fake.commands] == ["planks", "none", "none"]  # crafted once per step
    env.step(names.index("forward"))
    assert [c["forward"] for c in fake.commands[3:]] == [1]  # the stand-in died on its 4th step
    assert fake.t == 4
    fake.die_after = 2
    env.reset()
    obs, _, done, _ = env.step(0)
    assert done and obs["is_last"] and obs["is_terminal"]
    limited = wrappers.wrap(minecraft("diamond")[0], config("minecraft", time_limit=2))
    limited.reset()
    obs, _, done, _ = limited.step(onehot(0, 25))
    assert not done
    obs, _, done, _ = limited.step(onehot(0, 25))
    assert done and obs["is_last"] and not obs["is_terminal"]


def test_minecraft_missing_package_and_names(monkeypatch):
    from envs import minecraft as suite

    monkeypatch.setitem(sys.modules, "minerl", None)  # import minerl now raises ImportError
    with pytest.raises(ImportError, match="pip install .*minerl"):
        suite.make("diamond", config("minecraft"), "train", 0)
    with pytest.raises(ValueError, match="minecraft_diamond"):
        envs.check_task("minecraft_diamonds")
    episodes = [{"log_inventory_log": np.array([0, 1]), "log_inventory_diamond": np.array([0, 0])},
                {"log_inventory_log": np.array([0, 0]), "log_inventory_diamond": np.array([0, 0])}]
    metrics = suite.episode_metrics(episodes)
    assert metrics == {"collect_log": 50.0, "collect_diamond": 0.0}


# ==================================================================================================
# DeepMind Lab (wrapper against a deepmind_lab stand-in)
# ==================================================================================================


class FakeLab:
    """Stand-in for deepmind_lab.Lab: counts frames, ends the episode after `length` frames."""

    instances = []
    length = 10

    def __init__(self, level, observations, config=None, renderer="software"):
        self.level, self.observation_names, self.config = level, observations, config
        self.calls, self.frame, self.running = [], 0, False
        FakeLab.instances.append(self)

    def reset(self, seed=None):
        self.calls.append(("reset", seed))
        self.frame, self.running = 0, True

    def step(self, action, num_steps=1):
        assert self.running and action.dtype == np.intc and action.shape == (7,)
        self.calls.append(("step", tuple(action), num_steps))
        self.frame += num_steps
        self.running = self.frame < self.length
        return float(num_steps)

    def is_running(self):
        return self.running

    def observations(self):
        assert self.running, "DeepMind Lab has no observations after the episode ended"
        height, width = int(self.config["height"]), int(self.config["width"])
        return {"RGB_INTERLEAVED": np.full((height, width, 3), self.frame, np.uint8)}

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def fake_lab(monkeypatch):
    FakeLab.instances = []
    monkeypatch.setitem(sys.modules, "deepmind_lab", types.SimpleNamespace(Lab=FakeLab))
    return FakeLab


def test_dmlab_make_spaces_actions_and_truncation(fake_lab):
    from envs import dmlab

    env = dmlab.make("explore_goal_locations_small", config("debug", action_repeat=4, time_limit=0, size=[64, 48]),
                     "train", 0)
    lab = fake_lab.instances[-1]
    assert lab.level == "contributed/dmlab30/explore_goal_locations_small"
    assert lab.observation_names == ["RGB_INTERLEAVED"]
    assert lab.config["width"] == "48" and lab.config["height"] == "64" and "mixerSeed" not in lab.config
    assert env.act_space.discrete and env.act_space.shape == (9,)
    obs = env.reset()
    check_obs(env, obs)
    assert obs["image"].shape == (64, 48, 3) and obs["is_first"]
    obs, reward, done, _ = env.step(onehot(6, 9))
    assert lab.calls[-1] == ("step", (-20, 0, 0, 1, 0, 0, 0), 4)  # look left + forward, held 4 frames
    assert reward == 4.0 and not done
    check_obs(env, obs)
    obs, _, done, _ = env.step(onehot(8, 9))
    assert lab.calls[-1] == ("step", (0, 0, 0, 0, 1, 0, 0), 4)
    obs, _, done, _ = env.step(onehot(0, 9))  # frame 12 >= 10: the level's timer ran out
    assert done and obs["is_last"] and not obs["is_terminal"]
    assert obs["image"][0, 0, 0] == 8  # the last frame DeepMind Lab rendered
    env.close()
    assert lab.calls[-1] == ("close",)


def test_dmlab_eval_uses_held_out_levels_and_grayscale(fake_lab):
    from envs import dmlab

    cfg = config("debug", action_repeat=4, grayscale=True, size=[32, 32])
    env = dmlab.make("rooms_collect_good_objects_train", cfg, "eval", 0)
    lab = fake_lab.instances[-1]
    assert lab.level.endswith("rooms_collect_good_objects_test")
    assert lab.config["allowHoldOutLevels"] == "true" and lab.config["mixerSeed"] == str(0x600D5EED)
    assert env.reset()["image"].shape == (32, 32, 1)
    dmlab.make("rooms_collect_good_objects_test", cfg, "train", 0)
    assert fake_lab.instances[-1].level.endswith("rooms_collect_good_objects_train")
    seeds = [call[1] for call in lab.calls if call[0] == "reset"]
    env.reset()
    assert len(seeds) == 1 and [c[1] for c in lab.calls if c[0] == "reset"][1] != seeds[0]


def test_dmlab_preset_is_v1s_setting_and_trains_on_the_stand_in(fake_lab, tmp_path, capsys, monkeypatch):
    """`--configs dmlab`: v1's xlarge model, 8 environments, train ratio 64, action repeat 4, images
    only; the actor follows the discrete actions by itself (onehot + REINFORCE). A short run of the
    preset (with the debug sizes on top) trains on the deepmind_lab stand-in."""
    import dreamer

    preset = config("dmlab", task="dmlab_rooms_watermaze")
    assert (preset.envs, preset.train_ratio, preset.action_repeat, preset.time_limit) == (8, 64, 4, 0)
    assert (preset.dyn_deter, preset.dyn_hidden, preset.units, preset.encoder.cnn_depth) == (4096, 1024, 1024, 96)
    assert preset.actor.layers == preset.critic.layers == preset.reward_head.layers == preset.cont_head.layers == 5
    assert (preset.encoder.cnn_keys, preset.encoder.mlp_keys) == ("image", "$^") == (
        preset.decoder.cnn_keys, preset.decoder.mlp_keys)
    assert preset.actor.dist == "auto" and preset.imag_gradient == "auto"
    monkeypatch.setattr(fake_lab, "length", 40)
    logdir = tmp_path / "dmlab"
    dreamer.main(["--configs", "dmlab", "debug", "--task", "dmlab_explore_goal_locations_small", "--steps", "160",
                  "--eval_episode_num", "0", "--logdir", str(logdir)])
    summary = capsys.readouterr().out
    assert "Actor: onehot distribution, reinforce gradient (actor.dist and imag_gradient auto" in summary
    assert fake_lab.instances[0].calls[1][2] == 4  # the preset's action repeat, held by DeepMind Lab
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 160 and rows[-1]["perf/updates"] > 0
    with np.load(sorted((logdir / "train_eps").glob("*.npz"))[0]) as episode:
        assert episode["image"].shape[1:] == (16, 16, 3) and len(episode["reward"]) == 11  # 40 frames / 4 + 1


def test_dmlab_missing_package_and_names(monkeypatch):
    from envs import dmlab

    monkeypatch.setitem(sys.modules, "deepmind_lab", None)
    with pytest.raises(ImportError, match="DeepMind Lab.*bazel"):
        dmlab.make("explore_goal_locations_small", config("debug"), "train", 0)
    assert len(dmlab.LEVELS) == 30
    with pytest.raises(ValueError, match="dmlab_explore_goal_locations_small"):
        envs.check_task("dmlab_explore_goal_location_small")


# ==================================================================================================
# Gymnasium (real)
# ==================================================================================================

CUSTOM_ENV = '''
import gymnasium
import numpy as np
from gymnasium import spaces


class Custom(gymnasium.Env):
    """Dict observations of every supported kind; action 2 terminates; start=1 action indices."""

    observation_space = spaces.Dict({
        "camera": spaces.Box(0, 255, (24, 32, 3), np.uint8),
        "depth": spaces.Box(0, 255, (24, 32), np.uint8),
        "position": spaces.Box(-1.0, 1.0, (2, 2), np.float64),
        "room": spaces.Discrete(3),
        "log_secret": spaces.Box(0, 9, (), np.int64),
    })
    action_space = spaces.Discrete(3, start=1)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        assert action in (1, 2, 3)
        self.t += 1
        return self._obs(), float(action), action == 2, False, {}

    def _obs(self):
        return {"camera": np.full((24, 32, 3), self.t, np.uint8), "depth": np.full((24, 32), 7, np.uint8),
                "position": np.full((2, 2), 0.5), "room": self.t % 3, "log_secret": np.array(self.t)}


gymnasium.register("CustomSuiteTest-v0", entry_point=Custom, max_episode_steps=4)
'''


def test_gym_vector_discrete_task_terminates():
    from envs import gym as suite

    env = suite.make("CartPole-v1", config("debug", action_repeat=1, time_limit=0), "train", 0)
    assert set(env.obs_space) == {"vector", "is_first", "is_last", "is_terminal"}
    assert env.obs_space["vector"].shape == (4,) and env.act_space.discrete and env.act_space.shape == (2,)
    obs = env.reset()
    check_obs(env, obs)
    for _ in range(100):  # always pushing left makes the pole fall within a few dozen steps
        obs, reward, done, _ = env.step(onehot(0, 2))
        check_obs(env, obs)
        if done:
            break
    assert done and obs["is_terminal"] and obs["is_last"]


def test_gym_continuous_task_truncation_and_action_repeat():
    from envs import gym as suite

    env = suite.make("Pendulum-v1", config("debug", action_repeat=2, time_limit=0), "train", 0)
    assert env.act_space.shape == (1,) and not getattr(env.act_space, "discrete", False)
    assert env.act_space.low[0] == -1.0 and env.act_space.high[0] == 1.0  # normalised from [-2, 2]
    env.reset()
    steps = 0
    for _ in range(1000):
        obs, reward, done, _ = env.step(np.array([1.0], np.float32))
        steps += 1
        if done:
            break
    assert steps == 100  # Pendulum-v1 is registered with 200 steps; 2 per policy step
    assert obs["is_last"] and not obs["is_terminal"]  # a registered time limit is a truncation


def test_gym_user_registered_dict_env(tmp_path, monkeypatch):
    (tmp_path / "custom_suite_env.py").write_text(CUSTOM_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    from envs import gym as suite

    envs.check_task("gym_custom_suite_env:CustomSuiteTest-v0")
    env = suite.make("custom_suite_env:CustomSuiteTest-v0", config("debug", action_repeat=1, time_limit=0),
                     "train", 0)
    spaces = env.obs_space
    assert spaces["camera"].shape == (16, 16, 3) and spaces["depth"].shape == (16, 16, 1)
    assert spaces["position"].shape == (4,) and spaces["room"].shape == (3,)
    assert spaces["log_secret"].shape == (1,)
    assert env.act_space.shape == (3,)
    obs = env.reset()
    check_obs(env, obs)
    obs, reward, done, _ = env.step(onehot(0, 3))  # index 0 is the environment's action 1
    check_obs(env, obs)
    assert reward == 1.0 and not done
    assert obs["camera"][0, 0, 0] == 1 and obs["depth"][0, 0, 0] == 7 and obs["room"].tolist() == [0, 1, 0]
    obs, reward, done, _ = env.step(onehot(1, 3))
    assert reward == 2.0 and done and obs["is_terminal"]
    env.reset()
    for _ in range(4):
        obs, _, done, _ = env.step(onehot(2, 3))
    assert done and obs["is_last"] and not obs["is_terminal"]  # max_episode_steps=4: truncated


def test_gym_errors():
    with pytest.raises(ValueError, match="gym_CartPole-v1"):
        envs.check_task("gym_CartPol-v1")
    with pytest.raises(ValueError, match="no_such_module"):
        envs.check_task("gym_no_such_module:Thing-v0")
    from envs import gym as suite

    with pytest.raises(ValueError, match="Unsupported action space"):
        _multidiscrete_action_env(suite)


def _multidiscrete_action_env(suite):
    import gymnasium

    class MultiAction(gymnasium.Env):
        observation_space = gymnasium.spaces.Box(-1, 1, (2,))
        action_space = gymnasium.spaces.MultiDiscrete([2, 3])

    gymnasium.register("MultiActionSuiteTest-v0", entry_point=MultiAction)
    try:
        return suite.Gym("MultiActionSuiteTest-v0")
    finally:
        gymnasium.registry.pop("MultiActionSuiteTest-v0")


# ==================================================================================================
# Debug training runs through dreamer.py
# ==================================================================================================

RUNS = {
    "atari": ["--configs", "atari100k", "debug", "--task", "atari_pong", "--time_limit", "200", "--steps", "200",
              "--eval_episode_num", "0"],
    "crafter": ["--configs", "crafter", "debug", "--task", "crafter_reward", "--time_limit", "50", "--steps", "100",
                "--eval_every", "100"],
    "memorymaze": ["--configs", "memorymaze", "debug", "--task", "memorymaze_9x9", "--time_limit", "60", "--steps",
                   "60", "--eval_episode_num", "0"],
    # Discrete actions, no actor flags: onehot + REINFORCE by themselves (debug narrows the keys to images).
    "gym_discrete": ["--configs", "debug", "--task", "gym_CartPole-v1", "--steps", "100", "--eval_episode_num", "1",
                     "--eval_every", "100", "--encoder.mlp_keys", ".*", "--decoder.mlp_keys", ".*"],
    "gym": ["--configs", "debug", "--task", "gym_Pendulum-v1", "--action_repeat", "2", "--time_limit", "100",
            "--steps", "100", "--eval_episode_num", "0", "--encoder.mlp_keys", "vector", "--decoder.mlp_keys",
            "vector", "--encoder.cnn_keys", "$^", "--decoder.cnn_keys", "$^"],
}


@pytest.fixture(scope="module", autouse=True)
def training_runs(request, tmp_path_factory):
    """Start the selected debug runs when this module starts, so that they run while the tests above
    do (much of their time goes to imports and set-up), and let each run's test wait for it."""
    selected = [name for name in RUNS if any(item.nodeid.endswith(f"test_debug_training_run[{name}]")
                                             for item in request.session.items)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("MUJOCO_GL", "egl")
    runs = {}
    for name in selected:
        logdir = tmp_path_factory.mktemp(f"run_{name}")
        log = open(logdir / "output.txt", "w")  # noqa: SIM115 - closed after the run, below
        process = subprocess.Popen([sys.executable, "dreamer.py", *RUNS[name], "--logdir", str(logdir)], cwd=ROOT,
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
        runs[name] = (process, logdir, log)
    yield runs
    for process, _, log in runs.values():
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()


@pytest.mark.parametrize("name", list(RUNS))
def test_debug_training_run(training_runs, name):
    process, logdir, _ = training_runs[name]
    code = process.wait(timeout=400)
    output = (logdir / "output.txt").read_text()
    assert code == 0, output[-3000:]
    lines = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert lines and all("step" in line for line in lines)
    assert lines[-1]["perf/updates"] > 0 and any(math.isfinite(line.get("world_model/model_loss", math.nan))
                                                 for line in lines), output[-3000:]  # it trained
    episodes = sorted((logdir / "train_eps").glob("*.npz"))
    assert episodes, output[-3000:]
    with np.load(episodes[0]) as episode:
        assert episode["is_first"][0] and episode["is_last"][-1]
    if name == "gym_discrete":
        assert "Actor: onehot distribution, reinforce gradient (actor.dist and imag_gradient auto" in output
        assert any(key.startswith("actor/") for key in set().union(*lines))
    if name == "crafter":  # the suite's metrics reach the log, for training and evaluation
        keys = set().union(*lines)
        assert {"train/crafter_score", "eval/crafter_score", "train/achievement_collect_wood"} <= keys
        assert math.isfinite(next(line["eval/crafter_score"] for line in lines if "eval/crafter_score" in line))
