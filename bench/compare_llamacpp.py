#!/usr/bin/env python3
"""focus against llama.cpp on the same GGUF files, in one run, on the same threads.

llama.cpp is built natively from the source package of llama-cpp-python on PyPI (its
vendor/llama.cpp), cached outside the repository (default ~/.cache/focus/llamacpp). Measured for
each model:
  prefill of 512 and 2048 tokens, generation at depth 0 and 4096 (llama-bench vs focus bench model,
  both on random tokens, medians / means of repetitions),
  peak resident memory of the same short generation (llama-completion vs focus generate, /usr/bin/time),
  perplexity on the same text (llama-perplexity vs focus eval; llama-perplexity scores the second
  half of each window, focus eval every token, so the two numbers are each engine's own measure;
  focus's native weights are also compared with its exact f32 path on the same tokens),
  and for smollm2, generation at a long depth (default 8000) with the shipped Focus routers
  (routers/smollm2-books, hard mode) against both engines' dense generation.
Writes a markdown table and the raw JSON.

  bench/compare_llamacpp.py [--models smollm2,gemma3-270m] [--threads 2] [--out DIR] [--quick]
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # the source package version the numbers in docs were taken with
CACHE = Path(os.environ.get("FOCUS_CACHE", Path.home() / ".cache" / "focus"))
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}
TOOLS = ["llama-bench", "llama-perplexity", "llama-completion"]


def die(msg):
    sys.exit(f"compare_llamacpp: {msg}")


def run(cmd, timeout=3600, **kw):
    print("+ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        die(f"{Path(str(cmd[0])).name} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return r


def llamacpp_bin(cache):
    """The llama.cpp binaries, built once into the cache."""
    src = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    bindir = src / "build" / "bin"
    if all((bindir / t).exists() for t in TOOLS):
        return bindir
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not sdist.exists():
            die(f"could not download llama-cpp-python {LLAMA_CPP_PYTHON} from PyPI into {cache}:\n{r.stderr[-2000:]}")
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(cache, filter="data")
    run(["cmake", "-S", src, "-B", src / "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF"])
    run(["cmake", "--build", src / "build", "-j", str(os.cpu_count() or 2), "--target"] + TOOLS, timeout=7200)
    return bindir


def peak_rss_mb(cmd):
    """Runs cmd under /usr/bin/time; returns (peak RSS in MB, stdout)."""
    r = run(["/usr/bin/time", "-f", "PEAK_RSS_KB=%M"] + cmd)
    m = re.findall(r"PEAK_RSS_KB=(\d+)", r.stderr)
    if not m:
        die(f"no peak memory from /usr/bin/time for {cmd[0]}")
    return int(m[-1]) / 1024.0, r.stdout


def llama_bench(bindir, model, threads, args, reps):
    r = run([bindir / "llama-bench", "-m", model, "-t", threads, "-fa", "1", "-r", reps, "-o", "json"] + args)
    out = {}
    for row in json.loads(r.stdout):
        if row["n_prompt"] > 0:
            out[("prefill", row["n_prompt"], row.get("n_depth", 0))] = row["avg_ts"]
        else:
            out[("generate", row["n_gen"], row.get("n_depth", 0))] = row["avg_ts"]
    return out


def focus_bench(focus, model, threads, weights, args, reps):
    r = run([focus, "-t", threads, "bench", "model", "--model", model, "--weights", weights, "--reps", reps,
             "--json"] + args)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return {(row["test"], row["tokens"], row["depth"]): row["tok_per_s"] for row in j["results"]}, j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--focus", default=str(ROOT / "build" / "focus"))
    ap.add_argument("--weights", default="native", help="focus weight modes to run (comma separated)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "compare_llamacpp"))
    ap.add_argument("--cache", default=str(CACHE / "llamacpp"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="prefill 512, depth 0 only, 1 repetition, short perplexity")
    ap.add_argument("--routers", default=str(ROOT / "routers" / "smollm2-books"),
                    help="Focus routers for smollm2, timed in generation at --long-depth")
    ap.add_argument("--long-depth", type=int, default=8000,
                    help="cache depth of the generation test with the routers (0: skip; skipped with --quick)")
    a = ap.parse_args()

    focus = Path(a.focus)
    if not os.access(focus, os.X_OK):
        die(f"{focus}: not an executable (build first: make build)")
    bindir = llamacpp_bin(Path(a.cache))
    text = Path(a.data) / "text" / "wikitext-2-raw-v1-test-hf-rows-crlf.txt"
    if not text.exists():
        die(f"{text}: missing (the shared data is expected beside the checkout, or pass --data)")
    prefills, depths, reps = ([512], [0], 1) if a.quick else ([512, 2048], [0, 4096], a.reps)
    ppl_ctx, ppl_tokens = (512, 1024) if a.quick else (2048, 8192)
    threads = str(a.threads)
    results = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": a.threads, "gen": a.gen,
               "llama_cpp_python": LLAMA_CPP_PYTHON, "models": {}}
    for name in a.models.split(","):
        path = CACHE / "models" / MODELS[name]
        if not path.exists():
            die(f"{path}: missing (run scripts/setup.sh)")
        res = {"path": str(path)}
        ll = llama_bench(bindir, path, threads, ["-p", ",".join(map(str, prefills)), "-n", "0"], reps)
        ll.update(llama_bench(bindir, path, threads, ["-p", "0", "-n", str(a.gen), "-d", ",".join(map(str, depths))],
                              reps))
        res["llama.cpp"] = {f"{k[0]} {k[1]} @{k[2]}": v for k, v in ll.items()}
        fargs = ["--prefill", ",".join(map(str, prefills)), "--depth", ",".join(map(str, depths)), "--gen", str(a.gen)]
        for w in a.weights.split(","):
            fo, j = focus_bench(focus, name, threads, w, fargs, reps)
            res[f"focus {w}"] = {f"{k[0]} {k[1]} @{k[2]}": v for k, v in fo.items()}
            res[f"focus {w} kv_type"] = j.get("kv_type")
        # Long-context generation: llama.cpp dense, focus dense and focus with the routers.
        routers = Path(a.routers)
        if name == "smollm2" and a.long_depth > 0 and not a.quick and (routers / "focus.json").exists():
            d, w = a.long_depth, a.weights.split(",")[0]
            largs = ["--prefill", "0", "--depth", str(d), "--gen", str(a.gen)]
            shown = routers.resolve()
            ld = {"depth": d, "routers": str(shown.relative_to(ROOT) if ROOT in shown.parents else shown)}
            lb = llama_bench(bindir, path, threads, ["-p", "0", "-n", str(a.gen), "-d", str(d)], reps)
            ld["llama.cpp"] = list(lb.values())[0]
            fo, _ = focus_bench(focus, name, threads, w, largs, reps)
            ld[f"focus {w}"] = list(fo.values())[0]
            fo, _ = focus_bench(focus, name, threads, w, largs + ["--focus", str(routers), "--mode", "hard"], reps)
            ld[f"focus {w} + routers (hard)"] = list(fo.values())[0]
            res["long_generation"] = ld
        # The same short generation in both engines: peak memory.
        prompt = "The quick brown fox jumps over the lazy dog. Once upon a time"
        n = 128
        res["peak_rss_mb"] = {}
        res["peak_rss_mb"]["llama.cpp"], _ = peak_rss_mb(
            [bindir / "llama-completion", "-m", path, "-p", prompt, "-n", n, "-c", 256, "-t", threads, "-fa", "on",
             "--temp", 0, "-no-cnv", "--no-warmup", "--simple-io", "--no-display-prompt"])
        for w in a.weights.split(","):
            res["peak_rss_mb"][f"focus {w}"], _ = peak_rss_mb(
                [focus, "-t", threads, "generate", "--model", name, "--weights", w, "-p", prompt, "-n", n])
        # Perplexity on the same text.
        r = run([bindir / "llama-perplexity", "-m", path, "-f", text, "-c", ppl_ctx, "--chunks",
                 ppl_tokens // ppl_ctx, "-t", threads, "-fa", "on"])
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
        res["ppl"] = {"llama.cpp (second half of each window)": float(m.group(1)) if m else None}
        for w in sorted(set(a.weights.split(",")) | {"f32"}):
            r = run([focus, "-t", threads, "eval", "--model", name, "--weights", w, "--text", text, "--ctx", ppl_ctx,
                     "--max-tokens", ppl_tokens, "--json"])
            res["ppl"][f"focus {w}"] = json.loads(r.stdout.strip().splitlines()[-1])["ppl"]
        results["models"][name] = res
        print(json.dumps(res, indent=1), file=sys.stderr)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['date']}{'-quick' if a.quick else ''}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    md = table(results, a.weights.split(","))
    (out / f"{stem}.md").write_text(md)
    print(md)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table(results, weights):
    lines = [f"# focus vs llama.cpp ({results['date']}, {results['cpu']}, {results['threads']} threads, "
             f"llama.cpp from llama-cpp-python {results['llama_cpp_python']})", "",
             "Command: `python3 bench/compare_llamacpp.py` (tokens/s: higher is better; ratio = focus / llama.cpp)", ""]
    for name, res in results["models"].items():
        lines += [f"## {name}", "", "| test | llama.cpp | " + " | ".join(f"focus {w}" for w in weights) +
                  " | ratio |", "|---|---|" + "---|" * len(weights) + "---|"]
        for key, v in res["llama.cpp"].items():
            fs = [res[f"focus {w}"].get(key) for w in weights]
            ratio = fs[0] / v if fs[0] and v else float("nan")
            lines.append(f"| {key} tok/s | {v:.1f} | " + " | ".join(f"{f:.1f}" if f else "-" for f in fs) +
                         f" | {ratio:.2f}x |")
        pr = res["peak_rss_mb"]
        lines.append(f"| peak memory, short generation (MB) | {pr['llama.cpp']:.0f} | " +
                     " | ".join(f"{pr[f'focus {w}']:.0f}" for w in weights) +
                     f" | {pr[f'focus {weights[0]}'] / pr['llama.cpp']:.2f}x |")
        pp = res["ppl"]
        lines.append("| perplexity | " + " / ".join(f"{k}: {v:.4f}" for k, v in pp.items() if v) + " | | |")
        kv = ", ".join(f"focus {w}: {res.get(f'focus {w} kv_type')}" for w in weights)
        lines += ["", f"KV cache: llama.cpp f16, {kv}.", ""]
        ld = res.get("long_generation")
        if ld:
            lines += [f"Generation of {results.get('gen', 64)} tokens at depth {ld['depth']} (tok/s; ratio to llama.cpp; "
                      f"routers {ld['routers']}):", "", "| engine | tok/s | ratio |", "|---|---|---|"]
            for k, v in ld.items():
                if k not in ("depth", "routers"):
                    lines.append(f"| {k} | {v:.1f} | {v / ld['llama.cpp']:.2f}x |")
            lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
