#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses into fuzz/corpus/<harness>/: small valid files of
each format (tiny models, vocabularies, router and adapter folders, checkpoints, task files) and a
few near-valid ones (truncated, one field changed). Standard library only; deterministic.

    python3 fuzz/make_seeds.py            # rewrites fuzz/corpus
"""
import json
import os
import random
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
SEP = b"\n=====\n"  # part separator of the multi-file harnesses (fuzz/fuzz_util.h)
rng = random.Random(1234)


def put(harness, name, data):
    d = os.path.join(OUT, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(n, scale=0.1):
    return [rng.uniform(-scale, scale) for _ in range(n)]


# ---------------------------------------------------------------- GGUF
def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(v):
    """(type id, bytes) of a metadata value: str, bool, int (int32 / uint64 by sign), float, lists."""
    if isinstance(v, bool):
        return 7, struct.pack("<B", v)
    if isinstance(v, int):
        return (5, struct.pack("<i", v)) if -2**31 <= v < 2**31 else (10, struct.pack("<Q", v))
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, gguf_str(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return 9, struct.pack("<IQ", 8, len(v)) + b"".join(gguf_str(x) for x in v)
        if all(isinstance(x, float) for x in v):
            return 9, struct.pack("<IQ", 6, len(v)) + b"".join(struct.pack("<f", x) for x in v)
        return 9, struct.pack("<IQ", 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    raise TypeError(v)


def f16(x):
    return struct.pack("<e", x)


def encode_tensor(kind, n):
    """Bytes of n elements of a GGML type: 0 F32, 1 F16, 8 Q8_0, 2 Q4_0, 30 BF16."""
    if kind == 0:
        return struct.pack("<%df" % n, *floats(n))
    if kind == 1:
        return b"".join(f16(x) for x in floats(n))
    if kind == 30:
        return b"".join(struct.pack("<f", x)[2:] for x in floats(n))
    if kind == 8:
        return b"".join(f16(0.01) + bytes(rng.randrange(256) for _ in range(32)) for _ in range(n // 32))
    if kind == 2:
        return b"".join(f16(0.01) + bytes(rng.randrange(256) for _ in range(16)) for _ in range(n // 32))
    raise ValueError(kind)


def gguf_file(kv, tensors, align=32):
    """tensors: list of (name, ne list, type id)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, v in kv.items():
        t, b = gguf_value(v)
        out += gguf_str(k) + struct.pack("<I", t) + b
    blobs, off = [], 0
    for name, ne, ty in tensors:
        n = 1
        for d in ne:
            n *= d
        blob = encode_tensor(ty, n)
        out += gguf_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ty, off)
        pad = (-len(blob)) % align
        blobs.append(blob + bytes(pad))
        off += len(blob) + pad
    out += bytes((-len(out)) % align)
    return out + b"".join(blobs)


def spm_vocab(extra=("▁", "e", "t", "h", "▁t", "he", "▁the", "a", "n", "an", "▁a")):
    toks = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + list(extra)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i + 1) for i in range(len(extra))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(extra)
    return toks, scores, types


def byte_token(b):
    keep = (33 <= b <= 126) or (0xA1 <= b <= 0xAC) or (0xAE <= b <= 0xFF)
    if keep:
        return chr(b)
    n = sum(1 for i in range(b) if not ((33 <= i <= 126) or (0xA1 <= i <= 0xAC) or (0xAE <= i <= 0xFF)))
    return chr(256 + n)


def gpt2_vocab():
    toks = [byte_token(b) for b in range(256)]
    merges = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        toks.append(a + b)
    toks.append("<|endoftext|>")
    return toks, ["%s %s" % m for m in merges]


