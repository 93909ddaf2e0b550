"""Minecraft through MineRL: `minecraft_diamond` (DreamerV3's Obtain Diamond task) and `minecraft_wood`.

MineRL is not in requirements.txt: it needs Java 8 and an old MineRL release; see INSTALL below.

The environment is a MineRL 0.4.4 survival world built from MineRL's own handlers (see `_minerl_env`):
a first-person image, the full inventory, the equipped item and life stats as observations, keyboard,
camera and crafting commands as actions, and a block-breaking speed multiplier (`break_speed`).
On top of it this wrapper provides, as DreamerV3 does:
  - a discrete action set: movement, camera turns of 15 degrees, attack, jump, placing dirt, and for
    the diamond task every crafting, placing, equipping and smelting step on the way to a diamond;
  - observations `image`, `inventory` (counts), `inventory_max` (the most of each item held so far
    this episode), `equipped` (one-hot), `health`, `hunger` and `breath` (in [0, 1]), plus
    `log_inventory_<item>` for the milestone items, for `episode_metrics`;
  - rewards: diamond gives +1 the first time in an episode each milestone item (log, planks, stick,
    crafting table, wooden pickaxe, cobblestone, stone pickaxe, iron ore, furnace, iron ingot, iron
    pickaxe, diamond) enters the inventory; wood gives +1 per log collected; both add 0.01 times the
    change of normalised health, so that losing health costs a little;
  - sticky jump (a jump lasts 10 steps) and, at normal breaking speed only, sticky attack (30 steps),
    because single-step jumps and attacks achieve nothing in Minecraft; the camera pitch stays within
    +-60 degrees so the agent cannot get stuck looking at the sky or its feet.
An episode that MineRL ends means the player died: a termination. The episode cap is `time_limit`.
"""

import gymnasium
import numpy as np

from envs import wrappers

INSTALL = ("Minecraft tasks need MineRL 0.4.4 with Java 8, which requirements.txt does not install: "
           "apt-get install openjdk-8-jdk, then pip install "
           "https://github.com/danijar/minerl/releases/download/v0.4.4-patched/"
           "minerl_mirror-0.4.4-cp311-cp311-linux_x86_64.whl (MineRL 0.4.4 patched for Python 3.11)")

# Items of the diamond tech tree, in the order they are usually obtained.
MILESTONES = ("log", "planks", "stick", "crafting_table", "wooden_pickaxe", "cobblestone", "stone_pickaxe",
              "iron_ore", "furnace", "iron_ingot", "iron_pickaxe", "diamond")

# Every MineRL command with its do-nothing value; each discrete action overrides some of them.
NOOP = {"camera": (0.0, 0.0), "forward": 0, "back": 0, "left": 0, "right": 0, "jump": 0, "sneak": 0,
        "attack": 0, "craft": "none", "nearbyCraft": "none", "nearbySmelt": "none", "place": "none",
        "equip": "none"}

NOOP_ACTION = 0  # 'noop', the first of BASIC_ACTIONS: padded actions of a run of several tasks map to it
BASIC_ACTIONS = {
    "noop": {},
    "attack": {"attack": 1},
    "turn_up": {"camera": (-15.0, 0.0)},
    "turn_down": {"camera": (15.0, 0.0)},
    "turn_left": {"camera": (0.0, -15.0)},
    "turn_right": {"camera": (0.0, 15.0)},
    "forward": {"forward": 1},
    "back": {"back": 1},
    "left": {"left": 1},
    "right": {"right": 1},
    "jump": {"jump": 1, "forward": 1},
    "place_dirt": {"place": "dirt"},
}

