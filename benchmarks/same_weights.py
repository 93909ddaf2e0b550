"""Both codes at the same weights on the same replayed batch: loss terms and expected gradients side by side.

    python3 benchmarks/same_weights.py --official ~/dreamerv3 --python ~/dreamerv3/venv/bin/python \\
        --seeds 32 --configs dmc_proprio recipe2024 size1m --task dmc_cheetah_run --batch_size 16 \\
        --batch_length 32 --logdir ./logdir/learning/dmc_cheetah_run/official_s0

A learning run tells whether the codes learn alike; this tells where they part when they do not. It takes the
checkpoint of an official run made by benchmarks/official.py (`--logdir`: its LOGDIR, with `official/ckpt`
and `official/replay`) and the project command of that run (the dreamer.py flags, as official.py takes them),
draws one batch of windows from the run's replay (`--windows-seed`), and on it computes:

- in the official code (its interpreter `--python`, one thread): the whole loss of one update and the gradient
  of every parameter, once per seed `0 .. --seeds - 1` (the seed draws the posterior, prior and action
  samples of the update), from the checkpoint's weights each time;
- in this project: the same, with the checkpoint's weights loaded into the project's networks (the official
  names mapped to the project's, kernels transposed, feature and key orders permuted) and the terms of
  models.Update.train_step under `--update joint`, the official code's single optimizer.

Then one optimizer step: this project's joint optimizer loaded with the checkpoint's optimizer state
(LaProp's moments and step count) takes the official seed-0 gradients, and its change of every parameter
(and the slow critic's) is set beside the official code's own step from the same state.

The noise of the samples differs between the codes, so the gradients' comparison is of expectations: per loss term the
mean over seeds and its standard error; per network (encoder, dynamics, decoder, reward, continue, actor,
critic) the mean gradient norm, the norm of the mean gradient, and the cosine between the two codes' mean
gradients next to the cosine between the two halves of each code's own seeds. The reading rule: a network
AGREES when the two codes' cosine is at least the smaller of the two half-to-half cosines (the codes are no
further apart than a code is from itself at half the seeds), DIFFERS otherwise; with few seeds the actor's
policy gradient is mostly noise and the half-to-half cosines say so.

Vector observations and `replay_context 1` only (the official image networks are not mapped). The official
side changes no file of the checkout: it subclasses the official optimizer in its own process to read the
gradients. Writes OUT (default LOGDIR/same_weights.md) and prints it. Bad input: one line, exit status 2.
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # last: benchmarks/envs.py must not shadow envs
sys.path.insert(0, str(ROOT))

import official  # noqa: E402

# Run by the official interpreter: argv = checkout, official logdir, seeds, windows seed, output npz.
OFFICIAL_SIDE = official.KEEP_XLA_FLAGS + r'''
import glob, pathlib, pickle, tempfile
import numpy as np
rundir, out = pathlib.Path(sys.argv[2]), sys.argv[5]
seeds, windows_seed = int(sys.argv[3]), int(sys.argv[4])
from embodied.jax import internal
import elements, embodied, ninjax as nj, optax
import ruamel.yaml as yaml
import embodied.jax.opt as opt

class GradientOptimizer(opt.Optimizer):
    """The official optimizer's step, with every gradient added to its metrics."""
    summary_depth: int = 2
    def __call__(self, lossfn, *args, has_aux=False, **kwargs):
        def inner(*a, **k):
            outs = lossfn(*a, **k)
            return outs if has_aux else (outs, None)
        loss, params, grads, aux = nj.grad(inner, self.modules, has_aux=True)(*args, **kwargs)
        state = self.sub("state", nj.Tree, self.opt.init, params)
        updates, new_state = self.opt.update(grads, state.read(), params)
        nj.context().update(optax.apply_updates(params, updates))
        state.write(new_state)
        self.step.write(self.step.read() + 1)
        metrics = {"loss": loss.mean(), **{"grad/" + k: g for k, g in grads.items()}}
        metrics = {f"{self.name}/{k}": v for k, v in metrics.items()}
        return (metrics, aux) if has_aux else metrics