def llama_gguf(types=(0, 8, 2, 1), gemma=False, gpt2_tok=False):
    D, F, L, H, KV = 32, 64, 1, 4, 2
    hd = D // H
    arch = "gemma3" if gemma else "llama"
    if gpt2_tok:
        toks, merges = gpt2_vocab()
        tok_kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": toks, "tokenizer.ggml.merges": merges,
                  "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.bos_token_id": len(toks) - 1,
                  "tokenizer.ggml.eos_token_id": len(toks) - 1}
    else:
        toks, scores, ttypes = spm_vocab()
        tok_kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks, "tokenizer.ggml.scores": scores,
                  "tokenizer.ggml.token_type": ttypes, "tokenizer.ggml.bos_token_id": 1,
                  "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    V = len(toks)
    kv = {"general.architecture": arch, "general.alignment": 32, arch + ".embedding_length": D,
          arch + ".block_count": L, arch + ".attention.head_count": H, arch + ".attention.head_count_kv": KV,
          arch + ".feed_forward_length": F, arch + ".context_length": 64,
          arch + ".attention.layer_norm_rms_epsilon": 1e-5, arch + ".rope.freq_base": 10000.0}
    if gemma:
        kv[arch + ".attention.sliding_window"] = 4
        kv[arch + ".attention.key_length"] = hd
    kv.update(tok_kv)
    emb, mt, mt2, vec = types
    t = [("token_embd.weight", [D, V], emb), ("output_norm.weight", [D], 0)]
    for l in range(L):
        p = "blk.%d." % l
        t += [(p + "attn_norm.weight", [D], 0), (p + "attn_q.weight", [D, H * hd], mt),
              (p + "attn_k.weight", [D, KV * hd], mt2), (p + "attn_v.weight", [D, KV * hd], mt),
              (p + "attn_output.weight", [H * hd, D], mt2), (p + "ffn_norm.weight", [D], vec if vec in (0,) else 0),
              (p + "ffn_gate.weight", [D, F], mt), (p + "ffn_up.weight", [D, F], vec), (p + "ffn_down.weight", [F, D], mt2)]
        if gemma:
            t += [(p + "attn_q_norm.weight", [hd], 0), (p + "attn_k_norm.weight", [hd], 0),
                  (p + "post_attention_norm.weight", [D], 0), (p + "post_ffw_norm.weight", [D], 0)]
    return gguf_file(kv, t)