CRAFT_ACTIONS = {
    "craft_planks": {"craft": "planks"},
    "craft_stick": {"craft": "stick"},
    "craft_crafting_table": {"craft": "crafting_table"},
    "place_crafting_table": {"place": "crafting_table"},
    "craft_wooden_pickaxe": {"nearbyCraft": "wooden_pickaxe"},
    "craft_stone_pickaxe": {"nearbyCraft": "stone_pickaxe"},
    "craft_iron_pickaxe": {"nearbyCraft": "iron_pickaxe"},
    "equip_stone_pickaxe": {"equip": "stone_pickaxe"},
    "equip_wooden_pickaxe": {"equip": "wooden_pickaxe"},
    "equip_iron_pickaxe": {"equip": "iron_pickaxe"},
    "craft_furnace": {"nearbyCraft": "furnace"},
    "place_furnace": {"place": "furnace"},
    "smelt_iron_ingot": {"nearbySmelt": "iron_ingot"},
}

TASKS = {"diamond": {**BASIC_ACTIONS, **CRAFT_ACTIONS}, "wood": BASIC_ACTIONS}

# Commands that keep going during action repeat; crafting, placing and turning happen once per step.
HELD = ("forward", "back", "left", "right", "attack")


def check(name):
    if name not in TASKS:
        raise wrappers.TaskError(f"Unknown Minecraft task 'minecraft_{name}'; valid: "
                         + ", ".join(f"minecraft_{t}" for t in TASKS))


