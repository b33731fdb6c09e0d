#!/usr/bin/env python3
"""Write a reference summary of a GGUF file, computed with the `gguf` package and numpy.

Usage: python3 scripts/gguf_reference.py MODEL.gguf OUT.json

The JSON holds:
  version, alignment, data_offset (absolute file offset of the data section),
  metadata: every key/value pair in file order. Floats are given as their IEEE bit patterns
            (uint32 for FLOAT32, uint64 for FLOAT64) and strings as hex of their bytes, so
            the comparison can be exact.
  tensors:  for every tensor: name, type id, type name, shape (ggml order, ne[0] first),
            offset (relative to the data section), n_elements, and samples of the values
            dequantised by gguf.quants.dequantize, as float32 bit patterns:
            first (up to 256 elements), middle (up to 256 starting at middle_start),
            last (up to 256 ending at the last element); plus the float64 sum and sum of
            absolute values of all elements (null when not finite).
"""
import json
import math
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

SAMPLE = 256
HEADER_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}

# Plain types the gguf package stores as typed numpy arrays rather than bytes.
PLAIN = {
    GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
    GGMLQuantizationType.I32, GGMLQuantizationType.I64,
}


def scalar_json(vtype, arr):
    """One metadata scalar (a 1-element numpy array) as an exact JSON value."""
    if vtype == GGUFValueType.FLOAT32:
        return int(arr.view(np.uint32)[0])
    if vtype == GGUFValueType.FLOAT64:
        return int(arr.view(np.uint64)[0])
    if vtype == GGUFValueType.BOOL:
        return int(bool(arr[0]))
    return int(arr[0])


def field_json(field):
    vtype = field.types[0]
    out = {"key": field.name, "type": vtype.name}
    if vtype == GGUFValueType.STRING:
        out["value"] = bytes(field.parts[field.data[0]]).hex()
    elif vtype == GGUFValueType.ARRAY:
        elem = field.types[1] if len(field.types) > 1 else None
        # An empty array carries its element type in the first part.
        if elem is None:
            elem = GGUFValueType(int(field.parts[3][0]))
        out["elem"] = elem.name
        if elem == GGUFValueType.STRING:
            out["values"] = [bytes(field.parts[i]).hex() for i in field.data]
        elif elem == GGUFValueType.ARRAY:
            raise SystemExit(f"{field.name}: nested arrays are not handled")
        else:
            out["values"] = [scalar_json(elem, field.parts[i]) for i in field.data]
    else:
        out["value"] = scalar_json(vtype, field.parts[field.data[0]])
    return out


def bits(x):
    return [int(v) for v in np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)]


def finite_or_none(v):
    v = float(v)
    return v if math.isfinite(v) else None


def dequantize_rows(t, ttype, rows):
    """Values of a range of rows (ne[0] elements each) as a flat float32 array."""
    data = np.asarray(t.data)
    data = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    part = data[rows]
    if ttype in PLAIN:
        values = part.astype(np.float32)
    else:
        values = dequantize(part, ttype)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


def tensor_json(t):
    ttype = GGMLQuantizationType(int(t.tensor_type))
    n = int(t.n_elements)
    shape = [int(d) for d in t.field.parts[3]]
    row = shape[0] if shape and shape[0] > 0 else 1
    n_rows = n // row if n else 0
    # Dequantise in chunks of rows to bound memory; keep the full values only when small.
    chunk_rows = max(1, (1 << 22) // row)
    total = 0.0
    abs_total = 0.0
    k = min(SAMPLE, n)
    mid = max(0, n // 2 - SAMPLE // 2)
    first, middle, last = [], [], []
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(n_rows, r0 + chunk_rows)
        v = dequantize_rows(t, ttype, slice(r0, r1))
        e0, e1 = r0 * row, r1 * row
        assert v.size == e1 - e0, (t.name, v.size, e1 - e0)
        total += float(np.sum(v, dtype=np.float64))
        abs_total += float(np.sum(np.abs(v), dtype=np.float64))
        # Collect the samples that fall inside this chunk.
        for lst, a, b in ((first, 0, k), (middle, mid, mid + min(SAMPLE, n - mid)), (last, n - k, n)):
            lo, hi = max(a, e0), min(b, e1)
            if lo < hi:
                lst.extend(bits(v[lo - e0:hi - e0]))
    return {
        "name": t.name,
        "type": int(ttype),
        "type_name": ttype.name,
        "shape": shape,
        "offset": int(t.field.parts[5][0]),
        "n_elements": n,
        "first": first,
        "middle_start": mid,
        "middle": middle,
        "last": last,
        "sum": finite_or_none(total),
        "abs_sum": finite_or_none(abs_total),
    }


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: gguf_reference.py MODEL.gguf OUT.json")
    src, dst = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    ref = {
        "file": os.path.abspath(src),
        "version": int(reader.fields["GGUF.version"].parts[0][0]),
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
        "metadata": [field_json(f) for name, f in reader.fields.items() if name not in HEADER_FIELDS],
        "tensors": [tensor_json(t) for t in reader.tensors],
    }
    # Write beside the destination and rename, so a concurrent reader never sees half a file.
    tmp = f"{dst}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(ref, f, separators=(",", ":"))
    os.replace(tmp, dst)


if __name__ == "__main__":
    main()
