"""Does a change that should not change behaviour keep every number? A digest of two fixed-seed runs.

    python3 benchmarks/refactor_check.py --out ./logdir/check_before --root ../checkout_before
    python3 benchmarks/refactor_check.py --out ./logdir/check_after
    python3 benchmarks/refactor_check.py --compare ./logdir/check_before/digest.json ./logdir/check_after/digest.json

Trains the paper's recipe (v1) and the official code's 2024 recipe at size1m on dmc_cartpole_balance, one
environment, one thread, `--deterministic_run True`, seed 0, for 300 updates each (train ratio 256, batch 16 x 32,
so the runs take a few minutes on a CPU), with the `dreamer.py` of `--root` (this checkout by default). The digest
(`OUT/digest.json`) holds, per recipe, the update count, a SHA-256 of every tensor of the final checkpoint (weights,
optimizer moments, return normalisation, slow critic), of every stored episode's arrays, and every logged loss and
metric exactly (as the float the run wrote). `--compare A B` prints what differs and exits 1 if anything does (0
when the two are bitwise equal); `--rename old=new,...` maps metric names that a change renamed on purpose (the
values must still be equal).
"""

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMON = ("--task dmc_cartpole_balance --envs 1 --train_ratio 256 --batch_size 16 --batch_length 32 "
          "--eval_episode_num 0 --log_every 200 --device cpu --deterministic_run True --seed 0 --compile False").split()
# Frames that give 300 updates: v1 prefills 2,500 frames at random and pretrains 100 updates, then one update per
# two environment steps; recipe2024 acts until the replay holds one batch (512 steps), one update, then the same.
RECIPES = {
    "v1": ["--configs", "dmc_proprio", "size1m", "--steps", "3300"],
    "recipe2024": ["--configs", "dmc_proprio", "recipe2024", "size1m", "--steps", "2222"],
}


def sha(array):
    array = np.ascontiguousarray(array)
    return hashlib.sha256(str(array.dtype).encode() + str(array.shape).encode() + array.tobytes()).hexdigest()[:16]


def tensor_hashes(tree, prefix=""):
    import torch

    out = {}
    if isinstance(tree, torch.Tensor):
        tree = tree.detach().cpu()
        out[prefix] = sha((tree.float() if tree.dtype == torch.bfloat16 else tree).numpy())
    elif isinstance(tree, np.ndarray):
        out[prefix] = sha(tree)
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            out.update(tensor_hashes(tree[key], f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(tensor_hashes(value, f"{prefix}/{i}"))
    return out


def digest(logdir):
    import torch

    state = torch.load(logdir / "latest.pt", map_location="cpu", weights_only=False)
    weights = tensor_hashes({"agent": state["agent"], "optimizers": state["optimizers"]})
    episodes = {}
    # Named by their order and length: a file's name also holds the time it was written and a random id.
    for index, path in enumerate(sorted((logdir / "train_eps").rglob("*.npz"))):
        with np.load(path) as data:
            episodes[f"{index}-{path.stem.rsplit('-', 1)[-1]}"] = {key: sha(data[key]) for key in sorted(data.files)}
    metrics = []
    for line in (logdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics.append({k: v for k, v in row.items() if not k.startswith(("perf/", "env/", "time"))
                        and "fps" not in k and "seconds" not in k and "_ms" not in k})
    return {"updates": int(state["counters"]["updates"]), "tensors": weights, "episodes": episodes, "metrics": metrics}


def run(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("MUJOCO_GL", "egl")
    result = {}
    for name, flags in RECIPES.items():
        logdir = args.out / name
        if logdir.exists():
            raise SystemExit(f"refactor_check.py: {logdir} exists; give an empty --out")
        argv = [sys.executable, str(args.root / "dreamer.py"), *flags, *COMMON, "--logdir", str(logdir)]
        print("running:", " ".join(argv), flush=True)
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        result[name] = digest(logdir)
        print(f"{name}: {result[name]['updates']} updates, {len(result[name]['tensors'])} tensors, "
              f"{len(result[name]['episodes'])} episode files, {len(result[name]['metrics'])} log rows", flush=True)
    (args.out / "digest.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"wrote {args.out / 'digest.json'}")
    return 0


def compare(a_path, b_path, rename):
    a, b = (json.loads(pathlib.Path(p).read_text()) for p in (a_path, b_path))
    differences = []
    for recipe in sorted(set(a) | set(b)):
        if recipe not in a or recipe not in b:
            differences.append(f"{recipe}: only in one digest")
            continue
        x, y = a[recipe], b[recipe]
        if x["updates"] != y["updates"]:
            differences.append(f"{recipe}: updates {x['updates']} vs {y['updates']}")
        for part in ("tensors", "episodes"):
            for key in sorted(set(x[part]) | set(y[part])):
                if x[part].get(key) != y[part].get(key):
                    differences.append(f"{recipe}: {part} {key}: {x[part].get(key)} vs {y[part].get(key)}")
        if len(x["metrics"]) != len(y["metrics"]):
            differences.append(f"{recipe}: {len(x['metrics'])} vs {len(y['metrics'])} log rows")
        for i, (row_x, row_y) in enumerate(zip(x["metrics"], y["metrics"])):
            row_x = {rename.get(k, k): v for k, v in row_x.items()}
            for key in sorted(set(row_x) | set(row_y)):
                if row_x.get(key) != row_y.get(key):
                    differences.append(f"{recipe}: log row {i} {key}: {row_x.get(key)} vs {row_y.get(key)}")
        counts = {part: len(x[part]) for part in ("tensors", "episodes")}
        print(f"{recipe}: {x['updates']} updates, {counts['tensors']} tensors, {counts['episodes']} episode files, "
              f"{len(x['metrics'])} log rows compared")
    for line in differences[:50]:
        print("DIFFERS:", line)
    if len(differences) > 50:
        print(f"... and {len(differences) - 50} more")
    print("bitwise equal" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="an empty folder for the two runs and digest.json")
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help="the checkout whose dreamer.py runs")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two digest.json files")
    parser.add_argument("--rename", default="", help="old=new metric names, comma-separated (for --compare)")
    args = parser.parse_args(argv)
    if args.compare:
        try:
            rename = dict(pair.split("=", 1) for pair in args.rename.split(",") if pair)
        except ValueError:
            print(f"refactor_check.py: --rename {args.rename}: give old=new pairs, comma-separated", file=sys.stderr)
            return 2
        return compare(*args.compare, rename)
    if args.out is None:
        print("refactor_check.py: give --out DIR (to run) or --compare A B", file=sys.stderr)
        return 2
    if not (args.root / "dreamer.py").is_file():
        print(f"refactor_check.py: --root {args.root}: no dreamer.py there", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
