#!/usr/bin/env python3
"""The retrofit claim on models trained from scratch: Focus routers trained on each frozen dense
model (`focus retrofit`), with held-out perplexity before (dense), window-only, and after (soft,
hard top-1). Writes OUT.md and OUT.json.

  scripts/retrofit_compare.py --models ARCH=DIR ... [--ctx 256] [--steps 50] [--window 32]
                              [--groups 8] [--balance swav] [--bin build/focus] --out docs/results/NAME
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_compare import TRAIN_BOOKS, VALID_BOOKS  # noqa: E402  (the same split by book)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True, help="ARCH=MODEL_DIR (focus train's OUT/model)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", default="1e-2")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--balance", default="swav")
    ap.add_argument("--valid-windows", type=int, default=16)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "focus"))
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    ap.add_argument("--work", default="/tmp/focus_retrofit_compare")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    text = os.path.join(a.data, "text")
    train = [os.path.join(text, f) for f in TRAIN_BOOKS]
    valid = [os.path.join(text, f) for f in VALID_BOOKS]
    rows = []
    for spec in a.models:
        arch, model = spec.split("=", 1)
        out = os.path.join(a.work, arch)
        subprocess.run(["rm", "-rf", out], check=True)
        cmd = [a.bin, "retrofit", "--model", model, "--train", *train, "--valid", *valid, "--ctx", str(a.ctx),
               "--window", str(a.window), "--groups", str(a.groups), "--topk", "1", "--steps", str(a.steps),
               "--batch", str(a.batch), "--lr", a.lr, "--warmup", str(max(1, a.steps // 10)), "--balance", a.balance,
               "--valid-windows", str(a.valid_windows), "--out", out, "--json"]
        print(" ".join(cmd), flush=True)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if p.returncode != 0:
            sys.exit(f"focus retrofit failed ({p.returncode}): {' '.join(cmd)}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["arch"] = arch
        rows.append(r)
        print(f"  dense {r['valid_ppl_pretrained']:.3f} window {r['valid_ppl_window']:.3f} soft "
              f"{r['valid_ppl_soft']:.3f} hard {r['valid_ppl_hard']:.3f} density {r['density_hard']:.3f}", flush=True)
    date = datetime.date.today().isoformat()
    lines = ["# Retrofit of routers on models trained from scratch", "",
             f"{date}, {os.cpu_count()} threads. Command: `python3 scripts/retrofit_compare.py --models "
             f"{' '.join(a.models)} --ctx {a.ctx} --steps {a.steps} --batch {a.batch} --lr {a.lr} --window "
             f"{a.window} --groups {a.groups} --balance {a.balance}`", "",
             "Routers only (the model frozen), trained on the books the model was trained on; validation: Pride "
             f"and Prejudice ({a.valid_windows} windows of {a.ctx}).", "",
             "| arch | dense | window only | routers soft | routers hard top-1 | hard density |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['valid_ppl_pretrained']:.2f} | {r['valid_ppl_window']:.2f} | "
                     f"{r['valid_ppl_soft']:.2f} | {r['valid_ppl_hard']:.2f} | {r['density_hard']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"date": date, "args": vars(a), "runs": rows}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
