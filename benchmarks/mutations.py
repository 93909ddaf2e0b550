"""Mutation battery: does a test that compares the product with an independent reference fail when the
learner is broken?

    python3 benchmarks/mutations.py [--list] [--only critic_no_grad,entropy_sign] [--pytest-args "-k train"] \\
        [--keep] [--out FILE] [--jobs N] [--fast-tier]

Each mutation (MUTATIONS below) is a small, named source change that models a slip a researcher could
make: one or more edits, each an exact old text of a file (relative to the repository root) and the
text that replaces it, and `caught_by`, the reference tests that must catch it (pytest node ids; for the update's
slips the tests of tests/test_reference.py, which compare one update of each recipe with tests/reference.py, the
update written out with no product helper). Every run makes a fresh copy of the repository's files (as .ci/run
selects them: `git ls-files -z -co --exclude-standard`, tracked files deleted in the working tree skipped) as the
only entry of an empty temporary folder, applies the mutation there (never in the checkout) and runs its
reference tests there, all of them, in the fast tier:

    python3 -m pytest -q -m "not slow" -p no:cacheprovider TESTS

(with the interpreter that runs the battery; a named test that is slow is deselected, no test runs, and the
mutation is an ERROR: the reference tests must be fast). `--fast-tier` runs the whole fast tier instead, as the
battery did before the reference tests existed:

    python3 -m pytest -q -m "not slow" -x -p no:cacheprovider --ignore=tests/test_mutations.py

(`-x`: it stops at the first failing test; the battery's own tests are left out: one of them, in the slow tier,
checks that every mutation's old text occurs in the checkout, which a mutated copy fails by construction).
`--pytest-args` adds arguments, `--pytest-args=-x` for one that starts with a dash and has no space. The
environment is the caller's, with OMP_NUM_THREADS=1 and MUJOCO_GL=egl unless set. The first failing test and its
failure line are read from pytest's JUnit XML report (`--junitxml`, xunit1, written outside the copy), not from
its terminal output.

The clean copy (no mutation) runs first, with the reference tests of every mutation run (or the fast tier),
and must pass: if it fails, the battery says so and stops (exit 1). Then each mutation is reported as `caught` (a
test failed or errored: its id and failure line), `caught (collection error)` (the copy does not even import or
collect: weak, since any syntax slip would do the same; a mutation should be a behaviour change that still
imports), `ESCAPED` (every test run passed) or `ERROR` (pytest did not run tests to a verdict: a usage error, no tests,
a crash; counted as not caught). The last line gives the totals and the seconds of the whole battery.
`--jobs N` runs N mutations at once (after the clean copy, which runs alone), each pytest process at one
thread; the report keeps the table's order. `--out FILE` also writes the report as a markdown table;
`--keep` keeps the copies, the logs and the XML reports (and prints where).

Exit status: 0 when the clean copy passed and every mutation run was caught, 1 otherwise. Mistakes
(an unknown --only name, a bad flag, a checkout that git does not know, a mutation whose old text
does not occur exactly once in its file: a rename in the product, which the battery must not pass
over silently) are one line on stderr and exit status 2, before anything runs.

The table is Python rather than a mutations.json beside the script: the edits are several lines of
code with quotes, which triple-quoted strings keep readable and diffable, and the runner's tests read
it by importing the module. Its functions take the table and the repository root as parameters, so
that tests/test_mutations.py checks the mechanics on a stand-in repository.
"""

import argparse
import concurrent.futures
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# ==================================================================================================
# The mutations: name, the slip it models, and its edits (file, exact old text, new text)
# ==================================================================================================

