"""Several seeds in one process (--seeds N), trained with one batched update.

Each seed is a run of its own, exactly as if started alone: its own environments, replay,
Trainer, logdir (<logdir>/seed<k>), checkpoint and random streams (a torch.Generator per seed,
distributions.generator). What the seeds share is the update: the weights of the N agents are
stacked along a leading seed axis (`Stack`; each agent's parameters stay views of their row, so
acting, saving and loading see them), and the loss of every seed is one forward and one backward
pass over that axis (torch.func.vmap of functional_call, `BatchedUpdate`). Each seed's optimizer
then steps its own row of the gradients, so its clipping and moments never see another seed's.
The noise of each seed's samples is drawn from its own generator before the pass, in the order
its update alone would draw it (`Tape`), so seed k of a batched run computes what seed
k alone computes, up to the rounding of batched matrix products.

Each seed's Trainer runs its loop in a thread of its own (`train_together`); a thread that owes an
update hands its batch to the BatchedUpdate and waits until every live seed has done so. A seed
that is not ready (still prefilling, or finished) does not hold the others: the update then runs
with a stand-in batch for it and leaves its weights, moments and state untouched (`absent`).
"""

import contextlib
import sys
import threading
import time
import warnings

import torch

import distributions
import models
import networks
import precision
import tools


def check(config, world_size):
    """What --seeds N > 1 cannot do yet, as a ConfigError of one line (compile auto: it runs eager)."""
    if config.seeds <= 1:
        return
    unsupported = {"asynchronous": config.asynchronous, "eval_only": config.eval_only,
                   "offline_traindir": bool(config.offline_traindir),
                   "compile": config.compile not in (False, "False", "auto"),
                   "expl_behavior plan2explore": config.expl_behavior == "plan2explore"}
    for key, on in unsupported.items():
        if on:
            raise tools.ConfigError(f"--seeds {config.seeds} does not run with --{key} yet: train the seeds as "
                                    "separate runs (--seeds 1, one --seed each)")
    if world_size > 1:
        raise tools.ConfigError(f"--seeds {config.seeds} does not run under torchrun yet: run it as one process")


# ==================================================================================================
# Each seed's noise, and the layout of images inside vmap
# ==================================================================================================


DRAWS = {"uniform": lambda shape, device, gen: torch.rand(shape, device=device, generator=gen),
         "normal": lambda shape, device, gen: torch.empty(shape, device=device).normal_(generator=gen)}


class Tape:
    """The noise of one computation, in the order it is taken. Recording (`values` None), `take`
    notes each draw's kind and shape and returns zeros, drawing nothing; `draw` then draws the
    noise of those draws from a generator, in that order, as a flat (total,) tensor per kind; a
    tape given those (`values`, one seed's slice inside vmap) hands them out in the same order."""

    def __init__(self, values=None):
        self.values, self.draws, self.offsets = values, [], {kind: 0 for kind in DRAWS}

    def take(self, kind, shape, device):
        if self.values is None:
            self.draws.append((kind, shape))
            return torch.zeros(shape, device=device)  # on the sample's device: the recording pass runs there
        count = 1
        for size in shape:
            count *= size
        start = self.offsets[kind]
        self.offsets[kind] = start + count
        return self.values[kind][start:start + count].reshape(shape)

    @staticmethod
    def draw(draws, gen, device):
        """{kind: (total,)} noise for the recorded `draws` [(kind, shape)], from `gen`."""
        parts = {kind: [] for kind in DRAWS}
        for kind, shape in draws:
            parts[kind].append(DRAWS[kind](shape, device, gen).flatten())
        return {kind: torch.cat(found) if found else torch.zeros(0, device=device) for kind, found in parts.items()}

    @staticmethod
    def zeros(draws, device):
        """Zeros in the place of `draw`'s noise, drawing nothing."""
        totals = {kind: 0 for kind in DRAWS}
        for kind, shape in draws:
            totals[kind] += torch.Size(shape).numel()
        return {kind: torch.zeros(total, device=device) for kind, total in totals.items()}


@contextlib.contextmanager
def vmapped():
    """The block runs inside torch.func.vmap on this thread: conv activations then keep the
    contiguous layout (networks.image_layout), since vmap cannot query channels_last."""
    before = getattr(networks.layout, "vmapped", False)
    networks.layout.vmapped = True
    try:
        yield
    finally:
        networks.layout.vmapped = before


