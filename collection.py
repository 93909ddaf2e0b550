"""What a run collects, as its Trainer counts it: the training environments' steps, taken in the
learner's thread or by a collector thread with its own copy of the policy.

parallel.py holds the environments and their stepping (Collector, CollectorThread); this module is
the Trainer's side of them: counting what was handed over, once, in the learner's thread.
"""

import collections
import contextlib

import launch
import parallel
import storage


class Collection:
    """The training environments' experience for the Trainer. Synchronous, the learner's thread steps
    them (`step`); asynchronous, a collector thread does (parallel.CollectorThread, made by `start`)
    with `actor`, a copy of the agent refreshed by `sync`. Either way the learner's thread alone
    counts what was handed over (`count`): policy steps, finished episodes and their stored steps
    into `counters`. Offline (no training environments: `collector` None) time advances as if the
    agent were collecting, `envs` steps at a time."""

    def __init__(self, config, train_envs, replay, traindir, context, counters):
        self.config, self.counters, self.traindir = config, counters, traindir
        self.finished = collections.deque()  # episodes the collector finished, not yet counted and logged
        self.collector = (parallel.Collector(train_envs, replay, traindir, self.finished.append,
                                             config.action_repeat, context, config.chunk_size)
                          if train_envs else None)
        self.thread = self.actor = None  # asynchronous: the collector thread and its agent, from `start` on
        self.synced = 0  # the learner's update count at the last sync

    def step(self, policy):
        """One synchronous step of every environment under `policy`."""
        if self.collector is None:
            self.counters.policy_steps += max(1, self.config.envs)
            return
        self.counters.policy_steps += self.collector.step(policy)

    def count(self, on_episode):
        """Count what collection handed over: the collector thread's steps (a synchronous step is
        counted where it is taken) and the episodes finished since the last count, each handed to
        `on_episode` (the run's log)."""
        if self.thread is not None:
            for steps, episodes in self.thread.take():
                self.counters.policy_steps += steps
                self.finished.extend(episodes)
        while self.finished:
            episode = self.finished.popleft()
            self.counters.episodes += 1
            self.counters.stored_steps += len(episode["reward"]) - 1
            on_episode(episode)

    def stored_steps(self):
        """For a checkpoint: the steps the episode files hold (chunks of running episodes too: what a
        kill -9 would leave) and those of running episodes that their files will hold
        (Collector.unstored), so that a resume counts each step once."""
        return storage.stored_steps(self.traindir) + self.collector.unstored()

    def between_steps(self):
        """A context in which the collector thread takes no step (a save's counters and files agree)."""
        return self.thread.step_lock if self.thread is not None else contextlib.nullcontext()

    # -- asynchronous --------------------------------------------------------------------------------

    def start(self, actor, mode, limiter, stopwatch):
        """The collector thread, acting with `actor` (the agent's copy, never compiled) in the mode
        `mode(frames)` at the frames it counted, held to the train ratio by `limiter`."""
        self.actor = actor
        self.actor_stream = launch.SideStream(self.config.device)  # on CUDA the actor's work has a stream of its own
        self.thread = parallel.CollectorThread(self.collector, self.actor_policy, limiter, self.counters.policy_steps,
                                               self.config.steps, stopwatch)
        self.mode = mode

    def actor_policy(self, obs, state):
        with self.actor_stream():
            return self.actor.policy(obs, state, self.mode(self.thread.frames))

    def sync(self, agent, updates):
        """Copy the learner's weights into the collector thread's agent, between two of its steps."""
        with self.thread.policy_lock, self.actor_stream.handover():
            self.actor.load_state_dict(agent.state_dict())
        self.synced = updates

    def stop(self):
        if self.thread is not None:
            self.thread.close()