# critic_no_grad and actor_no_grad leave every parameter of that network without a gradient: under v1
# (update sequential, grad_clip 100) ClippedOptimizer.step then clips an empty gradient list and raises
# ("Tensor list must have at least one tensor"), so v1 catches them by a crash; under recipe2024 (one
# joint optimizer, AGC over the parameters with a gradient) they run silently.
MUTATIONS = [
    {
        "name": "critic_no_grad",
        "caught_by": ["tests/test_reference.py::test_every_gradient_equals_the_reference"],
        "slip": "the critic's one regression runs under torch.no_grad (the decorator copied from "
                "update_slow_critic): neither its imagined-return loss nor repval trains it",
        "edits": [{"file": "models.py",
                   "old": "    def regress(self, dist, feat, returns):\n",
                   "new": "    @torch.no_grad()\n    def regress(self, dist, feat, returns):\n"}],
    },
    {
        "name": "actor_no_grad",
        "caught_by": ["tests/test_reference.py::test_every_gradient_equals_the_reference"],
        "slip": "the rollout detaches the actor's outputs instead of its input features: no loss "
                "(dynamics, REINFORCE or entropy) sends the actor a gradient",
        "edits": [{"file": "models.py",
                   "old": "    out = actor.raw(feat.detach())\n",
                   "new": "    out = actor.raw(feat).detach()\n"}],
    },
    {
        "name": "decoder_frozen",
        "caught_by": [
            "tests/test_reference.py::test_every_gradient_equals_the_reference",
            "tests/test_reference.py::test_every_parameter_after_the_update_equals_the_reference",
        ],
        "slip": "the decoder's parameters are left out of the world model's optimizer (sequential) and "
                "the joint one; its loss is still computed and still trains the representation",
        "edits": [
            {"file": "models.py",
             "old": '    model = optim.Optimizer("model", world_model.parameters(), config.model_lr,',
             "new": '    model = optim.Optimizer("model", [p for n, p in world_model.named_parameters() '
                    'if not n.startswith("heads.decoder.")], config.model_lr,'},
            {"file": "models.py",
             "old": "params = [*world_model.parameters(), *behavior.actor.parameters(),",
             "new": "params = [*(p for n, p in world_model.named_parameters() if not n.startswith(\"heads.decoder.\")),"
                    "\n              *behavior.actor.parameters(),"},
        ],
    },
    {
        "name": "reward_head_frozen",
        "caught_by": ["tests/test_reference.py::test_every_parameter_after_the_update_equals_the_reference"],
        "slip": "the reward head is built with requires_grad off (a probe's freeze left in): every "
                "optimizer drops it; its loss is still computed",
        "edits": [{"file": "models.py",
                   "old": "        networks.reinit(self, config.winit)\n",
                   "new": "        networks.reinit(self, config.winit)\n"
                          "        self.heads[\"reward\"].requires_grad_(False)\n"}],
    },
    {
        "name": "continue_head_frozen",
        "caught_by": ["tests/test_reference.py::test_every_parameter_after_the_update_equals_the_reference"],
        "slip": "the continue head is built with requires_grad off (a probe's freeze left in): every "
                "optimizer drops it; its loss is still computed",
        "edits": [{"file": "models.py",
                   "old": "        networks.reinit(self, config.winit)\n",
                   "new": "        networks.reinit(self, config.winit)\n"
                          "        self.heads[\"cont\"].requires_grad_(False)\n"}],
    },
    {
        "name": "kl_dropped",
        "caught_by": ["tests/test_reference.py::test_every_gradient_equals_the_reference"],
        "slip": "the KL terms come back detached (the stop-gradient put on the whole term, not one side): "
                "dyn and rep are computed and logged but train nothing",
        "edits": [{"file": "networks.py",
                   "old": "return torch.clamp(raw_dyn, min=free), torch.clamp(raw_rep, min=free), raw_dyn, raw_rep",
                   "new": "return torch.clamp(raw_dyn, min=free).detach(), torch.clamp(raw_rep, min=free).detach(), "
                          "raw_dyn, raw_rep"}],
    },
    {
        "name": "return_norm_off",
        "caught_by": [
            "tests/test_reference.py::test_the_return_normalisation_and_the_slow_critic_after_the_update_equal_the_reference",
        ],
        "slip": "ReturnNorm updates copies of its EMAs (mul for mul_): they stay 0, so offset 0 and scale "
                "1 though reward_EMA is on",
        "edits": [{"file": "models.py",
                   "old": "        self.low.mul_(self.decay).add_((1 - self.decay) * q[0])\n"
                          "        self.high.mul_(self.decay).add_((1 - self.decay) * q[1])\n",
                   "new": "        self.low.mul(self.decay).add_((1 - self.decay) * q[0])\n"
                          "        self.high.mul(self.decay).add_((1 - self.decay) * q[1])\n"}],
    },
    {
        "name": "slow_critic_frozen",
        "caught_by": [
            "tests/test_reference.py::test_the_return_normalisation_and_the_slow_critic_after_the_update_equal_the_reference",
        ],
        "slip": "the slow critic's EMA fraction is chosen the wrong way round (torch.where's branches "
                "swapped): at slow_target_update 1 it is always 0 and the slow critic never moves",
        "edits": [{"file": "models.py",
                   "old": "config.slow_target_update == 0, config.slow_target_fraction, 0.0)",
                   "new": "config.slow_target_update == 0, 0.0, config.slow_target_fraction)"}],
    },
    {
        "name": "entropy_sign",
        "caught_by": ["tests/test_reference.py::test_every_loss_term_and_metric_equals_the_reference"],
        "slip": "the entropy bonus of the actor loss is added to the loss: a penalty",
        "edits": [{"file": "models.py",
                   "old": "        loss = loss - config.actor.entropy * entropy\n",
                   "new": "        loss = loss + config.actor.entropy * entropy\n"}],
    },
    {
        "name": "resume_no_optimizer",
        "caught_by": [
            "tests/test_learning.py::test_a_run_stopped_by_ctrl_c_and_resumed_holds_the_straight_runs_whole_state",
        ],
        "slip": "resuming restores everything but the optimizers' states (fresh moments and counts)",
        "edits": [{"file": "storage.py",
                   "old": "        changes = self.agent.load_optimizer_state(state[\"optimizers\"])\n",
                   "new": "        changes = []\n"}],
    },
    {
        "name": "replay_stuck",
        "caught_by": [
            "tests/test_learning.py::test_a_run_stopped_by_ctrl_c_and_resumed_holds_the_straight_runs_whole_state",
        ],
        "slip": "the prefetcher memoises its sample: the learner trains on the replay's first batch forever",
        "edits": [{"file": "storage.py",
                   "old": "    def sample(self):\n"
                          "        return self.replay.sample(self.batch, self.length, ids=True, alloc=self.host_array)",
                   "new": "    def sample(self):\n"
                          "        if not hasattr(self, \"first\"):\n"
                          "            self.first = self.replay.sample(self.batch, self.length, ids=True, "
                          "alloc=self.host_array)\n"
                          "        return self.first"}],
    },
    {
        "name": "latents_not_saved",
        "caught_by": [
            "tests/test_learning.py::test_a_run_stopped_by_ctrl_c_and_resumed_holds_the_straight_runs_whole_state",
        ],
        "slip": "the trainer no longer writes the training posteriors back into the replay "
                "(recipe2024's replay context keeps the collector's stale latents)",
        "edits": [{"file": "dreamer.py",
                   "old": "            context.write_back(self.feed, ids, latents)  # also into the batch sampled "
                          "ahead\n",
                   "new": ""}],
    },
    {
        "name": "latents_not_checkpointed",
        "caught_by": [
            "tests/test_learning.py::test_a_run_stopped_by_ctrl_c_and_resumed_holds_the_straight_runs_whole_state",
        ],
        "slip": "a resumed run leaves the checkpoint's replay state unread: the replay context starts again "
                "from the files' latents (the policy's) and the online queue from empty",
        "edits": [{"file": "storage.py",
                   "old": "        missed = self.replay.load_context_state(",
                   "new": "        missed = 0 and self.replay.load_context_state("}],
    },
    {
        "name": "agent_prefill_random",
        "caught_by": [
            "tests/test_learning.py::test_prefill_policy_chooses_who_acts_before_training_and_when_it_starts",
        ],
        "slip": "the official start (prefill_policy agent) collects with uniform random actions and zero "
                "latents, as the v1 prefill does",
        "edits": [{"file": "dreamer.py",
                   "old": 'PREFILLS = {"random": random_prefill, "agent": agent_prefill}',
                   "new": 'PREFILLS = {"random": random_prefill, "agent": random_prefill}'}],
    },
    {
        "name": "eval_fresh_weights",
        "caught_by": ["tests/test_learning.py::test_eval_only_scores_the_checkpoints_weights_not_a_fresh_agents"],
        "slip": "--eval_only evaluates the freshly built agent: the checkpoint's weights are never loaded",
        "edits": [{"file": "dreamer.py",
                   "old": "    agent.load_state_dict(state[\"agent\"])\n    episodes = parallel.run_episodes(",
                   "new": "    episodes = parallel.run_episodes("}],
    },
    {
        "name": "lambda_return_no_cont",
        "caught_by": ["tests/test_reference.py::test_every_loss_term_and_metric_equals_the_reference"],
        "slip": "the λ-return ignores the continuation flags: it bootstraps across episode ends "
                "(imagined and replayed returns)",
        "edits": [{"file": "models.py",
                   "old": "        last = reward[t] + discount * cont[t] * ((1 - lam) * value[t] + lam * last)\n",
                   "new": "        last = reward[t] + discount * ((1 - lam) * value[t] + lam * last)\n"}],
    },
    {
        "name": "advantage_unnormalised",
        "caught_by": ["tests/test_reference.py::test_every_loss_term_and_metric_equals_the_reference"],
        "slip": "the actor's advantage uses the raw returns and values: the normalisation is computed "
                "and logged (return_scale) but not applied",
        "edits": [{"file": "models.py",
                   "old": "        advantage = normed_returns - (base - offset) / scale\n",
                   "new": "        advantage = returns - base\n"}],
    },
    {
        "name": "grad_clip_discarded",
        "caught_by": ["tests/test_reference.py::test_every_gradient_equals_the_reference"],
        "slip": "gradient clipping computes the clipped gradients out of place and drops them "
                "(_foreach_mul for _foreach_mul_): neither the norm clip (v1) nor AGC (recipe2024) applies",
        "edits": [
            {"file": "optim.py",
             "old": "torch._foreach_mul_(grads, torch.clamp(self.clip / (self.grad_norm + 1e-6), max=1.0))",
             "new": "torch._foreach_mul(grads, torch.clamp(self.clip / (self.grad_norm + 1e-6), max=1.0))"},
            {"file": "optim.py",
             "old": "torch._foreach_mul_(grads, list(scale.unbind()))",
             "new": "torch._foreach_mul(grads, list(scale.unbind()))"},
        ],
    },
    {
        "name": "rssm_no_reset",
        "caught_by": [
            "tests/test_reference.py::test_every_loss_term_and_metric_equals_the_reference",
            "tests/test_reference.py::test_the_posterior_latents_equal_the_reference",
        ],
        "slip": "the RSSM's is_first reset zeroes the action but no longer resets the latent state: "
                "sequences carry the state across episode starts",
        "edits": [{"file": "networks.py",
                   "old": "        state = {k: v * keep.reshape(-1, *[1] * (v.dim() - 1)) + init[k] * (1 - keep)"
                          ".reshape(-1, *[1] * (v.dim() - 1))\n                 for k, v in state.items()}\n",
                   "new": ""}],
    },
]