def seed_generator(device):
    """A generator in the state torch's global one is in now on `device`: a seed's own stream,
    continuing exactly where the seed's run alone would continue drawing."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.set_state(torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())
    return gen


# ==================================================================================================
# The stacked weights
# ==================================================================================================


class Stack:
    """The parameters and buffers of N agents of one config, stacked along a new leading seed axis:
    {name: (N, ...)} leaf tensors. Agent k's own tensors become views of row k (their storage is
    the stack's), so anything that reads or writes agent k (its policy, its optimizers' in-place
    steps, a checkpoint's load) reads or writes the stack, and the other way round."""

    def __init__(self, agents):
        self.agents = agents
        self.params, self.buffers = {}, {}
        for found, kind in ((self.params, "named_parameters"), (self.buffers, "named_buffers")):
            per_agent = [dict(getattr(agent, kind)()) for agent in agents]
            for name, first in per_agent[0].items():
                tensors = [own[name] for own in per_agent]
                stacked = torch.stack([t.detach() for t in tensors])
                if kind == "named_parameters":
                    stacked.requires_grad_(first.requires_grad)
                for k, tensor in enumerate(tensors):
                    tensor.data = stacked.data[k]
                found[name] = stacked


# ==================================================================================================
# The batched update
# ==================================================================================================


class SeedLosses(torch.nn.Module):
    """One seed's `part` of the loss (models.loss, models.PARTS) over the template agent's modules
    (functional_call swaps in a seed's weights): its terms, metrics and detached posteriors."""

    def __init__(self, agent):
        super().__init__()
        self.agent = agent

    def forward(self, data, part, post=None):
        agent = self.agent
        start, data = agent.context.split(data)
        with precision.autocast(agent.config):
            losses, post, _, metrics = models.loss(agent.task_behavior, data, start, part, post)
        return losses, metrics, {k: v.detach() for k, v in post.items()}


