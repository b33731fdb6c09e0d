#!/usr/bin/env python3
"""Dense vs Focus trained from scratch: `focus train` for each architecture, attention and seed,
on the Gutenberg books of ../shared/data/text split by book (three to train, one to validate).
Writes docs/results/train_scratch.{md,json} (mean and spread of the held-out perplexity, soft and
hard for Focus) and docs/results/train_scratch.png (validation curves).

  scripts/train_compare.py [--archs gqa,mha] [--seeds 1,2,3] [--ctx 512] [--steps 200]
                           [--batch 4] [--window 64] [--groups 8] [--bin build/focus]

Each run lives in WORK/ARCH-ATTENTION-SEED: run again with the same flags, the script reuses the
runs that finished and resumes the one that was stopped from its checkpoint.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Split by book: three to train on, one to validate.
TRAIN_BOOKS = ("pg-1661-the-adventures-of-sherlock-holmes.txt", "pg-345-dracula.txt", "pg-1400-great-expectations.txt")
VALID_BOOKS = ("pg-1342-pride-and-prejudice.txt",)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="gqa")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", default="1e-3", help="peak learning rate (3e-3 is unstable on the presets)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up steps (default: steps / 20)")
    ap.add_argument("--extra", default="", help="more `focus train` flags for every run, space-separated")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--balance", default="swav")
    ap.add_argument("--attentions", default="dense,focus", help="which to run (a variant of Focus alone: focus)")
    ap.add_argument("--valid-windows", type=int, default=32)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "focus"))
    ap.add_argument("--threads", type=int, default=0, help="threads of each run (default: all cores)")
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    ap.add_argument("--work", default="/tmp/focus_train_compare")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "train_scratch"))
    a = ap.parse_args()
    text = os.path.join(a.data, "text")
    train = [os.path.join(text, f) for f in TRAIN_BOOKS]
    valid = [os.path.join(text, f) for f in VALID_BOOKS]
    for f in train + valid:
        if not os.path.exists(f):
            sys.exit(f"missing {f}")
    tok = os.path.join(a.data, "models", "stories260K", "tok512.bin")
    # The thread count is part of a run's identity: a run resumes bit for bit with the same threads.
    threads = a.threads or os.cpu_count()
    runs = []
    for arch in a.archs.split(","):
        for attention in a.attentions.split(","):
            for seed in a.seeds.split(","):
                out = os.path.join(a.work, f"{arch}-{attention}-{seed}")
                cmd = [a.bin, "--threads", str(threads), "train", "--arch", arch, "--attention", attention, "--tokenizer", tok, "--train", *train,
                       "--valid", *valid, "--ctx", str(a.ctx), "--steps", str(a.steps), "--batch", str(a.batch),
                       "--lr", a.lr, "--warmup", str(a.warmup or max(1, a.steps // 20)), "--eval-every", str(max(1, a.steps // 4)),
                       "--valid-windows", str(a.valid_windows), "--seed", seed, "--out", out, "--json"]
                cmd += a.extra.split()
                if attention == "focus":
                    cmd += ["--window", str(a.window), "--groups", str(a.groups), "--topk", "1",
                            "--balance", a.balance]
                # A finished run of the same command is reused; an interrupted one resumes from its
                # checkpoint (`focus train --resume` continues bit for bit); anything else starts over.
                done, started = os.path.join(out, "result.json"), os.path.join(out, "command.json")
                # The same run is the same flags, whichever path the binary has (the records of a run
                # may be copied to another machine and reused there).
                same = lambda c: isinstance(c, list) and c[1:] == cmd[1:]
                r = None
                if os.path.exists(done) and same(read_json(done).get("command")):
                    r = read_json(done)["result"]
                    print(f"{out}: finished before, reused", flush=True)
                else:
                    resume = (os.path.exists(started) and same(read_json(started).get("command")) and
                              os.path.exists(os.path.join(out, "checkpoint.safetensors")))
                    if not resume and os.path.exists(out):
                        subprocess.run(["rm", "-rf", out], check=True)
                    os.makedirs(out, exist_ok=True)
                    with open(started, "w") as f:
                        json.dump({"command": cmd}, f)
                    print(" ".join(cmd) + (" --resume" if resume else ""), flush=True)
                    p = subprocess.run(cmd + (["--resume"] if resume else []), stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)
                    if p.returncode != 0:
                        sys.exit(f"focus train failed ({p.returncode}): {' '.join(cmd)}")
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    r["resumed"] = resume
                    with open(done + ".tmp", "w") as f:
                        json.dump({"command": cmd, "result": r}, f)
                    os.replace(done + ".tmp", done)
                curve = {}  # by step: a resumed run logs again the steps after its checkpoint
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    for line in f:
                        j = json.loads(line)
                        if "valid" in j and j["valid"]:
                            curve[j.get("step", 0)] = (j["valid"].get("ppl"), j["valid"].get("ppl_hard"))
                r.update(seed=int(seed), curve=[(k, *v) for k, v in sorted(curve.items())])
                runs.append(r)
                print(f"  valid ppl {r['valid_ppl']:.3f}" + (f" hard {r['valid_ppl_hard']:.3f} density "
                      f"{r['valid_density_hard']:.3f}" if attention == "focus" else "") +
                      f", {r['tokens_per_s']:.0f} tok/s", flush=True)

    def stat(xs):
        return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan"))

    def pm(m, s):
        return f"{m:.2f}" if s != s else f"{m:.2f} ± {s:.2f}"  # one seed: no spread

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        cpu = platform.processor()
    date = datetime.date.today().isoformat()
    lines = ["# Dense vs Focus trained from scratch", "",
             f"{date}, {cpu}, {threads} thread{'' if threads == 1 else 's'} per run. Command: `python3 scripts/train_compare.py --archs {a.archs} "
             f"--seeds {a.seeds} --ctx {a.ctx} --steps {a.steps} --batch {a.batch} --lr {a.lr} "
             + f"--warmup {a.warmup or max(1, a.steps // 20)} " + (f"--extra '{a.extra}' " if a.extra else "") +
             (f"--threads {a.threads} " if a.threads else "") +
             f"--window {a.window} "
             f"--groups {a.groups} --balance {a.balance} --attentions {a.attentions}`.", "",
             "Train: Sherlock Holmes, Dracula, Great Expectations; validation: Pride and Prejudice "
             f"({a.valid_windows} windows of {a.ctx}); tokenizer tok512; equal tokens and parameters (routers "
             "aside) for dense and Focus. Focus: routers trained jointly in soft mode, validated soft and hard "
             "(top-1).", "",
             "| arch | attention | seeds | params | train tokens | valid ppl (mean ± sd) | hard top-1 ppl | hard density | tok/s | useful GFLOP/s (of sgemm peak) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arch in a.archs.split(","):
        for attention in a.attentions.split(","):
            rs = [r for r in runs if r["arch"] == arch and r["attention"] == attention]
            m, s = stat([r["valid_ppl"] for r in rs])
            hard = dens = "-"
            if attention == "focus":
                hm, hs = stat([r["valid_ppl_hard"] for r in rs])
                hard = pm(hm, hs)
                dens = f"{statistics.mean(r['valid_density_hard'] for r in rs):.3f}"
            tps = statistics.mean(r["tokens_per_s"] for r in rs)
            gf = statistics.mean(r["model_gflops"] for r in rs)
            mfu = statistics.mean(r.get("mfu", 0) for r in rs)
            lines.append(f"| {arch} | {attention} | {len(rs)} | {rs[0]['params']:,} | {rs[0]['train_tokens']:,} | "
                         f"{pm(m, s)} | {hard} | {dens} | {tps:.0f} | {gf:.0f} ({100 * mfu:.0f}%) |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"date": date, "cpu": cpu, "args": vars(a), "runs": runs}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = {"dense": "tab:blue", "focus": "tab:orange"}
        for r in runs:
            xs = [c[0] for c in r["curve"]]
            ax.plot(xs, [c[1] for c in r["curve"]], color=colors[r["attention"]], alpha=0.7,
                    label=f"{r['arch']} {r['attention']}" if r["seed"] == runs[0]["seed"] else None)
            if r["attention"] == "focus":
                ax.plot(xs, [c[2] for c in r["curve"]], color=colors["focus"], ls="--", alpha=0.5,
                        label=f"{r['arch']} focus hard" if r["seed"] == runs[0]["seed"] else None)
        ax.set_xlabel("step")
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("trained from scratch: dense vs Focus")
        fig.tight_layout()
        fig.savefig(a.out + ".png", dpi=100)
        lines += ["", f"![validation curves]({os.path.basename(a.out)}.png)"]
    except ImportError:
        pass
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