OWN_TESTS = "tests/test_mutations.py"  # the battery's own tests, left out of every run (see the docstring)
PYTEST = ("-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider")
FAST_TIER = (*PYTEST, "-x", f"--ignore={OWN_TESTS}")
LINE = 160  # characters of a failure line in the report


class BatteryError(ValueError):
    """A mistake in the command or the table: one line, exit status 2."""


# ==================================================================================================
# The table and its edits
# ==================================================================================================


def check_table(table):
    """Every mutation has a unique name, a slip and edits of file, old and new text; returns the names."""
    names = []
    for index, mutation in enumerate(table):
        name = mutation.get("name") if isinstance(mutation, dict) else None
        if not isinstance(name, str) or not name.isidentifier():
            raise BatteryError(f"mutation #{index + 1}: its name {name!r} is not a word (letters, digits, _)")
        if name in names:
            raise BatteryError(f"mutation {name}: the name is taken by an earlier one")
        if not isinstance(mutation.get("slip"), str) or not mutation["slip"].strip():
            raise BatteryError(f"mutation {name}: no slip (a one-line description of the mistake it models)")
        edits = mutation.get("edits")
        if not isinstance(edits, (list, tuple)) or not edits:
            raise BatteryError(f"mutation {name}: no edits")
        for edit in edits:
            if not (isinstance(edit, dict) and all(isinstance(edit.get(k), str) for k in ("file", "old", "new"))):
                raise BatteryError(f"mutation {name}: an edit needs the strings file, old and new: {edit!r}")
            if not edit["old"] or edit["old"] == edit["new"]:
                raise BatteryError(f"mutation {name}: an edit of {edit['file']} has no old text or changes nothing")
        tests = mutation.get("caught_by")
        if not (isinstance(tests, (list, tuple)) and tests
                and all(isinstance(t, str) and t.startswith("tests/") and "::" in t for t in tests)):
            raise BatteryError(f"mutation {name}: caught_by must name its reference tests, "
                               f"tests/FILE.py::test_name: {tests!r}")
        names.append(name)
    return names


