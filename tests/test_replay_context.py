"""The replay context (`replay_context`, the 2024 recipe's 1): the policy's latent stored with each
step, sequences that start from the stored latent of their context step, and the write-back of
the training posteriors, each against a plain reference written here."""

import copy
import pathlib
import sys
import types

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from stand_ins import CountingEnv, latent_policy  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import models  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402

PRESETS = cfg.load_presets()
VECTOR = ["--encoder.cnn_keys", "$^", "--decoder.cnn_keys", "$^", "--encoder.mlp_keys", "vec",
          "--decoder.mlp_keys", "vec"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags, configs=("debug", "recipe2024")):
    return cfg.parse(["--configs", *configs, "--device", "cpu", *flags], presets=copy.deepcopy(PRESETS))


def context_of(steps, deter=3, stoch=2, classes=2):
    return models.ReplayContext(types.SimpleNamespace(replay_context=steps, dyn_deter=deter, dyn_stoch=stoch,
                                                      dyn_discrete=classes))


# -- the replay's step ids and its update --------------------------------------------------------------


def fill(replay, steps, streams):
    """Steps n = 0 .. steps-1 into every stream s; each holds its id 100 s + n and a latent of -1."""
    for n in range(steps):
        for s in range(streams):
            replay.add({"n": np.int64(100 * s + n), "latent_deter": np.full(3, -1.0, np.float32),
                        "latent_stoch": np.full((2, 2), -1.0, np.float32)}, s)


def held(replay, stream):
    """(n, latent_deter) of every step a stream holds, oldest first."""
    s = replay.streams[stream]
    phys = s.indices(np.array([0]), len(s))[0]
    return s.data["n"][phys], s.data["latent_deter"][phys]


def test_add_and_sample_give_each_step_its_id_also_after_the_ring_wraps():
    replay = storage.Replay(capacity=12, streams=2, seed=0)  # 6 steps per stream
    assert replay.add({"n": np.int64(0)}, 1) == (1, 0)
    for n in range(1, 10):
        assert replay.add({"n": np.int64(100 + n)}, 1) == (1, n)
    data, ids = replay.sample(50, 4, ids=True)
    assert ids.shape == (50, 2) and (ids[:, 0] == 1).all()
    np.testing.assert_array_equal(data["n"][:, 0], 100 + ids[:, 1])  # the step at id (1, n) holds 100 + n
    assert ids[:, 1].min() >= 4 and ids[:, 1].max() <= 6  # steps 4 .. 9 held: starts 4 .. 6


def test_update_writes_each_row_to_its_steps_and_skips_steps_dropped_meanwhile():
    replay = storage.Replay(capacity=12, streams=2, seed=1)
    fill(replay, 8, 2)
    ids = np.array([[0, 3], [1, 2], [0, 5]])
    values = {"latent_deter": np.arange(3 * 3 * 3, dtype=np.float32).reshape(3, 3, 3)}
    for n in (8, 9):  # after sampling, newer steps drop steps 2 and 3 of every stream (6 held per stream)
        for s in range(2):
            replay.add({"n": np.int64(100 * s + n), "latent_deter": np.full(3, -1.0, np.float32),
                        "latent_stoch": np.full((2, 2), -1.0, np.float32)}, s)
    replay.update(ids, values)
    expected = {}  # written out: row b's value t goes to step ids[b] + t, if that step is still held
    for b, (s, first) in enumerate(ids):
        for t in range(3):
            expected[100 * s + first + t] = values["latent_deter"][b, t]
    for s in range(2):
        ns, latents = held(replay, s)
        assert list(ns) == [100 * s + n for n in range(4, 10)]
        for n, latent in zip(ns, latents):
            np.testing.assert_array_equal(latent, expected.get(n, np.full(3, -1.0)), err_msg=str(n))


# -- the world model starts from the stored latent, and its posteriors go back to their steps ---------------


def vector_agent(*flags):
    config = make_config(*VECTOR, *flags)
    obs = {"vec": gymnasium.spaces.Box(-np.inf, np.inf, (5,), dtype=np.float32)}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    torch.manual_seed(0)
    return dreamer.Dreamer(obs, gymnasium.spaces.Box(-1, 1, (3,), dtype=np.float32), config), config