embodied.jax.Optimizer = opt.Optimizer = GradientOptimizer
from dreamerv3 import main as official_main
config = elements.Config(yaml.YAML(typ="safe").load((rundir / "config.yaml").read_text()))
config = config.update(logdir=tempfile.mkdtemp(prefix="same_weights_"))
agent = official_main.make_agent(config)
latest = (rundir / "ckpt" / "latest").read_text().strip()
ckpt = pickle.load(open(rundir / "ckpt" / latest / "agent.pkl", "rb"))

# The replay's streams: each chunk names its successor; a stream is a chain of chunks.
chunks = {}
for path in sorted(glob.glob(str(rundir / "replay" / "*.npz"))):
    _, uuid, succ, _ = pathlib.Path(path).stem.split("-")
    chunks[uuid] = (succ, path)
successors = {succ for succ, _ in chunks.values()}
streams = []
for uuid in chunks:
    if uuid in successors:
        continue
    parts = []
    while uuid in chunks:
        succ, path = chunks[uuid]
        parts.append(dict(np.load(path)))
        uuid = succ
    streams.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
length = config.batch_length + config.replay_context
streams = [s for s in streams if len(s["reward"]) >= length]
assert streams, f"no replay stream of {length} steps in {rundir / 'replay'}"
rng = np.random.default_rng(windows_seed)
weights = np.array([len(s["reward"]) - length + 1 for s in streams], float)
windows = []
for _ in range(config.batch_size):
    stream = streams[rng.choice(len(streams), p=weights / weights.sum())]
    start = rng.integers(0, len(stream["reward"]) - length + 1)
    windows.append({k: v[start:start + length] for k, v in stream.items()})
data = {k: np.stack([w[k] for w in windows]) for k in windows[0]}
data["consec"] = np.zeros(data["reward"].shape, np.int32)
data = {k: data[k] for k in agent.spaces}
result = {f"param/{k}": np.asarray(v) for k, v in ckpt["params"].items()}  # with the optimizer's state
result.update({f"window/{k}": v for k, v in data.items()})
for seed in range(seeds):
    agent.load(ckpt)
    batch = internal.device_put(dict(data), agent.train_sharded)
    batch["seed"] = agent._seeds(seed, agent.train_mirrored)
    agent.train(agent.init_train(config.batch_size), batch)
    metrics = agent._take_outs(agent.pending_mets)
    agent.pending_mets = None
    if seed == 0:  # the weights after this one step, for the optimizer's side of the comparison
        after = agent.save()["params"]
        result.update({f"after/{k}": np.asarray(v) for k, v in after.items() if not k.startswith("opt/")})
    for key, value in metrics.items():
        if "/grad/" in key:
            result[f"grad/{seed}/{key.split('/grad/', 1)[1]}"] = np.asarray(value)
        elif key.startswith("loss/"):
            result[f"loss/{seed}/{key[5:]}"] = np.asarray(value)
    print(f"official seed {seed}: loss terms {sorted(k[5:] for k in metrics if k.startswith('loss/'))}", flush=True)
