#!/usr/bin/env python3
"""The list of bad inputs the tests try and the message each gets, for docs/RESULTS.md.

Runs the error-checking suites of focus_tests with FOCUS_BAD_INPUT_LOG set (tests/test_util.h:
record_error appends every error a test provokes), then writes a Markdown table: the test, the
command (for inputs given to the `focus` binary) and the message, with the tests' temporary
folders and the data folder shortened.

    scripts/bad_inputs.py --tests build/focus_tests --data ../shared/data --out docs/results/bad_inputs.md
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

SUITES = ("BadInputs.*:FuzzRegressions.*:SafetensorsBad.*:*Bad*:*Reject*:*Refuse*:*Error*:*Malformed*:"
          "*Truncated*:*Invalid*:*Missing*:*Wrong*")


def shorten(s, data):
    s = re.sub(r"/[^ '\"]*?/focus_tests\.[A-Za-z0-9]{6}", "$TMP", s)
    s = s.replace("$TMP//", "$TMP/")
    if data:
        s = s.replace(os.path.abspath(data), "$DATA")
    s = re.sub(r"/[^ '\"]*/\.cache/focus/models", "$MODELS", s)
    s = re.sub(r"/[^ '\"]*/focus(?= )", "focus", s)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", required=True, help="the focus_tests binary")
    ap.add_argument("--data", default="", help="the shared data folder (FOCUS_DATA)")
    ap.add_argument("--out", required=True, help="Markdown file to write")
    ap.add_argument("--filter", default=SUITES, help="gtest filter of the suites to run")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "errors.jsonl")
        env = dict(os.environ, FOCUS_BAD_INPUT_LOG=log)
        if a.data:
            env["FOCUS_DATA"] = os.path.abspath(a.data)
        env.setdefault("FOCUS_BIN", os.path.join(os.path.dirname(os.path.abspath(a.tests)), "focus"))
        r = subprocess.run([a.tests, f"--gtest_filter={a.filter}", "--gtest_brief=1"], env=env)
        if r.returncode != 0:
            sys.exit(f"bad_inputs.py: {a.tests} failed (exit {r.returncode})")
        rows, seen = [], set()
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                j = json.loads(line)
                msg = shorten(j["message"].strip().splitlines()[0], a.data)
                key = (j["test"], msg)
                if key in seen:
                    continue
                seen.add(key)
                rows.append((j["test"], shorten(j.get("input", ""), a.data), msg))
    def cell(s, n=260):
        s = s if len(s) <= n else s[: n - 3] + "..."
        return s.replace("|", "\\|").replace("`", "'")
    with open(a.out, "w") as f:
        f.write(f"# Bad inputs and their messages\n\n{len(rows)} distinct errors provoked by "
                f"{len({r[0] for r in rows})} tests (`scripts/bad_inputs.py`). $TMP is the test's temporary "
                "folder, $DATA the shared data folder. Every case exits with a message and no crash; the "
                "`focus` commands are also run against the AddressSanitizer build in CI.\n\n")
        f.write("| # | test | input | message |\n|---|---|---|---|\n")
        for i, (t, inp, msg) in enumerate(rows, 1):
            f.write(f"| {i} | {cell(t, 90)} | {cell(inp, 160)} | {cell(msg)} |\n")
    print(f"{len(rows)} errors from {len({r[0] for r in rows})} tests -> {a.out}")


if __name__ == "__main__":
    main()