class BatchedUpdate:
    """One update of N seeds' agents (`agents`, one config) in one forward and backward pass.

    `train_step(k, batch, data)` is seed k's Update.train_step: it hands the batch over and waits
    until every live seed (`live`) has handed its over, then one of the waiting threads runs the
    update for all and each gets its own (metrics, latents) back. `leave(k)` when seed k's loop
    ends. The parts of the loss and their steps come in the order of every update
    (models.run_update over models.PARTS), each part one vmapped pass over the seeds."""

    def __init__(self, agents, generators):
        self.agents, self.generators = agents, generators
        self.count = len(agents)
        self.stack = Stack(agents)
        self.module = SeedLosses(agents[0])
        self.prefix = "agent."
        self.schedules = {}  # (part, batch shape) -> the recorded noise draws
        self.lock = threading.Condition()
        self.live, self.pending, self.results = set(range(self.count)), {}, {}
        self.generation = 0
        self.error = None

    # -- the hand-over between the seeds' threads -----------------------------------------------------

    def train_step(self, seed, batch, data=None):
        with self.lock:
            if self.error is not None:
                raise RuntimeError("another seed's batched update failed") from self.error
            self.pending[seed] = (batch, data)
            generation = self.generation
            self.maybe_run()
            while self.generation == generation and self.error is None:
                self.lock.wait()
            if self.error is not None:
                raise RuntimeError("the batched update failed") from self.error
            return self.results.pop(seed)

    def leave(self, seed):
        with self.lock:
            self.live.discard(seed)
            self.maybe_run()

    def maybe_run(self):
        """With the lock held: run the update once every live seed waits for it."""
        if not self.pending or not self.live <= set(self.pending):
            return
        pending, self.pending = self.pending, {}
        try:
            self.results.update(self.run(pending))
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.generation += 1
            self.lock.notify_all()

    # -- the update itself --------------------------------------------------------------------------------

    def run(self, pending):
        """pending {seed: (batch, data)} -> {seed: (metrics, latents)}; the seeds not in pending are
        absent: a copy of another's batch stands in, and nothing of theirs changes."""
        present = sorted(pending)
        absent = [k for k in range(self.count) if k not in pending]
        stand_in = pending[present[0]]
        datas = []
        for k in range(self.count):
            batch, data = pending.get(k, stand_in)
            datas.append(self.agents[k].wm.preprocess(batch if data is None else data))
        data = {key: torch.stack([d[key] for d in datas]) for key in datas[0]}
        kept = {name: buffer[absent].clone() for name, buffer in self.stack.buffers.items()} if absent else {}
        metrics = [{} for _ in range(self.count)]
        config = self.agents[0].config

        def compute(part, post):  # the world model is frozen where it stepped already ('behavior')
            losses, part_metrics, post = self.losses(data, part, present, post,
                                                     frozen="agent.wm." if part == "behavior" else None)
            return losses, post, None, part_metrics

        def apply(names, losses):  # each seed's step metrics go to its own row of `metrics`
            self.step_optimizers(names, losses, present, metrics)
            return {}

        losses, post, _, part_metrics = models.run_update(config, models.PARTS[config.update], compute, apply,
                                                          lambda losses: self.check(losses, data))
        for name, rows in kept.items():  # an absent seed's return normalisation and counters stay as they were
            self.stack.buffers[name].data[absent] = rows
        results = {}
        for k in present:
            agent = self.agents[k]
            found = {key: value[k] for key, value in part_metrics.items()}
            found.update(metrics[k])
            models.after_steps(agent.task_behavior, {t: v[k] for t, v in losses.items()}, found,
                               shares=config.update == "joint")
            latents = agent.context.latents({key: value[k] for key, value in post.items()})
            results[k] = (found, latents)
        return results

    def check(self, losses, data):
        """Every seed's terms against the one table (models.check_terms), as Update.train_step
        checks them before stepping: seed 0's, whose shapes and names all seeds share."""
        template = self.agents[0]
        size, length = data["is_first"].shape[1:]
        models.check_terms({k: v[0] for k, v in losses.items()}, template.wm.scales, template.update.optimizers,
                           size, length - template.context.steps)

    def losses(self, data, part, present, post=None, frozen=None):
        """Every seed's loss terms {term: (N, B, T)}, metrics {name: (N,)} and posteriors, in one
        vmapped pass; weights whose names start with `frozen` get no gradient."""
        shape = tuple(data["is_first"].shape[1:])
        key = (part, shape)
        if key not in self.schedules:
            self.schedules[key] = self.record(data, part, post)
        draws = self.schedules[key]
        device = data["is_first"].device
        noise = [Tape.draw(draws, gen, device) if k in present else Tape.zeros(draws, device)
                 for k, gen in enumerate(self.generators)]
        noise = {kind: torch.stack([n[kind] for n in noise]) for kind in DRAWS}
        params = {self.prefix + k: (v.detach() if frozen and (self.prefix + k).startswith(frozen) else v)
                  for k, v in self.stack.params.items()}
        buffers = {self.prefix + k: v for k, v in self.stack.buffers.items()}
        module = self.module

        def one(params, buffers, data, noise, post):
            with distributions.tape(Tape(noise)), vmapped():
                return torch.func.functional_call(module, (params, buffers), (data, part, post), strict=True)

        in_dims = (0, 0, 0, 0, None if post is None else 0)
        with warnings.catch_warnings():
            # functorch loops over the seeds for torch.quantile (the return normalisation): correct, and says so
            warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
            return torch.func.vmap(one, in_dims=in_dims, randomness="error")(params, buffers, data, noise, post)

    def record(self, data, part, post):
        """The noise draws (kind, shape) of one seed's `part` of the update, recorded on seed 0's
        weights and a copy of its buffers without drawing anything."""
        tape = Tape()
        params = {self.prefix + k: v[0].detach() for k, v in self.stack.params.items()}
        buffers = {self.prefix + k: v[0].clone() for k, v in self.stack.buffers.items()}
        one = {key: value[0] for key, value in data.items()}
        first_post = None if post is None else {key: value[0] for key, value in post.items()}
        with torch.no_grad(), distributions.tape(tape):
            torch.func.functional_call(self.module, (params, buffers), (one, part, first_post), strict=True)
        return tape.draws

    def step_optimizers(self, names, losses, present, metrics):
        """Backpropagate every present seed's loss of the optimizers `names` into its row of the
        stack, then step each present seed's own optimizers on its row of the gradients; their
        metrics go to metrics[k]."""
        agents = self.agents
        own = {id(p): name for name, p in agents[0].named_parameters()}
        total, per_seed, rows = 0, {}, set()
        for name in names:
            opt, terms = agents[0].update.optimizers[name]
            rows.update(own[id(p)] for p in opt.params)
            for k in present:
                seed_opt, seed_terms = agents[k].update.optimizers[name]
                scales = agents[k].wm.scales
                loss = models.scaled_sum({t: v[k] for t, v in losses.items()}, scales, seed_terms)
                per_seed[(name, k)] = loss
                total = total + seed_opt.scaler.scale(loss)
        inputs = [self.stack.params[row] for row in sorted(rows)]
        for tensor in inputs:
            tensor.grad = None
        total.backward(inputs=inputs)
        for name in names:
            for k in present:
                seed_opt, _ = agents[k].update.optimizers[name]
                by_id = {id(p): row for row, p in agents[k].named_parameters()}
                for p in seed_opt.params:
                    p.grad = self.stack.params[by_id[id(p)]].grad[k]
                metrics[k].update(seed_opt.step(per_seed[(name, k)]))
                for p in seed_opt.params:
                    p.grad = None