def context_batch(config, batch=2, length=5, seed=0):
    """(B, K + T) steps with random stored latents (one-hot stoch) and no episode start after step 0."""
    rng = np.random.default_rng(seed)
    data = {"vec": rng.normal(size=(batch, length, 5)).astype(np.float32),
            "action": rng.uniform(-1, 1, (batch, length, 3)).astype(np.float32),
            "reward": rng.normal(size=(batch, length)).astype(np.float32),
            "is_first": np.zeros((batch, length), bool), "is_last": np.zeros((batch, length), bool),
            "is_terminal": np.zeros((batch, length), bool)}
    data["is_first"][:, 0] = True
    data["latent_deter"] = rng.normal(size=(batch, length, config.dyn_deter)).astype(np.float32)
    classes = rng.integers(0, config.dyn_discrete, (batch, length, config.dyn_stoch))
    data["latent_stoch"] = np.eye(config.dyn_discrete, dtype=np.float32)[classes]
    return data


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_training_starts_from_the_stored_latent_and_returns_its_posteriors(update):
    agent, config = vector_agent("--update", update)
    assert config.replay_context == 1
    batch = context_batch(config)
    stored = copy.deepcopy(batch)
    reference = copy.deepcopy(agent)
    torch.manual_seed(3)
    _, latents = agent.update.train_step(batch)
    for key in stored:  # the batch it was given is left as it was
        np.testing.assert_array_equal(batch[key], stored[key], err_msg=key)
    # To write back: the posterior of steps 1 .. 4, filtered from the latent stored with step 0 and
    # the action stored with each step (the one that led to it), at the parameters before the update.
    torch.manual_seed(3)
    rssm = reference.wm.rssm
    data = reference.wm.preprocess({k: v[:, 1:] for k, v in stored.items() if not k.startswith("latent_")})
    embed = reference.wm.embed(data)
    state = {"deter": torch.as_tensor(stored["latent_deter"][:, 0]),
             "stoch": torch.as_tensor(stored["latent_stoch"][:, 0])}
    for t in range(4):
        state = rssm.obs_step(state, data["action"][:, t], embed[:, t], data["is_first"][:, t])
        np.testing.assert_allclose(latents["latent_deter"][:, t], state["deter"].detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=str(t))
        np.testing.assert_array_equal(latents["latent_stoch"][:, t], state["stoch"].detach().numpy())
    for key in ("latent_deter", "latent_stoch"):  # the trained steps only, not the context step
        assert latents[key].shape == (2, 4, *stored[key].shape[2:]), key
    # The stored latent matters: from the initial state the first posterior differs.
    fresh = rssm.obs_step(rssm.initial(2), data["action"][:, 0], embed[:, 0], data["is_first"][:, 0])
    assert not np.allclose(fresh["deter"].detach().numpy(), latents["latent_deter"][:, 0], atol=1e-3)


def test_an_episode_start_inside_the_sequence_resets_the_stored_latent():
    agent, config = vector_agent()
    batch = context_batch(config)
    batch["is_first"][:, 1] = True  # the first trained step starts an episode
    other = copy.deepcopy(batch)
    other["latent_deter"][:, 0] += 5.0
    other["latent_stoch"][:, 0] = other["latent_stoch"][:, 0, :, ::-1]
    a, b = copy.deepcopy(agent), copy.deepcopy(agent)
    torch.manual_seed(4)
    _, latents_a = a.update.train_step(batch)
    torch.manual_seed(4)
    _, latents_b = b.update.train_step(other)
    np.testing.assert_array_equal(latents_a["latent_deter"], latents_b["latent_deter"])


def test_plan2explore_trains_on_the_sequence_after_the_context():
    """The ensemble's pairs come from the T trained steps alone: its posteriors are those written
    back for steps 1 .. T (never the context step's stored latent), its actions and episode starts
    those of the same steps."""
    agent, config = vector_agent("--expl_behavior", "plan2explore", "--disag_offset", "1")
    batch = context_batch(config)
    stored = copy.deepcopy(batch)
    seen = {}
    loss = agent.expl_behavior.ensemble_loss

    def recorded(post, embed, action, is_first):
        seen.update(post={k: v.detach().clone() for k, v in post.items()}, embed=embed.detach().clone(),
                    action=action.detach().clone(), is_first=is_first.detach().clone())
        return loss(post, embed, action, is_first)

    agent.expl_behavior.ensemble_loss = recorded
    metrics, latents = agent.update.train_step(batch)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    k, length = config.replay_context, batch["action"].shape[1]
    assert seen["post"]["deter"].shape[:2] == seen["embed"].shape[:2] == (2, length - k)
    np.testing.assert_array_equal(seen["action"].numpy(), stored["action"][:, k:])
    np.testing.assert_array_equal(seen["is_first"].numpy(), stored["is_first"][:, k:])
    # The latents to write back for steps 1 .. T are the training posteriors (ReplayContext.latents).
    np.testing.assert_array_equal(seen["post"]["deter"].numpy(), latents["latent_deter"].numpy())
    np.testing.assert_array_equal(seen["post"]["stoch"].numpy(), latents["latent_stoch"].numpy())
    assert not np.allclose(seen["post"]["deter"][:, 0].numpy(), stored["latent_deter"][:, 0])


