#!/usr/bin/env python3
"""Tests of the analysis scripts whose numbers the docs quote (run by ctest as Scripts.python).

budget_groups.py is checked on block curves whose answer is known in closed form; train_compare.py
on a stand-in for `focus train` that records how it was called, so that the reuse of finished runs,
the resume of a stopped one and the restart of a changed one are each seen.
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:  # the budget_groups tests need it (scripts/setup.sh installs it)
    np = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_curves(path, missed, far, rows, group_keys=None, block=4, window=64, sinks=1, ctx=4096):
    """A curves file as `focus budget --curves` writes it (safetensors, F32, format metadata)."""
    tensors = {"missed": missed, "far": far, "rows": rows}
    if group_keys is not None:
        tensors["group_keys"] = group_keys
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(a)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "focus-block-curves", "block": str(block), "window": str(window),
                              "sinks": str(sinks), "ctx": str(ctx)}
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@unittest.skipIf(np is None, "numpy is not installed")
class BudgetGroups(unittest.TestCase):
    # Blocks alone leave f(K) unread; a head's groups are worth w blocks: beside K blocks they leave
    # f(K + w). f falls strictly, so the blocks-alone K that matches the hybrid at K is K + w exactly.
    K1, block = 61, 4
    worth = [3, 5, 7, 1]
    cost = [1, 10, 1, 10]  # blocks: heads 0 and 2 gain from their groups, 1 and 3 lose

    def f(self, k):
        return 0.4 * 0.92 ** np.asarray(k, dtype=np.float64)

    def run_script(self, d, **over):
        ks = np.arange(self.K1)
        blocks = np.stack([self.f(ks) for _ in self.worth])[None]
        hybrid = np.stack([self.f(ks + w) for w in self.worth])[None]
        far = np.full((1, len(self.worth)), 0.4)
        write_curves(os.path.join(d, "b.safetensors"), blocks, far, np.array([100.0]))
        write_curves(os.path.join(d, "h.safetensors"), hybrid, far * 0.7, np.array([100.0]),
                     group_keys=(np.array(self.cost) * self.block)[None].astype(np.float64), **over)
        return subprocess.run([sys.executable, os.path.join(SCRIPTS, "budget_groups.py"), "--blocks",
                               os.path.join(d, "b.safetensors"), "--hybrid", os.path.join(d, "h.safetensors"),
                               "--mean", "20", "30"], capture_output=True, text=True)

    def test_worth_and_choice_per_head(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script(d)
            self.assertEqual(p.returncode, 0, p.stderr)
            out = p.stdout
            # Worth: median and mean of w = 3, 5, 7, 1 are both 4; the cost is the mean of 1, 10, 1, 10.
            self.assertIn("median 4, mean 4.0, quartiles 2-6 (cost: mean 5.5)", out)
            # At each total, exactly the heads whose groups are worth more than they cost keep them,
            # and choosing per head leaves no more unread than either uniform choice.
            rows = [l for l in out.splitlines() if l.startswith("| 20 ") or l.startswith("| 30 ")]
            self.assertEqual(len(rows), 2, out)
            for r in rows:
                cells = [c.strip() for c in r.strip("|").split("|")]
                self.assertTrue(cells[3].endswith("(2 of 4)"), r)
                alone, groups, best = float(cells[1]), float(cells[2]), float(cells[3].split()[0])
                self.assertLessEqual(best, min(alone, groups) + 1e-4, r)

    def test_calibrations_that_differ_are_refused(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script(d, block=8)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("differ in block", p.stderr)


# A stand-in for `focus train`: records its arguments, writes the files a run leaves and, when
# asked through STUB_STOP_AT, stops after writing its checkpoint as a killed run would (through
# STUB_STOP_EARLY, before writing anything).
STUB = r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
seed = int(args[args.index("--seed") + 1])
attention = args[args.index("--attention") + 1]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
if os.environ.get("STUB_STOP_EARLY") == f"{attention}-{seed}":
    sys.exit(137)  # killed before its first checkpoint
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 2, "valid": {"ppl": 50.0 + seed, "ppl_hard": 51.0 + seed}}) + "\n")
open(os.path.join(out, "checkpoint.safetensors"), "w").write("x")
if os.environ.get("STUB_STOP_AT") == f"{attention}-{seed}":
    sys.exit(137)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 4, "valid": {"ppl": 40.0 + seed, "ppl_hard": 41.0 + seed}}) + "\n")
r = {"arch": args[args.index("--arch") + 1], "attention": attention, "valid_ppl": 40.0 + seed,
     "params": 1000, "train_tokens": 4096, "tokens_per_s": 100.0, "model_gflops": 1.0, "mfu": 0.5, "steps": 4}
if attention == "focus":
    r.update(valid_ppl_hard=41.0 + seed, valid_density_hard=0.3)
print("progress")
print(json.dumps(r))
'''


class TrainCompare(unittest.TestCase):
    def run_compare(self, d, steps="4", stop_at=None, stop_early=None, stub="focus_stub"):
        env = dict(os.environ, STUB_LOG=os.path.join(d, "log.jsonl"))
        env.pop("STUB_STOP_AT", None)
        env.pop("STUB_STOP_EARLY", None)
        if stop_at:
            env["STUB_STOP_AT"] = stop_at
        if stop_early:
            env["STUB_STOP_EARLY"] = stop_early
        return subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_compare.py"), "--archs", "gqa",
                               "--seeds", "1,2", "--steps", steps, "--bin", os.path.join(d, stub),
                               "--data", os.path.join(d, "data"), "--work", os.path.join(d, "work"),
                               "--out", os.path.join(d, "out", "cmp")], env=env, capture_output=True, text=True)

    def calls(self, d):
        if not os.path.exists(os.path.join(d, "log.jsonl")):
            return []
        with open(os.path.join(d, "log.jsonl")) as f:
            calls = [json.loads(l) for l in f]
        os.remove(os.path.join(d, "log.jsonl"))
        return [(c[c.index("--attention") + 1], c[c.index("--seed") + 1], "--resume" in c) for c in calls]

    def test_reuse_resume_and_restart(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "data", "text"))
            for book in ("pg-1661-the-adventures-of-sherlock-holmes.txt", "pg-345-dracula.txt",
                         "pg-1400-great-expectations.txt", "pg-1342-pride-and-prejudice.txt"):
                write_text(os.path.join(d, "data", "text", book), "text")
            stub = os.path.join(d, "focus_stub")
            write_text(stub, STUB)
            os.chmod(stub, 0o755)
            # The Focus run of seed 1 is killed: dense 1 and 2 finished, the script stops there.
            p = self.run_compare(d, stop_at="focus-1")
            self.assertNotEqual(p.returncode, 0)
            self.assertEqual(self.calls(d), [("dense", "1", False), ("dense", "2", False), ("focus", "1", False)])
            # Run again: the finished runs are reused, the killed one resumes, and the last one is
            # killed before it wrote a checkpoint.
            p = self.run_compare(d, stop_early="focus-2")
            self.assertNotEqual(p.returncode, 0)
            self.assertEqual(self.calls(d), [("focus", "1", True), ("focus", "2", False)])
            # With nothing to resume from, the last one starts over.
            p = self.run_compare(d)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(self.calls(d), [("focus", "2", False)])
            with open(os.path.join(d, "out", "cmp.json")) as f:
                runs = json.load(f)["runs"]
            self.assertEqual([r["resumed"] for r in runs], [False, False, True, False])
            # The resumed run's curve keeps one point per step, the steps logged again counted once.
            self.assertEqual(runs[2]["curve"], [[2, 51.0, 52.0], [4, 41.0, 42.0]])
            with open(os.path.join(d, "out", "cmp.md")) as f:
                md = f.read()
            self.assertIn("| gqa | dense | 2 | 1,000 | 4,096 | 41.50 ± 0.71 |", md)
            self.assertIn("| gqa | focus | 2 | 1,000 | 4,096 | 41.50 ± 0.71 | 42.50 ± 0.71 | 0.300 |", md)
            # Nothing left to do: every run is reused.
            p = self.run_compare(d)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(self.calls(d), [])
            # The same flags with the binary elsewhere (records copied from another machine) are
            # the same runs.
            shutil.copy(stub, os.path.join(d, "focus_stub2"))
            p = self.run_compare(d, stub="focus_stub2")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(self.calls(d), [])
            # Another command (more steps) starts every run over, without --resume.
            p = self.run_compare(d, steps="8")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(self.calls(d), [("dense", "1", False), ("dense", "2", False), ("focus", "1", False),
                                             ("focus", "2", False)])


def import_frontier():
    sys.path.insert(0, SCRIPTS)
    try:
        import frontier
    finally:
        sys.path.pop(0)
    return frontier


class FrontierDominance(unittest.TestCase):
    """frontier.py's check of "at every density Focus is at or below every baseline"."""

    def test_each_baseline_gets_the_focus_point_at_or_below_it(self):
        frontier = import_frontier()

        def row(method, label, density, ppl):
            return {"method": method, "label": label, "density": density, "ppl": ppl, "delta": ppl / 20.0 * 100 - 100}

        rows = [row("dense", "dense", 1.0, 20.0),
                row("blocktopk", "b-low", 0.020, 26.0),   # under it: f-a (the lower ppl of f-a and f-b)
                row("blocktopk", "b-mid", 0.030, 24.0),   # f-c is lower but denser; f-a is denser: none
                row("window", "w", 0.050, 23.0),          # density ties count (f-d at 0.050)
                row("focus-x", "f-a", 0.019, 25.0),
                row("focus-x", "f-b", 0.015, 25.5),
                row("focus-y", "f-c", 0.031, 23.5),
                row("focus-y", "f-d", 0.050, 23.0),
                # the same budgets' density up to near-ties: within the relative tolerance it matches
                row("blocktopk", "b-tie", 0.040, 23.2),
                row("focus-y", "f-e", 0.040 * (1 + 0.5 * frontier.DENSITY_RTOL), 23.1),
                row("blocktopk", "b-over", 0.060, 22.0),
                row("focus-y", "f-f", 0.060 * (1 + 2 * frontier.DENSITY_RTOL), 21.5)]
        md = "\n".join(frontier.dominance_table(rows))
        self.assertIn("| b-low | 0.0200 | +30.00% | f-a | 0.0190 | +25.00% |", md)
        self.assertIn("| b-mid | 0.0300 | +20.00% | **none** | | |", md)
        self.assertIn("| w | 0.0500 | +15.00% | f-d | 0.0500 | +15.00% |", md)
        self.assertIn("| b-tie | 0.0400 | +16.00% | f-e | 0.0400 | +15.50% |", md)
        self.assertIn("| b-over | 0.0600 | +10.00% | **none** | | |", md)
        self.assertIn("3 of 5 baseline points have a Focus point at or below them.", md)
        self.assertNotIn("| dense |", md)
        self.assertEqual(frontier.dominance_table([r for r in rows if not r["method"].startswith("focus")]), [])

    def test_summary_curves_are_each_familys_lower_envelope(self):
        frontier = import_frontier()
        pts = [{"label": l, "density": d, "ppl": p} for l, d, p in
               (("a", 0.10, 24.0), ("b", 0.05, 26.0), ("c", 0.20, 24.5), ("d", 0.20, 23.0), ("e", 0.30, 23.0),
                ("f", 0.08, 25.0))]
        # c is beaten by a (sparser and lower); e ties d's perplexity at a higher density
        self.assertEqual([r["label"] for r in frontier.lower_envelope(pts, "density")], ["b", "f", "a", "d"])
        families = {name: [m for m in ("focus-hybrid", "blocktopk-budget", "window", "random", "dense") if test(m)]
                    for name, test in frontier.FAMILIES}
        self.assertEqual(list(families.values()), [["focus-hybrid"], ["blocktopk-budget"], ["window"], ["random"]])