class Minecraft:
    """Discrete actions, flat observations and task rewards around a MineRL-style gym environment.

    `env` follows MineRL 0.4.4: reset() -> obs, step(dict of commands) -> (obs, reward, done, info),
    with obs {'pov', 'inventory': {item: count}, 'equipped_items': {'mainhand': {'type'}},
    'life_stats': {'life', 'food', 'air'}}. `items` are the inventory items, `equip_items` the values
    of the equipped item type. `make` builds the real one; tests pass a stand-in.
    """

    def __init__(self, task, env, items, equip_items, size=(64, 64), repeat=1, break_speed=100.0,
                 sticky_attack=30, sticky_jump=10, pitch_limit=(-60.0, 60.0)):
        check(task)
        self.task, self.env, self.size, self.repeat = task, env, tuple(size), int(repeat)
        # Minecraft 1.11 keeps acacia and dark oak as a second log type; both count as log.
        self.items = [item for item in items if item != "log2"]
        self.equip_items = list(equip_items)
        self.logged = [item for item in MILESTONES if item in self.items]
        self.action_names = list(TASKS[task])
        self.actions = [{**NOOP, **TASKS[task][name]} for name in self.action_names]
        # With faster block breaking one attack step breaks a block, so sticky attack would only waste steps.
        self.sticky_attack = sticky_attack if break_speed == 1 else 0
        self.sticky_jump, self.pitch_limit = sticky_jump, pitch_limit
        self._reset_state()

    def _reset_state(self):
        self.attack_left = self.jump_left = 0
        self.pitch = 0.0
        self.inventory_max = None
        self.seen, self.last_counts, self.last_health = set(), {}, 0.0  # for the rewards

    @property
    def obs_space(self):
        box = gymnasium.spaces.Box
        scalar = box(0.0, 1.0, (1,), dtype=np.float32)
        spaces = {
            "image": box(0, 255, self.size + (3,), dtype=np.uint8),
            "inventory": box(0.0, np.inf, (len(self.items),), dtype=np.float32),
            "inventory_max": box(0.0, np.inf, (len(self.items),), dtype=np.float32),
            "equipped": box(0.0, 1.0, (len(self.equip_items),), dtype=np.float32),
            "health": scalar, "hunger": scalar, "breath": scalar,
        }
        for item in self.logged:
            spaces[f"log_inventory_{item}"] = box(0, 2**31 - 1, (), dtype=np.int32)
        return {**spaces, **wrappers.flag_spaces()}

    @property
    def act_space(self):
        return gymnasium.spaces.Discrete(len(self.actions))

    def reset(self):
        self._reset_state()
        raw = self.env.reset()
        counts = self._counts(raw)
        # Items held from the start of the episode never earn their milestone.
        self.seen = {item for item in MILESTONES if counts.get(item, 0) > 0}
        self.last_counts, self.last_health = counts, self._health(raw)
        return self._obs(raw, counts, is_first=True)

    def step(self, action):
        command = self._sticky(dict(self.actions[int(action)]))
        held = {**NOOP, **{key: command[key] for key in HELD}}
        for repeat in range(self.repeat):
            raw, _, done, _ = self.env.step(command if repeat == 0 else held)
            if done:
                break
        counts = self._counts(raw)
        reward = self._reward(counts, self._health(raw))
        return self._obs(raw, counts, is_last=done, is_terminal=done), np.float32(reward), bool(done), {}

    def _sticky(self, command):
        """Sticky attack and jump, and the pitch limit, applied to one step's commands."""
        if self.sticky_attack:
            if command["attack"]:
                self.attack_left = self.sticky_attack
            if self.attack_left > 0:
                command.update(attack=1, jump=0)  # jumping while attacking would move the target block
                self.attack_left -= 1
        if self.sticky_jump:
            if command["jump"]:
                self.jump_left = self.sticky_jump
            if self.jump_left > 0:
                command.update(jump=1, forward=1)
                self.jump_left -= 1
        pitch, yaw = command["camera"]
        if pitch:
            low, high = self.pitch_limit
            if low <= self.pitch + pitch <= high:
                self.pitch += pitch
            else:
                pitch = 0.0
        command["camera"] = np.array([pitch, yaw], np.float32)
        return command

    def _counts(self, raw):
        """Inventory counts by item name, with the second log type counted as log."""
        counts = {item: float(np.asarray(raw["inventory"].get(item, 0))) for item in self.items}
        if "log" in counts:
            counts["log"] += float(np.asarray(raw["inventory"].get("log2", 0)))
        return counts

    @staticmethod
    def _health(raw):
        return float(np.asarray(raw["life_stats"]["life"])) / 20.0

    def _obs(self, raw, counts, is_first=False, is_last=False, is_terminal=False):
        inventory = np.array([counts[item] for item in self.items], np.float32)
        self.inventory_max = inventory if self.inventory_max is None else np.maximum(self.inventory_max, inventory)
        equipped = np.zeros(len(self.equip_items), np.float32)
        kind = raw["equipped_items"]["mainhand"]["type"]
        if kind in self.equip_items:
            equipped[self.equip_items.index(kind)] = 1.0
        stats = raw["life_stats"]
        image = np.asarray(raw["pov"], np.uint8)
        if image.shape[:2] != self.size:
            import cv2

            image = cv2.resize(image, self.size[::-1], interpolation=cv2.INTER_AREA)
        obs = {
            "image": image,
            "inventory": inventory,
            "inventory_max": self.inventory_max.copy(),
            "equipped": equipped,
            "health": np.array([self._health(raw)], np.float32),
            "hunger": np.array([float(np.asarray(stats["food"])) / 20.0], np.float32),
            "breath": np.array([float(np.asarray(stats["air"])) / 300.0], np.float32),
            "is_first": is_first, "is_last": bool(is_last), "is_terminal": bool(is_terminal),
        }
        for item in self.logged:
            obs[f"log_inventory_{item}"] = np.int32(counts[item])
        return obs

    def _reward(self, counts, health):
        reward = 0.01 * (health - self.last_health)
        if self.task == "diamond":
            new = {item for item in MILESTONES if counts.get(item, 0) > 0} - self.seen
            self.seen |= new
            reward += len(new)
        else:
            reward += max(0.0, counts.get("log", 0.0) - self.last_counts.get("log", 0.0))
        self.last_counts, self.last_health = counts, health
        return reward

    def close(self):
        self.env.close()


def episode_metrics(episodes):
    """Percent of the given episodes in which each milestone item was ever in the inventory."""
    metrics = {}
    for item in MILESTONES:
        key = f"log_inventory_{item}"
        if episodes and all(key in episode for episode in episodes):
            metrics[f"collect_{item}"] = 100.0 * float(np.mean([np.max(e[key]) > 0 for e in episodes]))
    return metrics