def seeds_gguf():
    a = llama_gguf()
    put("fuzz_gguf", "llama_mixed.gguf", a)
    put("fuzz_gguf", "gemma3_f16.gguf", llama_gguf(types=(1, 1, 30, 1), gemma=True))
    put("fuzz_gguf", "llama_gpt2_tok.gguf", llama_gguf(types=(0, 0, 0, 0), gpt2_tok=True))
    put("fuzz_gguf", "truncated.gguf", a[: len(a) // 2])
    put("fuzz_gguf", "metadata_only.gguf", gguf_file({"general.architecture": "llama", "x.arr": [1, 2, 3],
                                                       "x.f": [0.5, 1.5], "x.b": True, "x.big": 2**40}, []))


# ---------------------------------------------------------------- dequantize
def seeds_dequant():
    sizes = {0: 4, 1: 2, 2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 9: 36, 10: 84, 11: 110, 12: 144, 13: 176, 14: 210,
             15: 292, 24: 1, 25: 2, 26: 4, 27: 8, 28: 8, 30: 2}
    for t, bb in sizes.items():
        blk = bytearray(rng.randrange(256) for _ in range(bb * 2))
        if bb >= 18:  # a sane f16 scale at the start of each block
            for o in (0, bb):
                blk[o:o + 2] = f16(0.02)
        put("fuzz_dequant", "type%02d" % t, bytes([t]) + bytes(blk))


# ---------------------------------------------------------------- safetensors
def st_file(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, off, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dt, shape, raw in tensors:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def f32(vals):
    return struct.pack("<%df" % len(vals), *vals)


def seeds_safetensors():
    t = [("a", "F32", [2, 3], f32(floats(6))), ("b", "F16", [4], b"".join(f16(x) for x in floats(4))),
         ("c", "BF16", [2, 2], b"".join(struct.pack("<f", x)[2:] for x in floats(4))),
         ("d", "I64", [2], struct.pack("<qq", 1, 2)), ("e", "F32", [0], b"")]
    s = st_file(t, {"format": "pt"})
    put("fuzz_safetensors", "mixed.safetensors", s)
    put("fuzz_safetensors", "empty.safetensors", st_file([]))
    put("fuzz_safetensors", "truncated.safetensors", s[:-5])


def hf_config(model_type="llama", **kw):
    c = {"model_type": model_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    c.update(kw)
    return c


def hf_llama_tensors(V=16, D=32, F=64, KV=2, hd=8, H=4, dtype="F32"):
    def raw(n):
        return f32(floats(n)) if dtype == "F32" else b"".join(struct.pack("<f", x)[2:] for x in floats(n))
    t = [("model.embed_tokens.weight", [V, D]), ("model.norm.weight", [D])]
    p = "model.layers.0."
    t += [(p + "input_layernorm.weight", [D]), (p + "self_attn.q_proj.weight", [H * hd, D]),
          (p + "self_attn.k_proj.weight", [KV * hd, D]), (p + "self_attn.v_proj.weight", [KV * hd, D]),
          (p + "self_attn.o_proj.weight", [D, H * hd]), (p + "post_attention_layernorm.weight", [D]),
          (p + "mlp.gate_proj.weight", [F, D]), (p + "mlp.up_proj.weight", [F, D]), (p + "mlp.down_proj.weight", [D, F])]
    out = []
    for name, shape in t:
        n = 1
        for d in shape:
            n *= d
        out.append((name, dtype, shape, raw(n)))
    return out


def seeds_safetensors_dir():
    cfg = json.dumps(hf_config()).encode()
    tensors = hf_llama_tensors()
    single = st_file(tensors, {"format": "pt"})
    put("fuzz_safetensors_dir", "single", cfg + SEP + b"" + SEP + single)
    half = len(tensors) // 2
    s1, s2 = st_file(tensors[:half]), st_file(tensors[half:])
    wm = {n: "model-00001-of-00002.safetensors" for n, *_ in tensors[:half]}
    wm.update({n: "model-00002-of-00002.safetensors" for n, *_ in tensors[half:]})
    idx = json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}).encode()
    put("fuzz_safetensors_dir", "sharded", cfg + SEP + idx + SEP + s1 + SEP + s2)
    put("fuzz_safetensors_dir", "bf16", cfg + SEP + b"" + SEP + st_file(hf_llama_tensors(dtype="BF16")))
    gpt2 = json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 16,
                       "n_positions": 64}).encode()
    put("fuzz_safetensors_dir", "gpt2_config_wrong_tensors", gpt2 + SEP + b"" + SEP + single)


# ---------------------------------------------------------------- llama2.c
def seeds_llama2c():
    D, F, L, H, KV, V, T = 8, 16, 1, 2, 1, 8, 4
    hd = D // H
    n = V * D + L * D + L * D * D + 2 * L * KV * hd * D + L * D * D + L * D + 3 * L * F * D + D + T * hd
    model = struct.pack("<7i", D, F, L, H, KV, V, T) + f32(floats(n))
    put("fuzz_llama2c", "model.bin", b"\x00\x00" + model)
    put("fuzz_llama2c", "model_untied.bin", b"\x00\x00" + struct.pack("<7i", D, F, L, H, KV, -V, T) + f32(floats(n + V * D)))
    put("fuzz_llama2c", "model_truncated.bin", b"\x00\x00" + model[:-9])
    toks, scores, _ = spm_vocab()
    toks = [t.replace("<s>", "\n<s>\n").replace("</s>", "\n</s>\n") for t in toks]
    tb = struct.pack("<i", max(len(t.encode()) for t in toks))
    for t, s in zip(toks, scores):
        b = t.encode()
        tb += struct.pack("<fi", s, len(b)) + b
    put("fuzz_llama2c", "tokenizer_all.bin", b"\x01\x00" + tb)
    put("fuzz_llama2c", "tokenizer_first_100.bin", b"\x01" + bytes([128 + 100]) + tb)
    put("fuzz_llama2c", "tokenizer_truncated.bin", b"\x01\x00" + tb[:300])