class SeedLearner:
    """Seed k's side of the BatchedUpdate, in the place of its agent's Update for its Trainer."""

    def __init__(self, batched, seed):
        self.batched, self.seed = batched, seed

    def train_step(self, batch, data=None):
        return self.batched.train_step(self.seed, batch, data)


# ==================================================================================================
# The seeds' loops
# ==================================================================================================


def cost_line(agent, config, spec):
    """What each seed beyond the first adds: its weights, gradients and two optimizer moments (the
    stack holds the weights and gradients of all), its replay at capacity and its environments."""
    params = sum(p.numel() for p in agent.parameters())
    replay = sum(int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in spec.values())
    return (f"Seeds: {config.seeds} in one process (<logdir>/seed0 .. seed{config.seeds - 1}), one batched update; "
            f"each seed beyond the first adds {16 * params / 1e6:,.3g} MB of weights, gradients and optimizer "
            f"moments, its replay (up to {replay * config.dataset_size / 1e9:,.3g} GB) and {config.envs} "
            "environments")


class SeedOutput:
    """sys.stdout while the seeds train: each line a seed's thread prints starts with its name. A
    seed's line is written whole, once it ends: print writes its text and its newline in two calls,
    between which another seed's thread may write (which glued two seeds' lines into one)."""

    def __init__(self, stream):
        self.stream, self.lock, self.pending = stream, threading.Lock(), {}

    def write(self, text):
        name = threading.current_thread().name
        if not name.startswith("seed"):
            return self.stream.write(text)
        with self.lock:
            parts = (self.pending.pop(name, "") + text).splitlines(keepends=True)
            if parts and not parts[-1].endswith(("\n", "\r")):
                self.pending[name] = parts.pop()
            self.stream.write("".join(f"{name}: {part}" for part in parts))
        return len(text)

    def finish(self):
        """Write what a seed left without an end of line."""
        with self.lock:
            self.stream.write("".join(f"{name}: {part}\n" for name, part in self.pending.items()))
            self.pending.clear()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stop_code(stops, error):
    """The launch.Stops code of a stop by `error` (Ctrl-C: KeyboardInterrupt, SIGTERM: its own)."""
    return next((code for sig, code in stops.CODES.items() if type(error) is stops.exceptions[sig]), 1)


def train_together(trainers, generators, batched, environments):
    """Run every seed's Trainer.train in a thread of its own, drawing from its own generator, and
    close its `environments` (a list per seed, emptied as they are closed) there at its end. A
    Ctrl-C or SIGTERM (they reach the main thread) or any seed's error asks every other seed to stop
    as the signal would: each saves at its next update boundary (Trainer.stop_if_asked) and ends.
    Then the signal, or the first error, is raised here, once every seed's thread has closed its
    environments and ended."""
    errors = [None] * len(trainers)
    ended = [False] * len(trainers)  # set last in each thread: see the waiting loop below

    def stop_all(code):
        for trainer in trainers:
            trainer.agreement.stops.code = max(trainer.agreement.stops.code, code)

    def run(k):
        try:
            with distributions.generator(generators[k]):
                trainer = trainers[k]
                if trainer.done:
                    print(f"Run finished: {trainer.config.logdir} completed {trainer.frames} frames of --steps "
                          f"{trainer.config.steps}; nothing to do", flush=True)
                else:
                    trainer.train()
        except BaseException as e:  # noqa: B036 - handed to the main thread
            errors[k] = e
            if not isinstance(e, KeyboardInterrupt):
                stop_all(1)
        finally:
            try:
                batched.leave(k)
                while environments[k]:
                    environments[k].pop().close()
            finally:
                ended[k] = True

    threads = [threading.Thread(target=run, args=(k,), name=f"seed{k}", daemon=True) for k in range(len(trainers))]
    signalled = None
    stdout = sys.stdout
    sys.stdout = output = SeedOutput(stdout)
    try:
        for thread in threads:
            thread.start()
        # Waits on the threads' own flags, not Thread.join: on Python 3.11 a signal that
        # interrupts join marks a thread that is still running as stopped (CPython's bpo-45274
        # fix), and the run would end while a seed still saves, renders or closes its environments.
        while not all(ended):
            try:
                time.sleep(0.05)
            except KeyboardInterrupt as e:  # a signal: every seed saves and stops; a second one waits too
                signalled = signalled or e
                stop_all(stop_code(trainers[0].agreement.stops, e))
    finally:
        output.finish()
        sys.stdout = stdout
    if signalled is not None:
        raise signalled
    first = next((e for e in errors if e is not None and not isinstance(e, KeyboardInterrupt)), None)
    if first is not None:
        raise first
    stopped = next((e for e in errors if e is not None), None)
    if stopped is not None:
        raise stopped