np.savez(out, **result)
os._exit(0)  # the official prefetch threads are not daemons
'''

GROUPS = (("encoder", "wm.encoder."), ("dynamics", "wm.rssm."), ("decoder", "wm.heads.decoder."),
          ("reward", "wm.heads.reward."), ("continue", "wm.heads.cont."), ("actor", "task_behavior.actor."),
          ("critic", "task_behavior.critic."))
class SameWeightsError(ValueError):
    """A user mistake: one line, exit status 2."""


def official_names(agent, config):
    """{project parameter name: (official name, how)}: how is 'linear' (a kernel, transposed), 'bias', 'scale',
    'block' (a block-diagonal kernel, as stored) or a permutation of the kernel's input rows."""
    rssm = agent.wm.rssm
    deter, stoch = rssm.deter, rssm.feat_size - rssm.deter
    # The heads read [deter, stoch], the decoder [stoch, deter]; this project's feature is [stoch, deter].
    heads_order = np.concatenate([np.arange(stoch) + deter, np.arange(deter)])
    encoder = agent.wm.encoder
    offsets, start = {}, 0
    for key in sorted(encoder.mlp_shapes):  # the official encoder concatenates the keys sorted
        offsets[key] = start
        start += int(np.prod(encoder.mlp_shapes[key]))
    keys_order = np.concatenate([offsets[k] + np.arange(int(np.prod(s))) for k, s in encoder.mlp_shapes.items()])
    names = {}

    def dense(project, official_, rows=None):
        names[f"{project}.weight"] = (f"{official_}/kernel", "linear" if rows is None else rows)
        names[f"{project}.bias"] = (f"{official_}/bias", "bias")

    def mlp(project, official_, layers, rows):  # [linear, norm, act] per layer, as networks.MLP
        for i in range(layers):
            dense(f"{project}.net.{3 * i}", f"{official_}/linear{i}", rows if i == 0 else None)
            names[f"{project}.net.{3 * i + 1}.weight"] = (f"{official_}/norm{i}/scale", "scale")

    for i in range(config.encoder.mlp_layers):
        dense(f"wm.encoder.mlp.net.{3 * i}", f"enc/mlp{i}", keys_order if i == 0 else None)
        names[f"wm.encoder.mlp.net.{3 * i + 1}.weight"] = (f"enc/mlp{i}norm/scale", "scale")
    for part, index in (("deter_in", 0), ("stoch_in", 1), ("action_in", 2)):
        dense(f"wm.rssm.cell.{part}.0", f"dyn/dynin{index}")
        names[f"wm.rssm.cell.{part}.1.weight"] = (f"dyn/dynin{index}norm/scale", "scale")
    names["wm.rssm.cell.hidden.weight"] = ("dyn/dynhid0/kernel", "block")
    names["wm.rssm.cell.hidden.bias"] = ("dyn/dynhid0/bias", "bias")
    names["wm.rssm.cell.hidden_norm.weight"] = ("dyn/dynhid0norm/scale", "scale")
    names["wm.rssm.cell.gates.weight"] = ("dyn/dyngru/kernel", "block")
    names["wm.rssm.cell.gates.bias"] = ("dyn/dyngru/bias", "bias")
    for i in range(config.dyn_img_layers):
        dense(f"wm.rssm.img_out.{3 * i}", f"dyn/prior{i}")
        names[f"wm.rssm.img_out.{3 * i + 1}.weight"] = (f"dyn/prior{i}norm/scale", "scale")
    dense("wm.rssm.obs_out.0", "dyn/obs0")
    names["wm.rssm.obs_out.1.weight"] = ("dyn/obs0norm/scale", "scale")
    dense("wm.rssm.img_stats", "dyn/priorlogit")
    dense("wm.rssm.obs_stats", "dyn/obslogit")
    decoder = agent.wm.heads["decoder"]
    mlp("wm.heads.decoder.mlp", "dec/mlp", config.decoder.mlp_layers, None)
    for index, key in enumerate(decoder.mlp_shapes):
        dense(f"wm.heads.decoder.mlp_out.parts.{index}", f"dec/vec/{key}/pred")
    mlp("wm.heads.reward.mlp", "rew/mlp", config.reward_head.layers, heads_order)
    dense("wm.heads.reward.out", "rew/head/logits")
    mlp("wm.heads.cont.mlp", "con/mlp", config.cont_head.layers, heads_order)
    dense("wm.heads.cont.out", "con/head/logit")
    mlp("task_behavior.actor.mlp", "pol/mlp", config.actor.layers, heads_order)
    dense("task_behavior.actor.out.parts.0", "pol/head/action/mean")
    dense("task_behavior.actor.out.parts.1", "pol/head/action/stddev")
    for project, official_ in (("critic", "val"), ("slow_critic", "slowval")):
        mlp(f"task_behavior.{project}.mlp", f"{official_}/mlp", config.critic.layers, heads_order)
        dense(f"task_behavior.{project}.out", f"{official_}/head/logits")
    names["task_behavior.return_norm.low"] = ("retnorm/lo/value", "scale")
    names["task_behavior.return_norm.high"] = ("retnorm/hi/value", "scale")
    return names


def to_project(value, how):
    """An official array (a parameter or its gradient) in the project's layout."""
    value = np.asarray(value, np.float64)
    if isinstance(how, np.ndarray):  # input rows reordered into the project's input order, then transposed
        return value[how].T
    return value.T if how == "linear" else value


def load_official(agent, config, params):
    """Load the official parameters {name: array} into the agent; every tensor must be covered."""
    import torch

    names = official_names(agent, config)
    state = agent.state_dict()
    uncovered = sorted(set(state) - set(names) - {"task_behavior.updates"})
    if uncovered:
        raise SameWeightsError(f"no official parameter for {', '.join(uncovered[:4])}: only the 2024 recipe's "
                               "vector-observation networks are mapped")
    for name, (source, how) in names.items():
        value = to_project(params[source], how)
        if tuple(value.shape) != tuple(state[name].shape):
            raise SameWeightsError(f"{source} {value.shape} does not fit {name} {tuple(state[name].shape)}: "
                                   "the command's settings differ from the run's")
        state[name] = torch.as_tensor(value, dtype=state[name].dtype)
    agent.load_state_dict(state)
    return names


def project_batch(windows, context):
    """The official windows (B, K + T, ...) as this project's batch of T steps and the start latent: the
    official code stores with each step the action taken there, this project the action that led to it."""
    import torch

    assert context == 1, context
    batch = {k: windows[k][:, context:] for k in ("reward", "is_first", "is_last", "is_terminal")}
    batch.update({k: v[:, context:] for k, v in windows.items() if k not in batch and "/" not in k
                  and k not in ("action", "consec", "stepid")})
    batch["action"] = windows["action"][:, context - 1:-1]
    start = {"deter": torch.as_tensor(windows["dyn/deter"][:, context - 1]),
             "stoch": torch.as_tensor(windows["dyn/stoch"][:, context - 1])}
    return batch, start


def project_losses(agent, batch, start):
    """The loss terms {term: (B, T) or (B, T-1)} of models.Update.train_step under update 'joint'."""
    import models

    wm = agent.wm
    data = wm.preprocess(batch)
    losses, post, _, _ = wm.loss(data, start)
    terms, _ = models.behavior_losses(agent.task_behavior, post, data, bool(agent.config.critic.repval),
                                      replay_graph=True)
    losses.update(terms)
    return losses


def project_side(agent, batch, start, seeds):
    """Per seed: the loss terms' means and every parameter's gradient, from the same weights each time."""
    import torch

    import models

    weights = {k: v.clone() for k, v in agent.state_dict().items()}
    terms, grads = [], []
    params = dict(agent.named_parameters())
    for seed in range(seeds):
        agent.load_state_dict(weights)  # the return normaliser's statistics move with every loss
        agent.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        losses = project_losses(agent, batch, start)
        models.scaled_sum(losses, agent.wm.scales).backward()
        terms.append({k: float(v.detach().mean()) for k, v in losses.items()})
        grads.append({k: (p.grad.double().numpy() if p.grad is not None else np.zeros(tuple(p.shape)))
                      for k, p in params.items()})
    return terms, grads


def optimizer_step(agent, names, saved):
    """One step of this project's joint optimizer from the official optimizer's state (LaProp's nu and mu,
    the step count) with the official seed-0 gradients, then the slow critic's; per network the relative
    difference between the two codes' parameter changes, ||d_project - d_official|| / ||d_official||."""
    import torch

    joint = agent.update.optimizers["joint"][0].opt
    joint.init_state()
    params = dict(agent.named_parameters())
    before = {k: p.detach().double().numpy().copy() for k, p in params.items()}
    count = int(saved["param/opt/state/1/0"])
    assert count == int(saved["param/opt/state/2/0"]) == int(saved["param/opt/state/3/count"]), "counts differ"
    with torch.no_grad():
        for name, (source, how) in names.items():
            if name not in params or "slow_critic" in name:
                continue
            param, state = params[name], joint.state[params[name]]
            state["nu"].copy_(torch.as_tensor(to_project(saved[f"param/opt/state/1/1/{source}"], how)))
            state["mu"].copy_(torch.as_tensor(to_project(saved[f"param/opt/state/2/1/{source}"], how)))
            param.grad = torch.as_tensor(to_project(saved[f"grad/0/{source}"], how), dtype=param.dtype)
        joint.updates.fill_(count)
        joint.step()
        agent.task_behavior.update_slow_critic()
    rows = []
    for group, prefix in (*GROUPS, ("slow critic", "task_behavior.slow_critic.")):
        keys = sorted(k for k in params if k.startswith(prefix))
        ours = np.concatenate([(params[k].detach().double().numpy() - before[k]).ravel() for k in keys])
        theirs = np.concatenate([(to_project(saved[f"after/{names[k][0]}"], names[k][1]) - before[k]).ravel()
                                 for k in keys])
        rows.append({"group": group, "official_change": float(np.linalg.norm(theirs)),
                     "difference": float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))})
    return count, rows


def cosine(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else float("nan")


def compare(official_grads, project_grads):
    """Per group: the two codes' per-seed gradients (lists of {name: array}) reduced to the table's figures."""
    rows = []
    for group, prefix in GROUPS:
        keys = sorted(k for k in project_grads[0] if k.startswith(prefix))
        off, pro = (np.stack([np.concatenate([g[k].ravel() for k in keys]) for g in grads])
                    for grads in (official_grads, project_grads))
        half = lambda x: cosine(x[0::2].mean(0), x[1::2].mean(0))  # noqa: E731
        cross, halves = cosine(off.mean(0), pro.mean(0)), (half(off), half(pro))
        rows.append({"group": group, "official_norm": float(np.linalg.norm(off, axis=1).mean()),
                     "project_norm": float(np.linalg.norm(pro, axis=1).mean()),
                     "official_mean_norm": float(np.linalg.norm(off.mean(0))),
                     "project_mean_norm": float(np.linalg.norm(pro.mean(0))), "cosine": cross,
                     "official_halves": halves[0], "project_halves": halves[1],
                     "verdict": "AGREES" if cross >= min(halves) else "DIFFERS"})
    return rows


def report(official_terms, project_terms, rows, seeds, command, step=None):
    se = lambda xs: np.std(xs, ddof=1) / np.sqrt(len(xs)) if len(xs) > 1 else float("nan")  # noqa: E731
    lines = ["# Same weights, same batch: the official code and this project", "", f"`{command}`", "",
             f"{seeds} seeds per code. Loss terms (mean over seeds ± standard error):", "",
             "| term | official | project |", "|---|---|---|"]
    for term in project_terms[0]:
        off = [t[term] for t in official_terms if term in t]  # the two codes name the terms alike
        pro = [t[term] for t in project_terms]
        shown = f"{np.mean(off):.4f} ± {se(off):.4f}" if off else "(not logged)"
        lines.append(f"| {term} | {shown} | {np.mean(pro):.4f} ± {se(pro):.4f} |")
    lines += ["", "Gradients per network: mean norm per seed, norm of the mean over seeds, the cosine between the "
              "two codes' mean gradients, and each code's cosine between the means of its even and odd seeds.", "",
              "| network | E‖g‖ official | E‖g‖ project | ‖Eg‖ official | ‖Eg‖ project | cos codes | "
              "cos halves official | cos halves project | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['official_norm']:.4g} | {r['project_norm']:.4g} | "
                     f"{r['official_mean_norm']:.4g} | {r['project_mean_norm']:.4g} | {r['cosine']:.3f} | "
                     f"{r['official_halves']:.3f} | {r['project_halves']:.3f} | {r['verdict']} |")
    if step is not None:
        count, changes = step
        lines += ["", f"One optimizer step from the checkpoint's optimizer state (step {count}) on the official "
                  "seed-0 gradients, then the slow critic's: the official change of each network's parameters "
                  "and how far this project's change lies from it, relative.", "",
                  "| network | ‖Δ‖ official | ‖Δ project − Δ official‖ / ‖Δ official‖ |", "|---|---|---|"]
        lines += [f"| {r['group']} | {r['official_change']:.4g} | {r['difference']:.2g} |" for r in changes]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="same_weights.py --official DIR --python PY [--seeds N] "
                                           "[--windows-seed N] [--out FILE] [--dry-run] DREAMER_FLAGS...")
    official.add_checkout_arguments(parser)
    parser.add_argument("--seeds", type=int, default=32, help="updates per code, one per seed")
    parser.add_argument("--windows-seed", type=int, default=0, help="draws the batch from the run's replay")
    parser.add_argument("--out", type=pathlib.Path, help="the report (default LOGDIR/same_weights.md)")
    parser.add_argument("--dry-run", action="store_true", help="print the official side's command, run nothing")
    return parser.parse_known_args(argv)


def settle(args, rest):
    """(config, official logdir) of the command, checked."""
    if args.seeds < 2:
        raise SameWeightsError(f"--seeds {args.seeds}: give at least 2 (the table compares halves of them)")
    try:
        config, _, _ = official.settle(rest)
    except official.OfficialError as e:
        raise SameWeightsError(str(e)) from None
    if not config.logdir:
        raise SameWeightsError("Missing --logdir: the LOGDIR of an official run made by benchmarks/official.py")
    if config.replay_context != 1:
        raise SameWeightsError(f"--replay_context {config.replay_context}: the tool maps replay_context 1 only")
    if config.device != "cpu":
        raise SameWeightsError(f"--device {config.device}: the tool runs both codes on the cpu")
    rundir = pathlib.Path(config.logdir).expanduser().resolve() / "official"
    if not args.dry_run:
        if args.official is None or not (args.official / "dreamerv3" / "main.py").is_file():
            raise SameWeightsError(f"--official {args.official}: no dreamerv3/main.py there")
        if not (rundir / "ckpt" / "latest").is_file() or not list((rundir / "replay").glob("*.npz")):
            raise SameWeightsError(f"--logdir {config.logdir}: no official checkpoint and replay under {rundir}")
    return config, rundir


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config, rundir = settle(args, rest)
    except SameWeightsError as e:
        print(f"same_weights.py: {e}", file=sys.stderr)
        return 2
    env = official.environment(1, rundir.parent, "cpu")  # one thread; the run's own jit cache
    root = str(args.official.resolve()) if args.official else "<official>"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "official.npz"
        command = [args.python, "-c", OFFICIAL_SIDE, root, str(rundir), str(args.seeds), str(args.windows_seed),
                   str(out)]
        if args.dry_run:
            print(" ".join([args.python, "-c", "<official side>", *command[3:-1], "<output>"]))
            return 0
        code = subprocess.call(command, env=env, cwd=root)
        if code != 0:
            print(f"same_weights.py: the official side exited with {code}", file=sys.stderr)
            return 1
        saved = dict(np.load(out))
    return project_and_report(args, rest, config, saved)


def project_and_report(args, rest, config, saved):
    """The project side on the official side's output, then the report."""
    import torch

    import compilation
    import dreamer
    import envs

    torch.set_num_threads(1)
    env = envs.make_env(config, "train", 0)
    config, _ = compilation.resolve_auto(config, env.act_space, env.obs_space)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config)
    env.close()
    if agent.wm.encoder.cnn_shapes:
        print("same_weights.py: image observations: only the vector networks are mapped", file=sys.stderr)
        return 2
    try:
        names = load_official(agent, config, {k[6:]: v for k, v in saved.items() if k.startswith("param/")})
    except SameWeightsError as e:
        print(f"same_weights.py: {e}", file=sys.stderr)
        return 2
    windows = {k[7:]: v for k, v in saved.items() if k.startswith("window/")}
    batch, start = project_batch(windows, config.replay_context)
    project_terms, project_grads = project_side(agent, batch, start, args.seeds)
    official_terms = [{k.split("/")[2]: float(v) for k, v in saved.items() if k.startswith(f"loss/{s}/")}
                      for s in range(args.seeds)]
    trained = {k: v for k, v in names.items() if "slow_critic" not in k and "return_norm" not in k}
    official_grads = [{k: to_project(saved[f"grad/{s}/{source}"], how) for k, (source, how) in trained.items()}
                      for s in range(args.seeds)]
    rows = compare(official_grads, [{k: g[k] for k in trained} for g in project_grads])
    load_official(agent, config, {k[6:]: v for k, v in saved.items() if k.startswith("param/")})
    step = optimizer_step(agent, names, saved)
    text = report(official_terms, project_terms, rows, args.seeds, "python3 benchmarks/same_weights.py "
                  + " ".join(sys.argv[1:]), step)
    out = args.out or pathlib.Path(config.logdir).expanduser() / "same_weights.md"
    import storage

    storage.atomic_write_bytes(out, text.encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