def select(table, only):
    """The mutations named in `only` (comma-separated; None or empty: all), in the table's order."""
    names = check_table(table)
    if not only:
        return list(table)
    wanted = [name for name in only.split(",") if name]
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise BatteryError(f"--only {','.join(unknown)}: no such mutation; valid: {', '.join(names)}")
    return [m for m in table if m["name"] in wanted]


def apply_edits(texts, mutation):
    """{file: text} -> {file: text} with the mutation's edits applied in order (`texts` is left as it
    is); an old text that does not occur exactly once in its file (as edited so far) is an error."""
    texts = dict(texts)
    for edit in mutation["edits"]:
        file = edit["file"]
        if file not in texts:
            raise BatteryError(f"mutation {mutation['name']}: {file} is not a file of the repository")
        count = texts[file].count(edit["old"])
        if count != 1:
            raise BatteryError(f"mutation {mutation['name']}: its old text occurs {count} times in {file}, "
                               f"not once: {shorten(edit['old'], 60)!r}")
        texts[file] = texts[file].replace(edit["old"], edit["new"])
    return texts


def edited_files(root, mutation):
    """{file: mutated text} of the files the mutation edits under `root`."""
    root = pathlib.Path(root)
    texts = {}
    for edit in mutation["edits"]:
        path = root / edit["file"]
        if edit["file"] not in texts and path.is_file():
            texts[edit["file"]] = path.read_text()
    return apply_edits(texts, mutation)