# ---------------------------------------------------------------- GPT-2 / HF tokenizer files
def seeds_bpe():
    toks, merges = gpt2_vocab()
    vocab = json.dumps({t: i for i, t in enumerate(toks)}, ensure_ascii=False).encode()
    mtxt = ("#version: 0.2\n" + "\n".join(merges) + "\n").encode()
    put("fuzz_bpe_files", "gpt2_files", b"\x00" + vocab + SEP + mtxt)
    put("fuzz_bpe_files", "gpt2_files_bad_merge", b"\x00" + vocab + SEP + b"#version: 0.2\nq z\n")
    hf = {"version": "1.0", "added_tokens": [{"id": len(toks) - 1, "content": "<|endoftext|>", "special": True}],
          "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
          "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(toks)}, "merges": merges}}
    put("fuzz_bpe_files", "tokenizer.json", b"\x01" + json.dumps(hf, ensure_ascii=False).encode())
    hf["model"]["merges"] = [m.split(" ") for m in merges]
    put("fuzz_bpe_files", "tokenizer_pair_merges.json", b"\x01" + json.dumps(hf, ensure_ascii=False).encode())


# ---------------------------------------------------------------- router and LoRA folders
def router_folder(gemma=False, asym=False, learn_tau=False, groups=4, dg=4):
    layers = [1] if gemma else [0, 1, 2]
    j = {"format": "focus-router", "window": 8, "sinks": 1, "groups": groups, "dg": dg, "topk": 1, "tau": 0.1,
         "eps": 1e-6, "learn_tau": learn_tau, "mode": "hard" if asym else "soft",
         "routing": "asymmetric" if asym else "symmetric", "model_dim": 32, "model_layers": 3, "layers": layers}
    if asym:
        j["far_mass"] = [0.3] * len(layers)
    t = []
    for l in layers:
        p = "layers.%d." % l
        t += [(p + "w_r", "F32", [dg, 32], f32(floats(dg * 32))), (p + "centroids", "F32", [groups, dg], f32(floats(groups * dg))),
              (p + "bias", "F32", [groups], f32([0.0] * groups)), (p + "log_tau", "F32", [1], f32([-2.3]))]
        if asym:
            t.append((p + "w_k", "F32", [dg, 32], f32(floats(dg * 32))))
    return json.dumps(j).encode() + SEP + st_file(t)


def lora_folder(rank=2, targets="qv"):
    dims = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32)}  # in, out
    layers = [0, 1, 2]
    j = {"format": "focus-lora", "rank": rank, "alpha": 2.0 * rank, "targets": targets, "model_dim": 32,
         "model_layers": 3, "model_q_dim": 32, "model_kv_dim": 16, "layers": layers}
    t = []
    for l in layers:
        for tg in targets:
            i, o = dims[tg]
            p = "layers.%d.%s." % (l, tg)
            t += [(p + "lora_a", "F32", [rank, i], f32(floats(rank * i))), (p + "lora_b", "F32", [o, rank], f32(floats(o * rank)))]
    return json.dumps(j).encode() + SEP + st_file(t)


def seeds_folders():
    put("fuzz_router_folder", "llama_symmetric", b"\x00" + router_folder())
    put("fuzz_router_folder", "llama_asymmetric", b"\x00" + router_folder(asym=True, learn_tau=True))
    put("fuzz_router_folder", "gemma_layer1", b"\x01" + router_folder(gemma=True))
    put("fuzz_router_folder", "gemma_wrong_layers", b"\x01" + router_folder())
    put("fuzz_lora_folder", "llama_qv", b"\x00" + lora_folder())
    put("fuzz_lora_folder", "gemma_qkvo_r1", b"\x01" + lora_folder(rank=1, targets="qkvo"))
    put("fuzz_lora_folder", "rank_mismatch", b"\x00" + lora_folder(rank=2).replace(b'"rank": 2', b'"rank": 3'))


