#!/usr/bin/env python3
r"""Quality-speed frontier of sparse attention variants: held-out perplexity against density of
causal pairs and against end-to-end time, one curve per method.

  scripts/frontier.py run --config scripts/frontier_smollm2.json --out docs/results/frontier
  scripts/frontier.py report --results docs/results/frontier/results.jsonl \
      --out-md docs/results/frontier/frontier.md --png docs/results/frontier/frontier

A variant is a label, a method (the curve it belongs to) and a list of extra `focus eval`
arguments; each (ctx, variant, text) is one `focus eval --json` run, appended to results.jsonl
with the command, date, host, CPU and thread count. Runs already recorded are skipped, so an
interrupted run resumes where it stopped; `run --rerun` runs them again (to time them on this
machine), and the report keeps the latest record of each (ctx, label, text).
"""
import argparse, datetime, json, math, os, shlex, socket, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_KEYS = {"model", "texts", "ctx", "max_tokens", "windows", "variants", "comment"}
VARIANT_KEYS = {"method", "label", "args", "comment"}


def die(msg):
    sys.exit(f"frontier: error: {msg}")


def repo_path(p):
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.join(ROOT, p)


def load_config(path):
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        die(f"cannot read config {path}: {e}")
    if not isinstance(c, dict):
        die(f"{path}: the config must be a JSON object")
    bad = set(c) - CONFIG_KEYS
    if bad:
        die(f"{path}: unknown key(s) {sorted(bad)}; allowed: {sorted(CONFIG_KEYS)}")
    for k in ("model", "texts", "ctx", "variants"):
        if k not in c:
            die(f"{path}: missing key '{k}'")
    if ("max_tokens" in c) == ("windows" in c):
        die(f"{path}: give exactly one of 'max_tokens' (text tokens per text) or 'windows' (ctx windows per text)")
    if isinstance(c["ctx"], int):
        c["ctx"] = [c["ctx"]]
    if isinstance(c["texts"], str):
        c["texts"] = [c["texts"]]
    labels = set()
    for i, v in enumerate(c["variants"]):
        if not isinstance(v, dict):
            die(f"{path}: variants[{i}] must be an object")
        bad = set(v) - VARIANT_KEYS
        if bad:
            die(f"{path}: variants[{i}]: unknown key(s) {sorted(bad)}; allowed: {sorted(VARIANT_KEYS)}")
        for k in ("method", "label", "args"):
            if k not in v:
                die(f"{path}: variants[{i}]: missing key '{k}'")
        if not isinstance(v["args"], list) or not all(isinstance(a, str) for a in v["args"]):
            die(f"{path}: variants[{i}] ({v['label']}): 'args' must be a list of strings")
        if v["label"] in labels:
            die(f"{path}: duplicate label '{v['label']}'")
        labels.add(v["label"])
    return c


def machine():
    cpu, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, val = line.partition(":")
                if k.strip() == "model name" and cpu == "unknown":
                    cpu = val.strip()
                elif k.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2+FMA" if {"avx2", "fma"} <= flags else "no AVX2"
    return {"host": socket.gethostname(), "cpu": cpu, "isa": isa, "cores": os.cpu_count()}


