"""The bad-input battery of issue 54 for dreamer.py, configs.yaml and the environment: each input
is tried as a new user would, and a markdown table says what came of it.

    python3 benchmarks/bad_inputs.py [--only NAME ...] [--list]

Each case runs `python3 dreamer.py ...` in a fresh copy of this checkout's sources (so that an
edited configs.yaml never touches the checkout) with its logdir in that copy, and reports the exit
code, the lines printed (stdout and stderr) and the files written there. The promise it checks
(README, Troubleshooting): an input is done as asked, or refused in one line with exit 2 and
nothing written; never a traceback. `expected` says which of the two the case asks for; `ok` is
whether it held. The script exits 1 when a case does not hold, 2 on its own bad arguments.

Items 1, 2 and 4-7 of the issue are here; 3 (the frame count on resume) needs training runs and is
tested in tests/test_faults.py, 8-10 concern the benchmark scripts and are tested with them.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A run short enough for a battery: the debug preset's model, 100 frames, no evaluation.
SHORT = ["--configs", "debug", "--steps", "100", "--eval_episode_num", "0"]


def edit(old, new):
    """A configs.yaml edit: `old` (which must occur) replaced once by `new`."""
    def apply(text):
        if old not in text:
            raise SystemExit(f"error: configs.yaml no longer holds {old!r}; update the battery")
        return text.replace(old, new, 1)
    return apply


def cut_defaults(text):
    """configs.yaml cut short at the line before `--- training ---`: the later keys and all presets lost."""
    lines = text.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if "# --- training ---" in line)
    return "".join(lines[:end])


# name: (issue item, arguments, configs.yaml edit or None, extra environment, setup(copy) or None,
#        expected: "refused" (exit 2, one line, nothing written) or "done" (exit 0, no traceback),
#        what the output must contain)
CASES = {
    "repeated --configs": ("1", ["--configs", "debug", "--configs", "recipe2024", "--print_config"], None, {}, None,
                           "done", "batch_size: 10"),
    "misspelt key in a preset": ("2", ["--logdir", "run", *SHORT], edit("  batch_size: 10\n", "  batchsize: 10\n"),
                                 {}, None, "refused", "closest valid: batch_size"),
    "tab-indented key": ("4", ["--logdir", "run", *SHORT], edit("  batch_size: 10\n", "\tbatch_size: 10\n"), {},
                         None, "refused", "configs.yaml:"),
    "no space after a colon": ("4", ["--logdir", "run", *SHORT], edit("  batch_size: 10\n", "  batch_size:10\n"),
                               {}, None, "refused", "configs.yaml:"),
    "duplicate key": ("4", ["--logdir", "run", *SHORT],
                      edit("  batch_size: 10\n", "  batch_size: 10\n  batch_size: 12\n"), {}, None, "refused",
                      "duplicate key 'batch_size'"),
    "empty configs.yaml": ("4", ["--logdir", "run", *SHORT], lambda text: "", {}, None, "refused",
                           "configs.yaml:1:"),
    "discount: high": ("4", ["--logdir", "run", *SHORT], edit("  discount: 0.997 ", "  discount: high "), {}, None,
                       "refused", "--discount"),
    "mine: 5": ("4", ["--logdir", "run", *SHORT], lambda text: text + "\nmine: 5\n", {}, None, "refused",
                "preset 'mine'"),
    "missing configs.yaml": ("4", ["--logdir", "run", *SHORT], lambda text: None, {}, None, "refused",
                             "not found"),
    "defaults cut short": ("4", ["--logdir", "run", *SHORT], cut_defaults, {}, None, "refused", "defaults lacks"),
    "MUJOCO_GL=osmesa without libOSMesa": ("5", ["--logdir", "run", *SHORT], None, {"MUJOCO_GL": "osmesa"}, None,
                                           "refused", "MUJOCO_GL"),
    "MUJOCO_GL=nonsense": ("5", ["--logdir", "run", *SHORT], None, {"MUJOCO_GL": "nonsense"}, None, "refused",
                           "valid: egl"),
    "--steps 1e30": ("6", ["--logdir", "run", "--configs", "debug", "--steps", "1e30"], None, {}, None, "refused",
                     "--steps"),
    "symlink loop as --logdir": ("7", ["--logdir", "loop", *SHORT], None, {},
                                 lambda copy: (copy / "loop").symlink_to(copy / "loop"), "refused", "--logdir"),
    "non-ASCII logdir, ASCII stdout": ("7", ["--logdir", "r\u00e9sum\u00e9", *SHORT], None,
                                       {"PYTHONIOENCODING": "ascii"}, None, "done", "Logdir"),
    "--help debug": ("14", ["--help", "debug"], None, {}, None, "done", "--batch_size 10"),
}


def copy_checkout(target):
    """This checkout's sources (no logdirs, tests or caches), in `target`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", "logdir*", "tests", "benchmarks", "*.md")
    for path in ROOT.iterdir():
        if path.is_dir() and path.name == "envs":
            shutil.copytree(path, target / path.name, ignore=ignore)
        elif path.is_file() and (path.suffix in (".py", ".yaml")):
            shutil.copy2(path, target / path.name)


def listing(folder):
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_symlink() and p.is_file()}


def run(name, timeout):
    item, args, yaml_edit, extra_env, setup, expected, wanted = CASES[name]
    with tempfile.TemporaryDirectory(prefix="bad_inputs_") as folder:
        copy = pathlib.Path(folder)
        copy_checkout(copy)
        if yaml_edit is not None:
            text = yaml_edit((copy / "configs.yaml").read_text())
            if text is None:
                (copy / "configs.yaml").unlink()
            else:
                (copy / "configs.yaml").write_text(text)
        if setup is not None:
            setup(copy)
        before = listing(copy)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
                   **extra_env)
        if "MUJOCO_GL" not in extra_env:
            env.setdefault("MUJOCO_GL", "egl")
        try:
            result = subprocess.run([sys.executable, "dreamer.py", *args], cwd=copy, env=env, capture_output=True,
                                    timeout=timeout)
            code = result.returncode
            out = (result.stdout + result.stderr).decode("utf-8", "backslashreplace")
        except subprocess.TimeoutExpired:
            code, out = "timeout", ""
        written = sorted(listing(copy) - before)
    lines = out.strip().splitlines()
    traceback = "Traceback" in out
    if expected == "refused":
        ok = code == 2 and len(lines) == 1 and not written and wanted in out and not traceback
    else:
        ok = code == 0 and wanted in out and not traceback
    first = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    return {"item": item, "input": name, "expected": expected, "exit": code, "lines": len(lines),
            "written": len(written), "ok": ok, "says": first}


def main(argv=None):
    parser = argparse.ArgumentParser(description="The bad-input battery of issue 54 for dreamer.py.")
    parser.add_argument("--only", nargs="+", default=None, help="case names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    unknown = [name for name in args.only or [] if name not in CASES]
    if unknown:
        print(f"error: unknown case '{unknown[0]}'; valid: {', '.join(CASES)}", file=sys.stderr)
        return 2
    rows = [run(name, args.timeout) for name in args.only or CASES]
    print("| item | input | expected | exit | lines | written | ok | first error line (or first line) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        says = row["says"].replace("|", "\\|")[:150]
        print(f"| {row['item']} | {row['input']} | {row['expected']} | {row['exit']} | {row['lines']} | "
              f"{row['written']} | {'yes' if row['ok'] else 'NO'} | {says} |")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