FRONTIER_STUB = """#!/usr/bin/env python3
import json, math, os, sys
a = sys.argv
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(a[1:]) + "\\n")
n = int(os.environ["STUB_N"])
r = {"nll": 3.0 + 0.1 * ("--focus" in a), "tokens": 100, "seconds": float(n), "interrupted": False}
r["ppl"] = math.exp(r["nll"])
if "--focus" in a:
    r["density"] = 0.25
print(json.dumps(r))
"""


class FrontierRun(unittest.TestCase):
    """frontier.py run: recorded runs are skipped; --rerun runs them again and the report keeps the latest."""

    def test_skip_rerun_latest_wins(self):
        with tempfile.TemporaryDirectory() as d:
            for t in ("a.txt", "b.txt"):
                write_text(os.path.join(d, t), "text")
            write_text(os.path.join(d, "m.gguf"), "model")
            stub = os.path.join(d, "focus_stub")
            write_text(stub, FRONTIER_STUB)
            os.chmod(stub, 0o755)
            cfg = {"model": os.path.join(d, "m.gguf"), "texts": [os.path.join(d, "a.txt"), os.path.join(d, "b.txt")],
                   "ctx": [64], "windows": 1,
                   "variants": [{"method": "dense", "label": "dense", "args": []},
                                {"method": "focus-x", "label": "f", "args": ["--focus", "r"]}]}
            write_text(os.path.join(d, "cfg.json"), json.dumps(cfg))
            log = os.path.join(d, "log.jsonl")

            def run(n, *extra):
                env = dict(os.environ, STUB_LOG=log, STUB_N=str(n))
                p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "frontier.py"), "run", "--config",
                                    os.path.join(d, "cfg.json"), "--out", os.path.join(d, "out"), "--focus-bin", stub]
                                   + list(extra), env=env, capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                calls = []
                if os.path.exists(log):
                    with open(log) as f:
                        calls = [json.loads(l) for l in f]
                    os.remove(log)
                return calls

            self.assertEqual(len(run(10)), 4)
            self.assertEqual(run(20), [])                      # everything recorded: skipped
            calls = run(3, "--rerun", "--only", "dense")       # the dense runs again, timed anew
            self.assertEqual(len(calls), 2)
            self.assertTrue(all("--focus" not in c for c in calls))
            frontier = import_frontier()
            rows = {r["label"]: r for r in frontier.aggregate(frontier.read_results(
                os.path.join(d, "out", "results.jsonl")))[64]}
            self.assertEqual(rows["dense"]["seconds"], 6.0)    # the latest record of each text
            self.assertEqual(rows["f"]["seconds"], 20.0)
            self.assertAlmostEqual(rows["f"]["speedup"], 0.3)
            self.assertAlmostEqual(rows["f"]["delta"], 100 * (math.exp(0.1) - 1))


if __name__ == "__main__":
    unittest.main()