# ---------------------------------------------------------------- training checkpoints
def seeds_checkpoint():
    def ck(step, adam_t, extra=True, identity=None, far=(0.2, 0.3)):
        meta = {"step": step, "adam_t": adam_t, "train_tokens": 100, "seconds": 1.5, "before": {"nll": 3.0},
                "identity": identity if identity is not None else {"fuzz": 1}, "far_mass": list(far),
                "balance_load": [[0.5, 0.5]]}
        t = [("a.params", "F32", [6], f32(floats(6))), ("b.params", "F32", [4], f32(floats(4)))]
        if adam_t > 0:
            t += [("a.adam_m", "F32", [6], f32(floats(6))), ("a.adam_v", "F32", [6], f32([0.01] * 6)),
                  ("b.adam_m", "F32", [4], f32(floats(4))), ("b.adam_v", "F32", [4], f32([0.01] * 4))]
        if extra:
            t.append(("extra", "F32", [3], f32(floats(3))))
        return st_file(t, {"focus_checkpoint": json.dumps(meta)})
    put("fuzz_checkpoint", "step0", ck(0, 0))
    put("fuzz_checkpoint", "adam", ck(0, 3))
    put("fuzz_checkpoint", "no_extra", ck(0, 1, extra=False))
    put("fuzz_checkpoint", "other_identity", ck(0, 0, identity={"fuzz": 2}))


# ---------------------------------------------------------------- task files
def seeds_tasks():
    hs = "A man is sitting on a roof. he\n2\nis using wrap.\nis ripping.\nis holding a rope.\nstarts pulling.\n"
    put("fuzz_tasks", "hellaswag.txt", b"\x00" + (hs * 2).encode())
    tq = [{"question": "What is 2+2?", "mc1_targets": {"4": 1, "5": 0}, "mc2_targets": {"4": 1, "four": 1, "5": 0}}]
    put("fuzz_tasks", "truthfulqa_mc1.json", b"\x01" + json.dumps(tq).encode())
    put("fuzz_tasks", "truthfulqa_mc2.json", b"\x02" + json.dumps(tq).encode())
    arc = [{"query": "Question: Which is a metal?", "choices": ["iron", "wood", "glass"], "gold": 0},
           {"query": "Question: Sky colour?", "choices": ["blue", "green"], "gold": 1}]
    put("fuzz_tasks", "arc.jsonl", b"\x03" + "\n".join(json.dumps(x) for x in arc).encode() + b"\n")
    wg = [{"context_options": ["Sarah was a better cook than Maria, so Sarah", "Sarah was a better cook than Maria, so Maria"],
           "continuation": "made the dinner.", "gold": 0}]
    put("fuzz_tasks", "winogrande.jsonl", b"\x04" + "\n".join(json.dumps(x) for x in wg).encode() + b"\n")
    put("fuzz_tasks", "hellaswag_bad_gold.txt", b"\x00" + hs.replace("\n2\n", "\n7\n").encode())


# ---------------------------------------------------------------- text
def seeds_text():
    put("fuzz_text", "plain.txt", "The quick brown fox jumps over the lazy dog.\n")
    put("fuzz_text", "bom_crlf.txt", b"\xef\xbb\xbfLine one\r\nLine two\r\n\r\nCaf\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80\r\n")
    put("fuzz_text", "gutenberg.txt", "Header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nBody text.\n"
                                      "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nLicense\n")
    put("fuzz_text", "spaces_digits.txt", "  a  \t\tb 12345678 it's we'll  \n\n\n  x")
    put("fuzz_text", "invalid_utf8.txt", b"abc\xff\xfe def \xc3")


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    seeds_gguf()
    seeds_dequant()
    seeds_safetensors()
    seeds_safetensors_dir()
    seeds_llama2c()
    seeds_bpe()
    seeds_folders()
    seeds_checkpoint()
    seeds_tasks()
    seeds_text()
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print("wrote %s (%d bytes)" % (OUT, total))


if __name__ == "__main__":
    main()