def check_applies(root, table):
    """Every mutation of `table` applies to the files under `root` (each edit's old text exactly once)."""
    for mutation in table:
        edited_files(root, mutation)


def shorten(text, keep=LINE):
    text = " ".join(text.split())
    return text if len(text) <= keep else text[:keep - 3] + "..."


# ==================================================================================================
# Copies and runs
# ==================================================================================================


def repository_files(root):
    """The files .ci/run copies: tracked and untracked-but-not-ignored, those deleted in the working tree left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace").strip() if getattr(e, "stderr", None) else str(e)
        raise BatteryError(f"{root}: git cannot list the repository's files: {shorten(detail, 100)}") from None
    files = [name for name in listed.decode().split("\0") if name]
    return [name for name in files if (pathlib.Path(root) / name).is_file()]


def copy_repository(root, files, dest):
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pathlib.Path(root) / name, target)


def environment():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MUJOCO_GL", "egl")
    return env


def node_id(case):
    """The pytest node id of a JUnit (xunit1) testcase element."""
    name, classname, file = case.get("name", ""), case.get("classname", ""), case.get("file")
    if not classname:  # a collection error: the module's file (name is its dotted path)
        return file or name
    if not file:
        return f"{classname}::{name}"
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    rest = classname[len(module):].lstrip(".") if classname.startswith(module) else classname
    return "::".join([file, *([part for part in rest.split(".") if part]), name])


def failure_line(element):
    """One line of a failure or error element: its message's first line, or the traceback's last `E` line."""
    message = (element.get("message") or "").strip()
    if message and message != "collection failure":
        return shorten(message.splitlines()[0])
    lines = [line for line in (element.text or "").splitlines() if line.strip()]
    marked = [line[1:].strip() for line in lines if line.startswith("E ")]
    return shorten((marked or lines or [message or "(no message)"])[-1])


def read_junit(path):
    """(counts {tests, failures, errors, skipped}, first failure (kind, test id, line) or None) of a
    JUnit XML report; kind is 'failure', 'error' or 'collection'."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    for suite in suites:
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                element = case.find(kind)
                if element is not None:
                    collection = kind == "error" and (element.get("message") == "collection failure"
                                                      or not case.get("classname"))
                    return counts, ("collection" if collection else kind, node_id(case), failure_line(element))
    return counts, None


def output_tail(log):
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    return shorten(lines[-1]) if lines else "(no output)"