def _minerl():
    try:
        import minerl
    except ImportError as e:
        raise ImportError(INSTALL) from e
    # MineRL 0.4.4 still uses numpy aliases that numpy 1.24 removed; restore them for it alone
    # (each environment runs in its own worker process under the minecraft preset).
    for alias, value in (("float", float), ("int", int), ("bool", bool)):
        if alias not in np.__dict__:
            setattr(np, alias, value)
    return minerl


def _minerl_env(size, break_speed):
    """The MineRL 0.4.4 survival environment; returns (env, inventory items, equipped item values)."""
    _minerl()
    from minerl.herobraine.env_spec import EnvSpec
    from minerl.herobraine.hero import handler, handlers, mc

    class BreakSpeedMultiplier(handler.Handler):
        """Agent start handler understood by the patched MineRL build: blocks break this much faster."""

        def __init__(self, multiplier):
            self.multiplier = multiplier

        def to_string(self):
            return f"break_speed({self.multiplier})"

        def xml_template(self):
            return "<BreakSpeedMultiplier>{{multiplier}}</BreakSpeedMultiplier>"

    class SurvivalSpec(EnvSpec):
        """Default world, day-night cycle and mobs, no built-in reward or time limit."""

        def __init__(self):
            super().__init__(name="DreamerMinecraft-v0")

        def create_agent_start(self):
            return [BreakSpeedMultiplier(break_speed)]

        def create_agent_handlers(self):
            return []

        def create_server_world_generators(self):
            return [handlers.DefaultWorldGenerator(force_reset=True)]

        def create_server_quit_producers(self):
            return [handlers.ServerQuitWhenAnyAgentFinishes()]

        def create_server_initial_conditions(self):
            return [handlers.TimeInitialCondition(allow_passage_of_time=True, start_time=0),
                    handlers.SpawningInitialCondition(allow_spawning=True)]

        def create_observables(self):
            return [handlers.POVObservation(tuple(size)[::-1]),  # MineRL takes (width, height)
                    handlers.FlatInventoryObservation(mc.ALL_ITEMS),
                    handlers.EquippedItemObservation(mc.ALL_ITEMS, _default="air", _other="other"),
                    handlers.ObservationFromLifeStats()]

        def create_actionables(self):
            keys = [handlers.KeybasedCommandAction(key, mc.INVERSE_KEYMAP[key])
                    for key in ("forward", "back", "left", "right", "jump", "sneak", "attack")]
            items = ["none"] + list(mc.ALL_ITEMS)
            extra = {"_other": "none", "_default": "none"}
            return keys + [handlers.CameraAction(), handlers.PlaceBlock(items, **extra),
                           handlers.EquipAction(items, **extra), handlers.CraftAction(items, **extra),
                           handlers.CraftNearbyAction(items, **extra), handlers.SmeltItemNearby(items, **extra)]

        def create_rewardables(self):
            return []

        def create_server_decorators(self):
            return []

        def create_mission_handlers(self):
            return []

        def create_monitors(self):
            return []

        def is_from_folder(self, folder):
            return folder == "none"

        def get_docstring(self):
            return "Minecraft survival for DreamerV3 (diamond and wood tasks)."

        def determine_success_from_rewards(self, rewards):
            return True

    env = SurvivalSpec().make()
    items = list(env.observation_space["inventory"].spaces)
    equip_items = list(env.observation_space["equipped_items"]["mainhand"]["type"].values)
    return env, items, equip_items


def make(name, config, mode, seed):
    check(name)
    env, items, equip_items = _minerl_env(config.size, config.break_speed)
    env.seed(int(seed))
    minecraft = Minecraft(name, env, items, equip_items, config.size, config.action_repeat, config.break_speed)
    return wrappers.wrap(minecraft, config)