def read_results(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        print(f"frontier: warning: {path}:{n}: not JSON, ignored", file=sys.stderr)
    return out


def cmd_run(a):
    c = load_config(a.config)
    fbin = repo_path(a.focus_bin)
    if not (os.path.isfile(fbin) and os.access(fbin, os.X_OK)):
        die(f"focus binary {fbin} not found or not executable (build it, or pass --focus-bin)")
    model = a.model or c["model"]
    if "/" in model or model.endswith((".gguf", ".bin")):
        model = repo_path(model)
        if not os.path.exists(model):
            die(f"model {model} not found (scripts/setup.sh installs the default models)")
    texts = [repo_path(t) for t in c["texts"]]
    for t in texts:
        if not os.path.isfile(t):
            die(f"text {t} not found")
    ctxs = [x for x in c["ctx"] if not a.ctx or x in a.ctx]
    variants = [v for v in c["variants"] if not a.only or v["label"] in a.only]
    if a.only and len(variants) != len(set(a.only)):
        die(f"--only: unknown label(s) {sorted(set(a.only) - {v['label'] for v in variants})}")
    if not ctxs or not variants:
        die("nothing to run (check --ctx / --only against the config)")
    os.makedirs(a.out, exist_ok=True)
    res_path = os.path.join(a.out, "results.jsonl")
    done = {(r["ctx"], r["label"], r["text"], r["max_tokens"]) for r in read_results(res_path)}
    mach = machine()
    run_cmd = "scripts/frontier.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    jobs = [(ctx, v, t) for ctx in ctxs for v in variants for t in texts]
    failed = 0
    for i, (ctx, v, t) in enumerate(jobs, 1):
        maxt = a.max_tokens or (c["max_tokens"] if "max_tokens" in c else c["windows"] * (ctx - 1))
        if a.windows:
            maxt = a.windows * (ctx - 1)
        tag = f"[{i}/{len(jobs)}] ctx {ctx} | {v['label']} | {os.path.basename(t)}"
        if not a.rerun and (ctx, v["label"], os.path.basename(t), maxt) in done:
            print(f"{tag}: already recorded, skipped", flush=True)
            continue
        cmd = [fbin, "--threads", str(a.threads), "eval", "--model", model, "--text", t, "--ctx", str(ctx),
               "--max-tokens", str(maxt), "--json"] + v["args"]
        print(f"{tag}: running", flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        lines = p.stdout.strip().splitlines()
        j = None
        if p.returncode == 0 and lines:
            try:
                j = json.loads(lines[-1])
            except ValueError:
                pass
        if j is None or j.get("interrupted"):
            failed += 1
            print(f"{tag}: FAILED (exit {p.returncode}): {shlex.join(cmd)}\n"
                  + "\n".join((p.stderr.strip().splitlines() or ["(no stderr)"])[-5:]), file=sys.stderr)
            if p.returncode in (130, -2):
                die("interrupted; run the same command again to resume")
            continue
        rec = dict(j)
        rec.update({"ctx": ctx, "label": v["label"], "method": v["method"], "args": v["args"],
                    "text": os.path.basename(t), "max_tokens": maxt, "wall_seconds": round(wall, 3),
                    "command": shlex.join(cmd).replace(ROOT + "/", ""), "run": run_cmd,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    **mach})
        with open(res_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        dens = f" | density {j['density']:.4f}" if "density" in j else ""
        print(f"{tag}: ppl {j['ppl']:.4f}{dens} | {j['tokens']} tokens | {j['seconds']:.1f} s", flush=True)
    print(f"frontier: results in {res_path}" + (f"; {failed} run(s) failed" if failed else ""))
    return 1 if failed else 0


def aggregate(recs):
    """{ctx: [row]} with one row per label: token-weighted NLL and density, summed seconds."""
    last = {}
    for r in recs:  # the latest record of each (ctx, label, text) wins
        last[(r["ctx"], r["label"], r["text"])] = r
    groups = {}
    for (ctx, label, _), r in last.items():
        groups.setdefault(ctx, {}).setdefault(label, []).append(r)
    out = {}
    for ctx, by_label in sorted(groups.items()):
        rows = []
        for label, rs in by_label.items():
            tok = sum(r["tokens"] for r in rs)
            if rs[0]["method"] != "dense" and any("density" not in r for r in rs):
                print(f"frontier: warning: ctx {ctx} '{label}' reports no density; taken as 1.0", file=sys.stderr)
            nll = sum(r["nll"] * r["tokens"] for r in rs) / tok
            dens = sum(r.get("density", 1.0) * r["tokens"] for r in rs) / tok
            rows.append({"label": label, "method": rs[0]["method"], "texts": sorted(r["text"] for r in rs),
                         "tokens": tok, "nll": nll, "ppl": math.exp(nll), "density": dens,
                         "seconds": sum(r["seconds"] for r in rs), "recs": rs,
                         "load": max((r["load_max_over_mean"] for r in rs if "load_max_over_mean" in r), default=None)})
        dense = next((r for r in rows if r["method"] == "dense"), None)
        for r in rows:
            r["delta"] = 100 * (r["ppl"] / dense["ppl"] - 1) if dense else None
            r["speedup"] = dense["seconds"] / r["seconds"] if dense else None
            if dense and (r["texts"] != dense["texts"] or r["tokens"] != dense["tokens"]):
                print(f"frontier: warning: ctx {ctx} '{r['label']}' scores {r['tokens']} tokens of {r['texts']}, "
                      f"dense {dense['tokens']} of {dense['texts']}: not comparable", file=sys.stderr)
        rows.sort(key=lambda r: (r["method"] != "dense", r["method"], r["density"]))
        out[ctx] = rows
    return out


def is_focus_method(m):
    return m.startswith("focus")


def is_focus(r):
    return is_focus_method(r["method"])


# Two patterns with the same per-head budgets read the same pairs in the first routed layer and may
# differ by near-ties between blocks in later ones (whose inputs the routers' far-pair terms
# change): their densities then differ by about 1e-5 of themselves. Within this relative tolerance,
# below what one more block per row in one head adds (a block of 4 keys among the ~17,000 that 270
# heads read per row at 2% density is 2e-4), a density counts as matched.
DENSITY_RTOL = 1e-4


def dominance_table(rows):
    """For each baseline point, the Focus point at or below it (density <= within DENSITY_RTOL, and
    ppl <=) with the lowest perplexity, or none: the check behind "at every density Focus is at or
    below every baseline"."""
    base = sorted((r for r in rows if r["method"] != "dense" and not is_focus(r)), key=lambda r: r["density"])
    focus = [r for r in rows if is_focus(r)]
    if not base or not focus:
        return []
    md = ["", "Each baseline point against the Focus points at or below it (density and perplexity both "
          f"at most the baseline's, the density within a relative {DENSITY_RTOL:g}; the lowest perplexity shown):", "",
          "| baseline | density | vs dense | Focus at or below | density | vs dense |", "|---|---|---|---|---|---|"]
    missing = 0
    for b in base:
        under = [f for f in focus if f["density"] <= b["density"] * (1 + DENSITY_RTOL) and f["ppl"] <= b["ppl"]]
        d = "" if b["delta"] is None else f"{b['delta']:+.2f}%"
        if under:
            f = min(under, key=lambda f: f["ppl"])
            fd = "" if f["delta"] is None else f"{f['delta']:+.2f}%"
            md.append(f"| {b['label']} | {b['density']:.4f} | {d} | {f['label']} | {f['density']:.4f} | {fd} |")
        else:
            missing += 1
            md.append(f"| {b['label']} | {b['density']:.4f} | {d} | **none** | | |")
    md += ["", f"{len(base) - missing} of {len(base)} baseline points have a Focus point at or below them."]
    return md


# Above this many points a plot's points are not labelled (the table names them).
MAX_LABELLED = 40

# The families of the summary plot, in legend order: (name, test on a method).
FAMILIES = (("Focus (trained routers)", is_focus_method),
            ("block top-k (Quest bound, training-free)", lambda m: m.startswith("blocktopk")),
            ("local window + sink (StreamingLLM)", lambda m: m == "window"),
            ("random routers", lambda m: m == "random"))


def lower_envelope(pts, xkey):
    """The points no other point beats on both axes (x and perplexity at most its own), by x."""
    out = []
    for r in sorted(pts, key=lambda r: (r[xkey], r["ppl"])):
        if not out or r["ppl"] < out[-1]["ppl"]:
            out.append(r)
    return out


def draw_dense(ax, dense, xkey):
    """The dense model's point, its perplexity and that +1%, as horizontal lines."""
    ax.axhline(dense["ppl"], color="black", linestyle="--", linewidth=1)
    ax.plot([dense[xkey]], [dense["ppl"]], marker="s", color="black", linestyle="none",
            label=f"dense (ppl {dense['ppl']:.3f})")
    ax.axhline(dense["ppl"] * 1.01, color="grey", linestyle=":", linewidth=1, label="dense +1%")


def density_axis(ax, rows):
    """A log axis of densities with round ticks from a little below the sparsest row."""
    ax.set_xscale("log")
    lo = min(r["density"] for r in rows)
    ax.set_xticks([t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0) if t >= lo / 2.5])
    ax.set_xticklabels([f"{t:g}" for t in ax.get_xticks()])


def finish(fig, ax, path, xlabel, title, plt):
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_families(ctx, rows, path, xkey, xlabel, plt):
    """The paper's Figure 1: per family of methods, the best perplexity reached at each density (or
    time) by any of its variants: the lower envelope of the family's points."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    dense = next((r for r in rows if r["method"] == "dense"), None)
    styles = (("tab:red", "o"), ("tab:blue", "s"), ("tab:green", "^"), ("tab:grey", "v"))
    for (name, test), (colour, marker) in zip(FAMILIES, styles):
        pts = [r for r in rows if r["method"] != "dense" and test(r["method"])]
        if not pts:
            continue
        env = lower_envelope(pts, xkey)
        ax.plot([r[xkey] for r in pts], [r["ppl"] for r in pts], linestyle="none", marker=marker, markersize=2.5,
                color=colour, alpha=0.25)
        ax.plot([r[xkey] for r in env], [r["ppl"] for r in env], marker=marker, markersize=4, color=colour,
                label=f"{name}: best of {len(pts)} points")
    if dense:
        draw_dense(ax, dense, xkey)
        # the interesting range; points above +25% are cut off
        ax.set_ylim(min(r["ppl"] for r in rows) * 0.99, dense["ppl"] * 1.25)
    if xkey == "density":
        density_axis(ax, rows)
    else:
        ax.set_xscale("log")
    finish(fig, ax, path, xlabel, f"ctx {ctx}: {', '.join(rows[0]['texts'])} ({rows[0]['tokens']} tokens); "
           "lines: each family's best point at each " + ("density" if xkey == "density" else "time"), plt)


def plot(ctx, rows, path, xkey, xlabel, plt, zoom=False):
    """One curve per method; zoom: only the rows within +2% of dense, on their own axis range."""
    if zoom:
        rows = [r for r in rows if r["method"] == "dense" or (r["delta"] is not None and r["delta"] <= 2.0)]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    dense = next((r for r in rows if r["method"] == "dense"), None)
    methods = []
    for r in rows:
        if r["method"] != "dense" and r["method"] not in methods:
            methods.append(r["method"])
    for i, m in enumerate(methods):
        pts = sorted((r for r in rows if r["method"] == m), key=lambda r: r["density"])  # curve order
        # A colour and a marker of its own per method (tab20 has 20 colours; markers cycle by 7).
        ax.plot([r[xkey] for r in pts], [r["ppl"] for r in pts], marker="os^Dv<>"[i % 7], markersize=4,
                color=plt.get_cmap("tab20")(i % 20), label=m)
        for r in (pts if len(rows) <= MAX_LABELLED else []):  # above every other method's points, below the rest
            ax.annotate(r["label"], (r[xkey], r["ppl"]), textcoords="offset points",
                        xytext=(4, 4 if i % 2 == 0 else -11), fontsize=6)
    if dense:
        draw_dense(ax, dense, xkey)
    if xkey == "density":
        density_axis(ax, rows)
    sparse = [r[xkey] for r in rows if r["method"] != "dense"]
    if zoom and sparse:
        x0, x1 = min(sparse) / 1.05, max(sparse) * 1.05
        ax.set_xlim(x0, x1)
        if xkey == "density":
            ax.set_xticks([t / 100 for t in range(5, 100, 5) if x0 <= t / 100 <= x1], minor=False)
            ax.set_xticklabels([f"{t:g}" for t in ax.get_xticks()])
            ax.set_xticks([], minor=True)
    finish(fig, ax, path, xlabel, f"ctx {ctx}: {', '.join(rows[0]['texts'])} ({rows[0]['tokens']} tokens)"
           + (", the variants within +2% of dense" if zoom else ""), plt)


def cmd_report(a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        die("matplotlib is missing: pip install matplotlib (scripts/setup.sh installs it)")
    if not os.path.isfile(a.results):
        die(f"results file {a.results} not found")
    recs = read_results(a.results)
    if not recs:
        die(f"{a.results} holds no results")
    agg = aggregate(recs)
    dates = sorted(r["date"] for r in recs)
    machines = sorted({f"{r['host']}: {r['cpu']} ({r['isa']}, {r['cores']} cores), {r['threads']} threads"
                       for r in recs})
    runs = sorted({r["run"] for r in recs})
    md = ["# Quality-speed frontier of sparse attention variants", "",
          f"Model `{os.path.basename(recs[0]['model'])}`; held-out texts {', '.join(f'`{t}`' for t in sorted({r['text'] for r in recs}))}; "
          f"each variant scores exactly the same first tokens of each text in non-overlapping ctx windows "
          f"with BOS. Measured {dates[0][:10]}" + (f" to {dates[-1][:10]}" if dates[-1][:10] != dates[0][:10] else "")
          + " on " + "; ".join(machines) + ". Made by", ""]
    md += [f"    {r}" for r in runs] + ["", "and this table and the plots by", "",
           "    scripts/frontier.py report " + " ".join(shlex.quote(x) for x in (
               ["--results", a.results, "--out-md", a.out_md] + (["--png", a.png] if a.png else []))) +
           " --note TEXT" * len(a.note or []) + (" (the notes below)" if a.note else ""), "",
           "ppl = exp(token-weighted mean NLL over the texts); density = visible pairs / causal pairs over "
           "the sparse layers (token-weighted; dense = 1); load max/mean = the largest group's share of queries over the mean, worst layer, worst text (routed variants only); seconds = `focus eval`'s timed forward passes "
           "summed over the texts (model loading and tokenising excluded); the machine is shared and rows were "
           "run on different days and machines, so timings vary between runs and the time plots only sketch "
           "(speed-ups measured in pairs are in docs/RESULTS.md). The summary plots draw, for each family of "
           "methods, the lower envelope of its points: the best perplexity any of its variants reached at that "
           "density or time. Raw lines (with each exact command): `" + os.path.basename(a.results) + "`.", ""]
    for note in a.note or []:
        md += [note, ""]
    for ctx, rows in agg.items():
        md += [f"## ctx {ctx}", "", "| method | label | density | ppl | vs dense | seconds | speed-up | load max/mean |",
               "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            d = "" if r["delta"] is None else f"{r['delta']:+.2f}%"
            s = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            ld = f"{r['load']:.2f}" if r["load"] else ""
            md.append(f"| {r['method']} | {r['label']} | {r['density']:.4f} | {r['ppl']:.4f} | {d} | "
                      f"{r['seconds']:.1f} | {s} | {ld} |")
        md += dominance_table(rows)
        md += ["", "Commands (first text; the others differ only in `--text`):", ""]
        home = os.path.expanduser("~")
        md += [f"- {r['label']}: `{r['recs'][0]['command'].replace(home + '/', '~/')}`" for r in rows]
        if a.png:
            os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
            density = "density of causal pairs (log)"
            for draw, xkey, xlabel, suffix in (
                    (plot_families, "density", density, "summary"),
                    (plot_families, "seconds", "end-to-end seconds (forward passes, log)", "summary_time"),
                    (plot, "density", density, "density"),
                    (lambda *x: plot(*x, zoom=True), "density", density, "density_near_dense"),
                    (plot, "seconds", "end-to-end seconds (forward passes)", "time")):
                path = f"{a.png}_ctx{ctx}_{suffix}.png"
                draw(ctx, rows, path, xkey, xlabel, plt)
                md.append("")
                md.append(f"![ctx {ctx} {suffix}]({os.path.relpath(path, os.path.dirname(os.path.abspath(a.out_md)))})")
                print(f"frontier: wrote {path}")
        md.append("")
    with open(a.out_md, "w") as f:
        f.write("\n".join(md))
    print(f"frontier: wrote {a.out_md}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = "run focus eval for every (ctx, variant, text) of a config; resumes where results.jsonl stops"
    r = sub.add_parser("run", help=h, description=h)
    r.add_argument("--config", required=True, help="JSON: model, texts, ctx, max_tokens or windows, variants")
    r.add_argument("--out", required=True, help="folder; results are appended to OUT/results.jsonl")
    r.add_argument("--focus-bin", default="build/focus", help="focus binary (default: build/focus)")
    r.add_argument("--threads", type=int, default=1, help="threads per eval (default 1)")
    r.add_argument("--model", help="override the config's model")
    r.add_argument("--only", nargs="+", metavar="LABEL", help="run only these variant labels")
    r.add_argument("--ctx", type=int, nargs="+", help="run only these ctx values of the config")
    r.add_argument("--max-tokens", type=int, help="override: text tokens per text")
    r.add_argument("--windows", type=int, help="override: ctx windows per text (windows x (ctx-1) tokens)")
    r.add_argument("--rerun", action="store_true",
                   help="run recorded jobs again (e.g. to time them on this machine); the report keeps the latest")
    h = "aggregate results.jsonl per (ctx, label) into a markdown table and PNG plots (needs matplotlib)"
    p = sub.add_parser("report", help=h, description=h)
    p.add_argument("--results", required=True, help="results.jsonl written by run")
    p.add_argument("--out-md", required=True, help="markdown file to write")
    p.add_argument("--png", help="PNG prefix: PREFIX_ctxN_density.png and PREFIX_ctxN_time.png")
    p.add_argument("--note", action="append", help="paragraph to add under the header (repeatable)")
    a = ap.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