def test_write_back_puts_the_trained_steps_latents_at_their_steps():
    context = context_of(1)
    replay = storage.Replay(capacity=40, streams=2, seed=2)
    fill(replay, 12, 2)
    batch, ids = replay.sample(5, 4, ids=True)  # K + T = 1 + 3
    posterior = {"deter": torch.as_tensor(1000.0 + batch["n"][:, 1:, None].repeat(3, -1)),  # (B, T, 3)
                 "stoch": torch.zeros(5, 3, 2, 2)}
    context.write_back(replay, ids, context.latents(posterior))
    context.flush()  # written one update late (the test below); here at once
    # Written out: step 100 s + n got 1000 + 100 s + n iff it was a trained (not context) step of a row.
    trained = {100 * s + first + t for s, first in ids for t in (1, 2, 3)}
    for s in range(2):
        for n, latent in zip(*held(replay, s)):
            want = 1000.0 + n if n in trained else -1.0
            np.testing.assert_array_equal(latent, np.full(3, want, np.float32), err_msg=str(n))


def test_the_write_back_lands_one_update_late_as_the_official_codes_pending_outputs():
    """embodied/jax/agent.py: `train` returns the outputs of the update before (pending_outs) and the
    run writes those to the replay; so update n's latents are in the replay only after update n + 1,
    and a checkpoint's flush writes the last pending ones."""
    context = context_of(1)
    replay = storage.Replay(capacity=40, streams=1, seed=2)
    fill(replay, 12, 1)
    ids = np.array([[0, 2]])

    def latents(value):
        return context.latents({"deter": torch.full((1, 3, 3), value), "stoch": torch.zeros(1, 3, 2, 2)})

    def written():
        return held(replay, 0)[1][3:6, 0].tolist()  # the trained steps of the row: ids 3, 4, 5

    context.write_back(replay, ids, latents(7.0))
    assert written() == [-1.0] * 3  # update 1's latents: pending
    context.write_back(replay, ids, latents(8.0))
    assert written() == [7.0] * 3  # update 2 writes update 1's
    context.write_back(replay, ids, None)  # an update without latents still writes the pending ones
    assert written() == [8.0] * 3
    context.write_back(replay, ids, latents(9.0))
    context.flush()
    assert written() == [9.0] * 3 and context.pending is None


def test_replay_context_zero_changes_nothing():
    context = context_of(0)
    assert context.spec == {} and context.entries(None, 3) == {}
    data = {"x": torch.zeros(2, 4)}
    assert context.split(data) == (None, data)
    latents = context.latents({"deter": torch.ones(2, 4, 3), "stoch": torch.ones(2, 4, 2, 2)})
    assert latents is None

    class NoUpdates:
        def update(self, ids, values):
            raise AssertionError("replay_context 0 writes nothing back")

    context.write_back(NoUpdates(), np.zeros((2, 2), np.int64), latents)
    v1 = make_config(configs=("debug",))
    assert v1.replay_context == 0 and models.ReplayContext(v1).spec == {}


# -- the collector stores the policy's latent with the step it acted on ---------------------------------------


