#!/usr/bin/env python3
"""Independent reference tokenizations, for checking src/io/tokenizer.cpp.

Builds each tokenizer with an established library from the same vocabulary files:
  smollm2  GGUF vocab + merges -> Hugging Face `tokenizers` byte-level BPE with SmolLM2's
           pre-tokenizer (each digit alone, then the GPT-2 pattern)
  gpt2     encoder.json + vocab.bpe -> `tokenizers` byte-level BPE (GPT-2 pattern)
  llama2   tokenizer.model -> `sentencepiece`
  gemma3   GGUF pieces/scores/types -> a `sentencepiece` BPE model (byte fallback, no dummy
           prefix); user-defined pieces (newline and space runs, HTML tags) are cut out of the
           text first, as llama.cpp and Hugging Face tokenizers do

Usage:
  tokenizer_reference.py KIND [--model PATH] [--pre P] TEXT...      print ids per TEXT (JSON lines)
  tokenizer_reference.py KIND [--model PATH] [--pre P] --file F...  print the token count per file F
                                   (BOM dropped, CRLF -> LF; --ids-dir D also writes its ids)
Needs: pip install tokenizers sentencepiece protobuf gguf
"""
import argparse
import json
import os
import re
import sys

HOME = os.path.expanduser("~")
DATA = os.environ.get("FOCUS_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
CACHE = os.path.join(os.environ.get("FOCUS_CACHE", os.path.join(HOME, ".cache", "focus")), "models")
DEFAULTS = {
    "smollm2": os.path.join(CACHE, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": os.path.join(CACHE, "gemma-3-270m-q4_k_m.gguf"),
    "gpt2": os.path.join(DATA, "tokenizers", "gpt2"),
    "llama2": os.path.join(DATA, "tokenizers", "llama2-32k", "tokenizer.model"),
}


def gguf_vocab(path):
    import gguf

    r = gguf.GGUFReader(path)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def numbers(key):
        f = r.fields[key]
        return [f.parts[i].tolist()[0] for i in f.data]

    out = {"tokens": strings("tokenizer.ggml.tokens"), "types": numbers("tokenizer.ggml.token_type")}
    if "tokenizer.ggml.merges" in r.fields:
        out["merges"] = strings("tokenizer.ggml.merges")
    if "tokenizer.ggml.scores" in r.fields:
        out["scores"] = numbers("tokenizer.ggml.scores")
    return out


# Split patterns of the Llama 3 and Qwen 2 tokenizer.json files.
SPLIT_PATTERNS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def hf_byte_bpe(vocab, merges, pre):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def build_smollm2(path, pre=None):
    v = gguf_vocab(path)
    vocab = {t: i for i, t in enumerate(v["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in v["merges"]]
    return hf_byte_bpe(vocab, merges, pre or "smollm")


def build_gpt2(path, pre=None):
    with open(os.path.join(path, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(path, "vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(l.split(" ", 1)) for l in lines[1:] if l]
    return hf_byte_bpe(vocab, merges, pre or "gpt2")


def build_llama2(path, pre=None):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    return lambda text: sp.encode(text)


def build_gemma3(path, pre=None):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    v = gguf_vocab(path)
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(v["tokens"])
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    user = {}
    for t, s, ty in zip(v["tokens"], v["scores"], v["types"]):
        p = m.pieces.add()
        p.piece, p.score = t, s
        # User-defined pieces are matched outside sentencepiece (below), so give it none.
        p.type = {1: p.NORMAL, 2: p.UNKNOWN, 3: p.CONTROL, 4: p.UNUSED, 5: p.UNUSED, 6: p.BYTE}[ty]
        if ty == 4:
            user[t] = len(m.pieces) - 1
    sp = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
    # Leftmost match, longest first.
    pattern = re.compile("|".join(re.escape(u) for u in sorted(user, key=len, reverse=True)))

    def encode(text):
        ids, start = [], 0
        for hit in pattern.finditer(text):
            if hit.start() > start:
                ids += sp.encode(text[start:hit.start()])
            ids.append(user[hit.group()])
            start = hit.end()
        if start < len(text):
            ids += sp.encode(text[start:])
        return ids

    return encode


def read_text(path):
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return raw.replace(b"\r\n", b"\n").decode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(DEFAULTS))
    ap.add_argument("--model", help="vocabulary file or folder (default: the project's usual location)")
    ap.add_argument("--pre", choices=["gpt2", "smollm", "llama3", "qwen2"],
                    help="byte-level kinds: use this pre-tokenizer instead of the vocabulary's own")
    ap.add_argument("--file", action="store_true", help="arguments are text files")
    ap.add_argument("--ids-dir", help="with --file: write each file's ids (one per line) here")
    ap.add_argument("texts", nargs="+")
    a = ap.parse_args()
    encode = globals()["build_" + a.kind](a.model or DEFAULTS[a.kind], a.pre)
    for t in a.texts:
        if a.file:
            ids = encode(read_text(t))
            print(json.dumps({"file": os.path.basename(t), "count": len(ids)}))
            if a.ids_dir:
                with open(os.path.join(a.ids_dir, os.path.basename(t) + ".ids"), "w") as f:
                    f.write("\n".join(map(str, ids)) + "\n")
        else:
            print(json.dumps({"text": t, "ids": encode(t)}, ensure_ascii=False))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
