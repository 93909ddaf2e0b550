"""Helpers several test files share: dreamer.main run in this process, a folder's files as bytes, the
frame a killed run resumes from, and an agent of the debug preset with a replayed batch of its shape."""

import pathlib

import numpy as np
import torch

import config as cfg
import dreamer
import envs
import storage


def main(capsys, *args):
    """dreamer.main in this process: (exit status, stdout, stderr)."""
    try:
        dreamer.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # escaping main would end the test session instead of failing a test
        code = "KeyboardInterrupt escaped"
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(folder, skip=("run.lock",)):
    """Every file below `folder` (but those named in `skip`): its path relative to it -> its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in pathlib.Path(folder).rglob("*")
            if p.is_file() and p.name not in skip}


def resumed_frame(logdir, traindir=None, action_repeat=2):
    """The frame a rerun of a killed run resumes from: the checkpoint's, plus every step stored after it.
    It recovers first, as the rerun does (a checkpoint or episode complete in its temporary file), and the
    checkpoint's stored_steps count its running episodes' steps too: lost by a kill, they were still spent."""
    logdir = pathlib.Path(logdir)
    traindir = traindir or logdir / "train_eps"
    storage.recover_episodes(traindir)
    state, _, _ = storage.resume_checkpoint(logdir / "latest.pt")
    counters = state["counters"]
    stored = storage.stored_steps(traindir)
    return action_repeat * (counters["policy_steps"] + max(0, stored - counters["stored_steps"]))


def make_agent(*flags):
    """A debug-preset agent on the CPU (seeded) and a training environment for it."""
    config = cfg.parse(["--configs", "debug", "--device", "cpu", *flags])
    env = envs.make_env(config, "train", 0)
    torch.manual_seed(0)
    return dreamer.Dreamer(env.obs_space, env.act_space, config), env


def batch_for(agent, env, length=None, seed=0):
    """A replayed batch of the agent's shape (its batch_length plus the replay context unless `length`),
    from a run of random actions with rewards, terminations and episode starts that differ from step to step."""
    config = agent.config
    replay = storage.Replay(1000, 1, seed=seed)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(3 * config.batch_length):
        step = {**obs, "action": action, "reward": np.float32(rng.normal())}
        step.update({k: v[0] for k, v in agent.context.entries(None, 1).items()})
        replay.add(step)
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, _, done, _ = env.step(action)
        if done:
            obs = env.reset()
    return replay.sample(config.batch_size, length or config.batch_length + agent.context.steps)