def run_tests(copy, junit, log, extra=(), targets=None):
    """Run the fast tier in `copy` (`targets` None), or the fast tests `targets` (node ids) alone and all of them
    (no -x); returns {status, test, line, seconds, counts}. status: passed, failed (a test failed or errored),
    collection (collection error) or error (no verdict: a named test that is slow is deselected, no tests ran)."""
    command = [sys.executable, *(FAST_TIER if targets is None else (*PYTEST, *targets)), f"--junitxml={junit}", "-o",
               "junit_family=xunit1", *extra]
    start = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.call(command, cwd=copy, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    result = {"seconds": time.monotonic() - start, "test": "", "line": "", "counts": None, "code": code}
    counts, first = read_junit(junit) if junit.is_file() else (None, None)
    result["counts"] = counts
    if code == 0 and counts is not None:
        result["status"] = "passed"
    elif code == 1 and first is not None and first[0] != "collection":
        result.update(status="failed", test=first[1], line=first[2])
    # A module that does not import: exit 2, or 4 when a node id of it was named (pytest finds no collectors).
    elif code in (2, 4) and first is not None and first[0] == "collection":
        result.update(status="collection", test=first[1], line=first[2])
    else:
        result.update(status="error", line=f"pytest exit {code}: {output_tail(log)}")
    return result


def run_one(root, files, mutation, work, extra=(), targets=None):
    """One copy of the repository under `work`, mutated unless `mutation` is None, and in it the fast tier
    (`targets` None) or the tests `targets`."""
    name = mutation["name"] if mutation else "(clean)"
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"{mutation['name'] if mutation else 'clean'}-", dir=work))
    copy = folder / "repo"  # the only entry of its folder: nothing beside it, as in .ci/run
    copy_repository(root, files, copy)
    if mutation is not None:
        for file, text in edited_files(copy, mutation).items():
            (copy / file).write_text(text)
    result = run_tests(copy, folder.with_suffix(".xml"), folder.with_suffix(".log"), extra, targets)
    result.update(name=name, slip=mutation["slip"] if mutation else "none", copy=copy,
                  caught_by=", ".join(mutation["caught_by"]) if mutation else "")
    return result


# ==================================================================================================
# The report
# ==================================================================================================

VERDICTS = {"passed": "ESCAPED", "failed": "caught", "collection": "caught (collection error)", "error": "ERROR"}


def verdict(result, clean=False):
    if clean:
        return {"passed": "passed", "failed": "FAILED", "collection": "FAILED (collection error)"}.get(
            result["status"], "ERROR")
    return VERDICTS[result["status"]]


def detail(result):
    if result["status"] == "passed":
        counts = result["counts"]
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        return f"{passed} passed, {counts['skipped']} skipped"
    if result["test"]:
        return f"{result['test']}: {result['line']}"
    return result["line"]


def report_line(result, clean=False):
    return f"{result['name']:<24} {verdict(result, clean):<26} {result['seconds']:6.0f} s  {detail(result)}"


def totals(results, clean, seconds):
    caught = sum(r["status"] in ("failed", "collection") for r in results)
    weak = sum(r["status"] == "collection" for r in results)
    escaped = sum(r["status"] == "passed" for r in results)
    errors = sum(r["status"] == "error" for r in results)
    return (f"Totals: {len(results)} mutations: {caught} caught ({weak} by a collection error), {escaped} escaped, "
            f"{errors} errors; clean copy {verdict(clean, True)} in {clean['seconds']:.0f} s; total {seconds:.0f} s")


def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def command_text(extra=(), fast_tier=True):
    """The command of each run as a reader types it: the fast tier, or a mutation's reference tests."""
    args = FAST_TIER if fast_tier else (*PYTEST, "TESTS")
    return " ".join(["python3", *(f'"{a}"' if " " in a else a for a in args), *map(shlex.quote, extra)])


def markdown(results, clean, seconds, extra, stamp, fast_tier=False):
    command = command_text(extra, fast_tier)
    what = ("" if fast_tier else ", TESTS the mutation's reference tests (`caught_by`; the clean copy: all of the "
            "mutations run)")
    lines = ["# Mutation battery", "", f"*{stamp}.* Each run: a fresh copy of the repository's files, the mutation "
             f"applied, then `{command}`{what}.", "",
             "| mutation | slip | reference tests | result | first failing test | failure | s |",
             "|---|---|---|---|---|---|---|"]
    for result, is_clean in [(clean, True), *[(r, False) for r in results]]:
        lines.append(f"| {cell(result['name'])} | {cell(result['slip'])} | {cell(result['caught_by'])} | "
                     f"{verdict(result, is_clean)} | {cell(result['test'])} | {cell(result['line'] or detail(result))} "
                     f"| {result['seconds']:.0f} |")
    return "\n".join([*lines, "", totals(results, clean, seconds), ""])


