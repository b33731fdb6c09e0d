#!/usr/bin/env python3
r"""What a hybrid's groups are worth beside budgeted blocks, from two calibrations of `focus budget`.

  scripts/budget_groups.py --blocks curves_blocks.safetensors --hybrid curves_hybrid.safetensors \
      --mean 200 [--group-blocks 80]

--blocks holds the curves of block top-k alone (`focus budget ... --curves`), --hybrid those
measured around the routers' groups (`focus budget --focus DIR --topk K ... --curves`), with the
same block size, window and text. Both give, for every (layer, query head) and K, the far
attention probability per row the first K ranked blocks leave unread (around the groups: what
neither the groups nor the blocks read). What reading the groups costs a head, in blocks, is the
far keys per row they read divided by the block size, as the calibration around them counted
(its 'group_keys'); --group-blocks gives one cost for every head instead (e.g. from the densities
`focus eval` measures for the hybrid and for block top-k). Keys that both the groups and a block
read count in both, so the cost is an upper bound of what the groups add to the density.

For a total of --mean blocks per head (the groups' cost counted in it), it prints the unread
probability per row when every head reads blocks alone, when every head reads its groups too, and
when each head takes whichever of the two leaves less unread (the split made by a Lagrange
multiplier over both curves, bisected to the mean); and, per head, how many blocks the groups are
worth: the blocks that would take the head's blocks-alone curve as low as the groups do beside
the head's blocks at its hybrid budget.
"""
import argparse, json, struct, sys

import numpy as np


def die(msg):
    sys.exit(f"budget_groups: error: {msg}")


def load_curves(path):
    try:
        raw = open(path, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
    except (OSError, ValueError, struct.error) as e:
        die(f"{path}: not a safetensors file ({e})")
    md = header.get("__metadata__", {})
    if md.get("format") != "focus-block-curves":
        die(f"{path}: not a block curves file (made by `focus budget --curves`)")
    out = {"meta": md}
    for name in ("missed", "far", "rows", "group_keys"):
        if name == "group_keys" and name not in header:
            continue
        if name not in header or header[name].get("dtype") != "F32":
            die(f"{path}: tensor '{name}' missing or not F32")
        s, e = header[name]["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + s:8 + n + e], dtype=np.float32).astype(np.float64).reshape(
            header[name]["shape"])
    return out


def split(blocks, hybrid, cost, lam, allow):
    """Per head: K and unread for blocks alone (a) and with groups (b) at multiplier lam."""
    ks = np.arange(blocks.shape[2])
    ca = blocks + lam * ks
    cb = hybrid + lam * (ks + cost[..., None])
    ka, kb = ca.argmin(2), cb.argmin(2)
    use_b = np.zeros(ka.shape, bool) if allow == "blocks" else (
        np.ones(ka.shape, bool) if allow == "groups" else cb.min(2) < ca.min(2))
    k = np.where(use_b, kb + cost, ka)
    miss = np.where(use_b, np.take_along_axis(hybrid, kb[..., None], 2)[..., 0],
                    np.take_along_axis(blocks, ka[..., None], 2)[..., 0])
    return k, miss, use_b


def solve(blocks, hybrid, cost, mean, allow, valid):
    """The split at the multiplier whose mean K (groups' cost counted) is mean, by bisection."""
    lo, hi = 1e-12, 10.0
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        k, _, _ = split(blocks, hybrid, cost, mid, allow)
        if k[valid].mean() > mean:
            lo = mid
        else:
            hi = mid
    return split(blocks, hybrid, cost, hi, allow)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", required=True, help="curves of block top-k alone")
    ap.add_argument("--hybrid", required=True, help="curves measured around the groups (--focus)")
    ap.add_argument("--group-blocks", type=float, help="cost of the groups per head, in blocks (default: measured)")
    ap.add_argument("--mean", type=float, nargs="+", required=True, help="blocks per head in all (groups counted)")
    a = ap.parse_args()
    b, h = load_curves(a.blocks), load_curves(a.hybrid)
    for key in ("block", "window", "sinks", "ctx"):
        if b["meta"].get(key) != h["meta"].get(key):
            die(f"the two calibrations differ in {key}: {b['meta'].get(key)} and {h['meta'].get(key)}")
    if b["missed"].shape[:2] != h["missed"].shape[:2]:
        die(f"the two calibrations differ in layers or heads: {b['missed'].shape} and {h['missed'].shape}")
    K1 = min(b["missed"].shape[2], h["missed"].shape[2])
    B, H = b["missed"][..., :K1], h["missed"][..., :K1]
    valid = np.broadcast_to((b["rows"] > 0)[:, None], B.shape[:2])
    if a.group_blocks is not None:
        if a.group_blocks < 0:
            die("--group-blocks must be at least 0")
        cost = np.full(B.shape[:2], a.group_blocks)
    elif "group_keys" in h:
        cost = h["group_keys"] / float(h["meta"]["block"])
    else:
        die(f"{a.hybrid} does not hold the groups' keys (measured before they were counted): give --group-blocks")
    cost = np.where(valid, cost, 0.0)
    print(f"blocks of {b['meta']['block']}, window {b['meta']['window']}, ctx {b['meta']['ctx']}; "
          f"far probability per row {b['far'][valid].mean():.4f}, left by the groups {h['far'][valid].mean():.4f}; "
          f"groups cost {cost[valid].mean():.1f} blocks per head on average")
    print("| mean blocks | blocks alone | groups on every head | best per head (heads with groups) |")
    print("|---|---|---|---|")
    for m in a.mean:
        miss = [solve(B, H, cost, m, allow, valid)[1][valid].mean() for allow in ("blocks", "groups")]
        _, miss_best, use_b = solve(B, H, cost, m, "choose", valid)
        print(f"| {m:g} | {miss[0]:.4f} | {miss[1]:.4f} | {miss_best[valid].mean():.4f} "
              f"({int(use_b[valid].sum())} of {int(valid.sum())}) |")
    # Worth per head at the hybrid's own budget for the largest mean: the blocks-alone K that leaves
    # as little unread as the groups plus the head's hybrid K do, minus that hybrid K.
    k, miss, _ = solve(B, H, cost, max(a.mean), "groups", valid)
    kh = np.rint(k - cost).astype(int)
    worth = []
    for l, hh in zip(*np.nonzero(valid)):
        below = np.nonzero(B[l, hh] <= miss[l, hh] + 1e-12)[0]
        worth.append((below[0] if len(below) else K1) - kh[l, hh])
    worth = np.array(worth, float)
    print(f"groups worth, in blocks per head beside the hybrid's blocks at mean {max(a.mean):g}: "
          f"median {np.median(worth):.0f}, mean {worth.mean():.1f}, quartiles {np.percentile(worth, 25):.0f}"
          f"-{np.percentile(worth, 75):.0f} (cost: mean {cost[valid].mean():.1f})")


if __name__ == "__main__":
    main()