def test_collector_stores_the_policy_latent_with_the_step_it_acted_on(tmp_path):
    envs = [CountingEnv(4), CountingEnv(3)]
    replay = storage.Replay(100, 2)
    finished = []
    collector = parallel.Collector(envs, replay, tmp_path, finished.append, context=context_of(1))
    for _ in range(5):
        collector.step(latent_policy)
    assert len(finished) == 2
    for episode in finished:
        x = episode["x"]
        # The last step's latent stays zero: the policy never acts on it.
        want = np.where(np.arange(len(x)) < len(x) - 1, x + 0.5, 0.0)
        np.testing.assert_array_equal(episode["latent_deter"], want[:, None].repeat(3, 1))
        np.testing.assert_array_equal(episode["latent_stoch"][:, 0, 0], np.where(want > 0, x + 0.25, 0.0))
    for s in range(2):  # the replay holds the same, also for steps of episodes still running
        stream = replay.streams[s]
        x = stream.data["x"][:len(stream)]
        deter = stream.data["latent_deter"][:len(stream), 0]
        unseen = stream.data["is_last"][:len(stream)].copy()
        unseen[-1] = True  # the newest step: the policy acts on it in the next collector step
        np.testing.assert_array_equal(deter, np.where(unseen, 0.0, x + 0.5))
    # Saved and loaded, the latents come back; without them (an older run) they are zeros, and a
    # run without replay context drops them.
    spec = {"x": ((), np.dtype(np.float32)), "is_first": ((), np.dtype(bool)), "is_last": ((), np.dtype(bool)),
            "is_terminal": ((), np.dtype(bool)), "action": ((1,), np.dtype(np.float32)),
            "reward": ((), np.dtype(np.float32)), "task": ((), np.dtype(np.int32))}
    full = {**spec, **context_of(1).spec}
    loaded = storage.load_episodes(tmp_path, spec=full)
    assert len(loaded) == 2
    for key in ("latent_deter", "latent_stoch"):
        np.testing.assert_array_equal(sorted(e[key].sum() for e in loaded), sorted(e[key].sum() for e in finished))
    assert all("latent_deter" not in e for e in storage.load_episodes(tmp_path, spec=spec))
    bigger = {**spec, **context_of(1, deter=5).spec}  # another model size: its latents do not fit
    assert all((e["latent_deter"] == 0).all() and e["latent_deter"].shape[1:] == (5,)
               for e in storage.load_episodes(tmp_path, spec=bigger))
    old = tmp_path / "old"
    storage.save_episode(old, {k: v for k, v in finished[0].items() if not k.startswith("latent_")})
    (episode,) = storage.load_episodes(old, spec=full)
    assert episode["latent_stoch"].shape == (len(finished[0]["x"]), 2, 2) and not episode["latent_stoch"].any()


# -- a recipe2024 run with replay_context 1 trains, writes back and resumes -----------------------------------


@pytest.mark.slow  # in-process training runs
def test_recipe2024_run_writes_back_each_update_and_resumes(tmp_path, monkeypatch):
    samples, updates, batches = [], [], []
    sample, update, train_step = storage.Replay.sample, storage.Replay.update, models.Update.train_step

    def recording_sample(self, batch, length, ids=False, **kwargs):
        out = sample(self, batch, length, ids, **kwargs)
        if ids:
            samples.append((length, out[1].copy()))
        return out

    def recording_update(self, ids, values):
        if values["latent_deter"].shape[1] > 1:  # the learner's write-back (the collector writes one step per row)
            updates.append((np.array(ids), {k: storage.host_array(v) for k, v in values.items()}))
        return update(self, ids, values)

    def recording_train_step(self, batch, *args):
        metrics, latents = train_step(self, batch, *args)
        batches.append({k: v.numpy() for k, v in latents.items()})
        return metrics, latents

    monkeypatch.setattr(storage.Replay, "sample", recording_sample)
    monkeypatch.setattr(storage.Replay, "update", recording_update)
    monkeypatch.setattr(models.Update, "train_step", recording_train_step)
    logdir = tmp_path / "run"
    common = ["--configs", "debug", "recipe2024", "--eval_episode_num", "0", "--time_limit", "20",
              "--batch_size", "3", "--batch_length", "6", "--logdir", str(logdir)]
    dreamer.main([*common, "--steps", "60"])
    assert updates and len(samples) == len(updates) == len(batches)
    for (length, sampled), (ids, values), batch in zip(samples, updates, batches):
        assert length == 7  # batch_length 6 + 1 context step
        np.testing.assert_array_equal(ids, sampled + [0, 1])
        for key in ("latent_deter", "latent_stoch"):
            np.testing.assert_array_equal(values[key], batch[key])
    assert any(np.abs(batch["latent_deter"][:, 0]).sum() > 0 for batch in batches)  # stored latents were used
    episodes = sorted((logdir / "train_eps").glob("*.npz"))
    assert episodes and all("latent_deter" in np.load(f) for f in episodes)
    first = storage.load_checkpoint(logdir / "latest.pt")["counters"]["updates"]
    dreamer.main([*common, "--steps", "100", "--asynchronous", "True"])
    assert storage.load_checkpoint(logdir / "latest.pt")["counters"]["updates"] > first