def stamp(root):
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = " with working-tree changes" if git("status", "--porcelain") else ""
    return f"Commit {commit}{dirty}; {time.strftime('%Y-%m-%d')}; {sys.executable} {sys.version.split()[0]}"


# ==================================================================================================
# The battery
# ==================================================================================================


def battery(root, mutations, extra=(), keep=False, out=None, stream=None, jobs=1, fast_tier=False):
    """The clean copy, then each of `mutations` (`jobs` at a time, each a pytest process of its own), in
    copies of the files under `root`: by default each mutation's reference tests (its `caught_by`; the clean
    copy runs those of all), with `fast_tier` the whole fast tier; prints the report to `stream` (stdout), in
    the table's order, and returns the exit status (0: clean passed and every mutation caught)."""
    stream = sys.stdout if stream is None else stream
    root = pathlib.Path(root).resolve()
    files = repository_files(root)
    missing = sorted({e["file"] for m in mutations for e in m["edits"]} - set(files))
    if missing:
        raise BatteryError(f"{', '.join(missing)}: not among the repository's files (git ls-files -co)")
    check_applies(root, mutations)  # a rename in the product stops the battery before it spends minutes
    say = lambda text: print(text, file=stream, flush=True)  # noqa: E731
    work = pathlib.Path(tempfile.mkdtemp(prefix="mutations-"))
    start = time.monotonic()
    try:
        every = list(dict.fromkeys(test for mutation in mutations for test in mutation["caught_by"]))
        clean = run_one(root, files, None, work, extra, None if fast_tier else every)
        say(report_line(clean, clean=True))
        results = []
        if clean["status"] != "passed":
            say(f"The clean copy fails the {'fast tier' if fast_tier else 'reference tests'} "
                f"({verdict(clean, True)}): no mutation was run")
        else:
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                def run(mutation):
                    return run_one(root, files, mutation, work, extra, None if fast_tier else mutation["caught_by"])

                for result in pool.map(run, mutations):
                    results.append(result)
                    say(report_line(result))
                    if not keep:
                        shutil.rmtree(result["copy"].parent, ignore_errors=True)
        seconds = time.monotonic() - start
        say(totals(results, clean, seconds))
        if out is not None:
            pathlib.Path(out).write_text(markdown(results, clean, seconds, extra, stamp(root), fast_tier))
            say(f"Report: {out}")
        if keep:
            say(f"Kept the copies, logs and XML reports in {work}")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    caught = all(r["status"] in ("failed", "collection") for r in results)
    return 0 if clean["status"] == "passed" and caught else 1


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2 (argparse prints the usage too)
        raise BatteryError(message)


def parse_args(argv):
    parser = Parser(prog="mutations.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    usage="python3 benchmarks/mutations.py [--list] [--only NAMES] [--pytest-args ARGS] [--keep] "
                          "[--out FILE] [--jobs N]")
    parser.add_argument("--list", action="store_true", help="print the mutations' names, one a line")
    parser.add_argument("--only", help="comma-separated names of the mutations to run (default: all)")
    parser.add_argument("--pytest-args", default="", help="more arguments for every pytest run (one string)")
    parser.add_argument("--keep", action="store_true", help="keep the copies, logs and XML reports")
    parser.add_argument("--fast-tier", action="store_true",
                        help="run the whole fast tier (-x) on every mutation instead of its reference tests")
    parser.add_argument("--out", type=pathlib.Path, help="also write the report there as a markdown table")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutations run at once, each pytest at OMP_NUM_THREADS (1); the clean copy runs alone "
                             "first (default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise BatteryError(f"--jobs {args.jobs}: valid: a whole number >= 1")
    try:
        args.extra = shlex.split(args.pytest_args)
    except ValueError as e:
        raise BatteryError(f"--pytest-args {args.pytest_args!r}: {e}") from None
    if args.out is not None and not args.out.parent.is_dir():
        raise BatteryError(f"--out {args.out}: no folder {args.out.parent}")
    return args


def main(argv=None, table=MUTATIONS, root=ROOT):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.list:
            print("\n".join(check_table(table)))
            return 0
        mutations = select(table, args.only)
        return battery(root, mutations, args.extra, args.keep, args.out, jobs=args.jobs, fast_tier=args.fast_tier)
    except BatteryError as e:
        print(f"mutations.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
