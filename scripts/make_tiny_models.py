#!/usr/bin/env python3
"""Writes small random Hugging Face style models (config.json + safetensors) for the C++ tests,
each with reference logits computed here in float64 numpy following the Hugging Face conventions.

  make_tiny_models.py OUT_DIR [--f32] [--seq-len N]

Creates
  OUT_DIR/gpt2-tiny/    GPT-2: Conv1D weights [in, out], learned positions, LayerNorm, gelu_new,
                        tied output; F32; single model.safetensors.
  OUT_DIR/llama-tiny/   Llama: q/k/v/o_proj [out, in] (not permuted), RoPE on split halves,
                        GQA 4 query / 2 kv heads, SwiGLU, untied lm_head; F16; two shards with
                        model.safetensors.index.json.
  OUT_DIR/gemma3-tiny/  Gemma 3 text: RMSNorm scaled by (1 + w), q/k RMSNorm, embeddings times
                        sqrt(hidden), 5 sliding (window 8, rope 1e4) + 1 global (rope 1e6) layers,
                        head_dim != hidden/heads, query_pre_attn_scalar != head_dim, gated GELU
                        (tanh), post-attention/post-feedforward norms, tied output; BF16.
  OUT_DIR/deepseek-v2-tiny/  DeepSeek-V2: multi-head latent attention (q_proj, kv_a_proj_with_mqa,
                        kv_a_layernorm, kv_b_proj; per head 12 + 8 RoPE query-key dims, 10 value
                        dims, latent 16), RoPE on de-interleaved pairs, dense SwiGLU MLPs; F16.
                        The reference runs the standard form (keys and values of every head).
  OUT_DIR/deepseek-v2-qlora-tiny/  the same with low-rank queries (q_a_proj, q_a_layernorm,
                        q_b_proj; q_lora_rank 24), as in the full DeepSeek-V2.
Each folder also holds reference_logits.json: {"ids": [...], "logits": [[vocab] per position],
"nll": [...], "mean_nll": x}. The logits come from the weights exactly as stored (after rounding
to the file's dtype). --f32 stores every model as F32. Output is deterministic (fixed seeds).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

# ----------------------------------------------------------------------------------------------
# safetensors writing and dtype rounding
# ----------------------------------------------------------------------------------------------

def to_bf16_bits(a):
    """float32 -> bfloat16 bits, round to nearest even."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def from_bf16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def stored(a, dtype):
    """The values a tensor has after being written as dtype (as float64), and its raw bytes."""
    a = np.asarray(a, dtype=np.float64)
    if dtype == "F32":
        s = a.astype("<f4")
        return s.astype(np.float64), s.tobytes()
    if dtype == "F16":
        s = a.astype("<f2")
        return s.astype(np.float64), s.tobytes()
    if dtype == "BF16":
        bits = to_bf16_bits(a.astype(np.float32))
        return from_bf16_bits(bits).astype(np.float64).reshape(a.shape), bits.astype("<u2").tobytes()
    raise ValueError(dtype)


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


class Builder:
    """Collects random tensors, rounds them to the storage dtype and keeps the stored values."""

    def __init__(self, seed, dtype):
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.values = {}
        self.records = []

    def add(self, name, value):
        v, raw = stored(value, self.dtype)
        self.values[name] = v
        self.records.append((name, self.dtype, v.shape, raw))
        return v

    def normal(self, name, shape, std):
        return self.add(name, self.rng.normal(0.0, std, size=shape))

    def around(self, name, shape, center, spread):
        return self.add(name, center + self.rng.uniform(-spread, spread, size=shape))

    def save(self, folder, config, shards=1):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for stale in ("model.safetensors", "model.safetensors.index.json"):
            if os.path.exists(os.path.join(folder, stale)):
                os.remove(os.path.join(folder, stale))
        meta = {"format": "pt"}
        if shards == 1:
            write_safetensors(os.path.join(folder, "model.safetensors"), self.records, meta)
            return
        per = math.ceil(len(self.records) / shards)
        weight_map = {}
        total = 0
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = self.records[s * per:(s + 1) * per]
            write_safetensors(os.path.join(folder, fname), part, meta)
            for name, _, _, raw in part:
                weight_map[name] = fname
                total += len(raw)
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")


# ----------------------------------------------------------------------------------------------
# Shared numerics (float64)
# ----------------------------------------------------------------------------------------------

def softmax_causal(scores, window=0):
    """scores [H, T, T]; key j visible from query i iff j <= i and (window == 0 or i - j < window)."""
    T = scores.shape[-1]
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    allowed = j <= i
    if window > 0:
        allowed &= (i - j) < window
    s = np.where(allowed, scores, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def rope_half(x, base):
    """Hugging Face rotate_half RoPE on x [H, T, D]: pairs (i, i + D/2), angle pos * base^(-2i/D)."""
    D = x.shape[-1]
    T = x.shape[-2]
    inv = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def attend(q, k, v, scale, window=0):
    """q [H, T, D], k/v [KV, T, D] -> [T, H*D]; query head h uses kv head h // (H/KV)."""
    H, KV = q.shape[0], k.shape[0]
    k = np.repeat(k, H // KV, axis=0)
    v = np.repeat(v, H // KV, axis=0)
    p = softmax_causal(q @ k.transpose(0, 2, 1) * scale, window)
    o = p @ v                                              # [H, T, D]
    return o.transpose(1, 0, 2).reshape(q.shape[1], -1)


def heads(x, n):
    T = x.shape[0]
    return x.reshape(T, n, -1).transpose(1, 0, 2)


# ----------------------------------------------------------------------------------------------
# GPT-2
# ----------------------------------------------------------------------------------------------

def make_gpt2(dtype):
    cfg = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": 64, "n_positions": 64, "n_ctx": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
    }
    E, V, P = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    B = Builder(1234, dtype)
    B.normal("wte.weight", (V, E), 0.5)
    B.normal("wpe.weight", (P, E), 0.3)
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        B.around(p + "ln_1.weight", (E,), 1.0, 0.2)
        B.normal(p + "ln_1.bias", (E,), 0.1)
        B.normal(p + "attn.c_attn.weight", (E, 3 * E), 0.3)      # Conv1D: [in, out]
        B.normal(p + "attn.c_attn.bias", (3 * E,), 0.1)
        B.normal(p + "attn.c_proj.weight", (E, E), 0.2)
        B.normal(p + "attn.c_proj.bias", (E,), 0.1)
        B.around(p + "ln_2.weight", (E,), 1.0, 0.2)
        B.normal(p + "ln_2.bias", (E,), 0.1)
        B.normal(p + "mlp.c_fc.weight", (E, 4 * E), 0.3)
        B.normal(p + "mlp.c_fc.bias", (4 * E,), 0.1)
        B.normal(p + "mlp.c_proj.weight", (4 * E, E), 0.15)
        B.normal(p + "mlp.c_proj.bias", (E,), 0.1)
    B.around("ln_f.weight", (E,), 1.0, 0.2)
    B.normal("ln_f.bias", (E,), 0.1)
    return cfg, B


def gpt2_forward(cfg, w, ids):
    E, H, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    T = len(ids)
    x = w["wte.weight"][ids] + w["wpe.weight"][np.arange(T)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (heads(qkv[:, j * E:(j + 1) * E], H) for j in range(3))
        a = attend(q, k, v, 1.0 / math.sqrt(E // H))
        x = x + a @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        m = gelu_tanh(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    return x @ w["wte.weight"].T


# ----------------------------------------------------------------------------------------------
# Llama
# ----------------------------------------------------------------------------------------------

def make_llama(dtype):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B = Builder(5678, dtype)
    B.normal("model.embed_tokens.weight", (V, D), 0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        B.around(p + "input_layernorm.weight", (D,), 1.0, 0.2)
        B.normal(p + "self_attn.q_proj.weight", (H * hd, D), 0.25)
        B.normal(p + "self_attn.k_proj.weight", (KV * hd, D), 0.25)
        B.normal(p + "self_attn.v_proj.weight", (KV * hd, D), 0.2)
        B.normal(p + "self_attn.o_proj.weight", (D, H * hd), 0.15)
        B.around(p + "post_attention_layernorm.weight", (D,), 1.0, 0.2)
        B.normal(p + "mlp.gate_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.up_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.down_proj.weight", (D, F), 0.15)
    B.around("model.norm.weight", (D,), 1.0, 0.2)
    B.normal("lm_head.weight", (V, D), 0.3)
    return cfg, B


def llama_forward(cfg, w, ids):
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, base = cfg["rms_norm_eps"], cfg["rope_theta"]
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rope_half(heads(h @ w[p + "self_attn.q_proj.weight"].T, H), base)
        k = rope_half(heads(h @ w[p + "self_attn.k_proj.weight"].T, KV), base)
        v = heads(h @ w[p + "self_attn.v_proj.weight"].T, KV)
        x = x + attend(q, k, v, 1.0 / math.sqrt(hd)) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


# ----------------------------------------------------------------------------------------------
# Gemma 3 (text)
# ----------------------------------------------------------------------------------------------

def make_gemma3(dtype):
    n_layer = 6
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)]
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n_layer,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
        "query_pre_attn_scalar": 32, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "sliding_window": 8, "sliding_window_pattern": 6, "layer_types": layer_types,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    }
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B = Builder(9012, dtype)
    B.normal("model.embed_tokens.weight", (V, D), 0.1)      # times sqrt(64) = 8 at the input
    for i in range(n_layer):
        p = f"model.layers.{i}."
        # Gemma norms scale by (1 + w): store w near 0 (post norms smaller, as in real checkpoints).
        B.normal(p + "input_layernorm.weight", (D,), 0.2)
        B.normal(p + "self_attn.q_proj.weight", (H * hd, D), 0.2)
        B.normal(p + "self_attn.k_proj.weight", (KV * hd, D), 0.2)
        B.normal(p + "self_attn.v_proj.weight", (KV * hd, D), 0.2)
        B.normal(p + "self_attn.o_proj.weight", (D, H * hd), 0.15)
        B.normal(p + "self_attn.q_norm.weight", (hd,), 0.3)
        B.normal(p + "self_attn.k_norm.weight", (hd,), 0.3)
        B.around(p + "post_attention_layernorm.weight", (D,), -0.5, 0.2)
        B.normal(p + "pre_feedforward_layernorm.weight", (D,), 0.2)
        B.normal(p + "mlp.gate_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.up_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.down_proj.weight", (D, F), 0.15)
        B.around(p + "post_feedforward_layernorm.weight", (D,), -0.5, 0.2)
    B.normal("model.norm.weight", (D,), 0.2)
    return cfg, B


def gemma3_forward(cfg, w, ids):
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    norm = lambda x, name: rms_norm(x, 1.0 + w[name], eps)  # noqa: E731
    emb = w["model.embed_tokens.weight"]
    x = emb[ids] * math.sqrt(cfg["hidden_size"])
    scale = cfg["query_pre_attn_scalar"] ** -0.5
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sliding = cfg["layer_types"][i] == "sliding_attention"
        base = cfg["rope_local_base_freq"] if sliding else cfg["rope_theta"]
        window = cfg["sliding_window"] if sliding else 0
        h = norm(x, p + "input_layernorm.weight")
        q = norm(heads(h @ w[p + "self_attn.q_proj.weight"].T, H), p + "self_attn.q_norm.weight")
        k = norm(heads(h @ w[p + "self_attn.k_proj.weight"].T, KV), p + "self_attn.k_norm.weight")
        v = heads(h @ w[p + "self_attn.v_proj.weight"].T, KV)
        a = attend(rope_half(q, base), rope_half(k, base), v, scale, window)
        a = a @ w[p + "self_attn.o_proj.weight"].T
        x = x + norm(a, p + "post_attention_layernorm.weight")
        h = norm(x, p + "pre_feedforward_layernorm.weight")
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        f = (gelu_tanh(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = x + norm(f, p + "post_feedforward_layernorm.weight")
    x = norm(x, "model.norm.weight")
    return x @ emb.T


# ----------------------------------------------------------------------------------------------
# DeepSeek-V2 (multi-head latent attention, dense MLPs)
# ----------------------------------------------------------------------------------------------

def make_deepseek_v2(dtype, q_lora_rank=None):
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": q_lora_rank, "kv_lora_rank": 16,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "n_routed_experts": None, "first_k_dense_replace": 2, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, C = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    N, R, Vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    B = Builder(2468, dtype)
    B.normal("model.embed_tokens.weight", (V, D), 0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        B.around(p + "input_layernorm.weight", (D,), 1.0, 0.2)
        if q_lora_rank:
            B.normal(p + "self_attn.q_a_proj.weight", (q_lora_rank, D), 0.25)
            B.around(p + "self_attn.q_a_layernorm.weight", (q_lora_rank,), 1.0, 0.2)
            B.normal(p + "self_attn.q_b_proj.weight", (H * (N + R), q_lora_rank), 0.25)
        else:
            B.normal(p + "self_attn.q_proj.weight", (H * (N + R), D), 0.25)
        B.normal(p + "self_attn.kv_a_proj_with_mqa.weight", (C + R, D), 0.25)
        B.around(p + "self_attn.kv_a_layernorm.weight", (C,), 1.0, 0.2)
        B.normal(p + "self_attn.kv_b_proj.weight", (H * (N + Vd), C), 0.25)
        B.normal(p + "self_attn.o_proj.weight", (D, H * Vd), 0.15)
        B.around(p + "post_attention_layernorm.weight", (D,), 1.0, 0.2)
        B.normal(p + "mlp.gate_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.up_proj.weight", (F, D), 0.2)
        B.normal(p + "mlp.down_proj.weight", (D, F), 0.15)
    B.around("model.norm.weight", (D,), 1.0, 0.2)
    B.normal("lm_head.weight", (V, D), 0.3)
    return cfg, B


def deinterleave(x):
    """DeepSeek-V2's modeling code before rotate_half: [.., d] -> pairs (2i, 2i+1) split into halves."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(*x.shape[:-1], d)


def deepseek_v2_forward(cfg, w, ids):
    """The standard (not absorbed) form: keys and values of every head up from the latent."""
    H, C = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    N, R, Vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    eps, base = cfg["rms_norm_eps"], cfg["rope_theta"]
    T = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        if cfg["q_lora_rank"]:                                             # queries from their own latent
            qa = rms_norm(h @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"], eps)
            q = heads(qa @ w[p + "self_attn.q_b_proj.weight"].T, H)
        else:
            q = heads(h @ w[p + "self_attn.q_proj.weight"].T, H)          # [H, T, N + R]
        q_nope, q_pe = q[..., :N], q[..., N:]
        ckv = h @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T          # [T, C + R]
        latent, k_pe = ckv[:, :C], ckv[:, C:]
        kv = heads(rms_norm(latent, w[p + "self_attn.kv_a_layernorm.weight"], eps)
                   @ w[p + "self_attn.kv_b_proj.weight"].T, H)            # [H, T, N + Vd]
        k_nope, v = kv[..., :N], kv[..., N:]
        q_pe = rope_half(deinterleave(q_pe), base)
        k_pe = rope_half(deinterleave(k_pe[None, :, :]), base)            # one RoPE key for all heads
        qh = np.concatenate([q_nope, q_pe], axis=-1)
        kh = np.concatenate([k_nope, np.repeat(k_pe, H, axis=0)], axis=-1)
        prob = softmax_causal(qh @ kh.transpose(0, 2, 1) / math.sqrt(N + R))
        o = (prob @ v).transpose(1, 0, 2).reshape(T, H * Vd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


# ----------------------------------------------------------------------------------------------

def write_reference(folder, ids, logits):
    logits = np.asarray(logits, dtype=np.float64)
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    nll = [float(lse[t] - logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    ref = {
        "ids": [int(i) for i in ids],
        "logits": [[float(v) for v in row] for row in logits],
        "nll": nll,
        "mean_nll": float(np.mean(nll)),
    }
    with open(os.path.join(folder, "reference_logits.json"), "w") as f:
        json.dump(ref, f)
        f.write("\n")
    return ref


MODELS = [
    ("gpt2-tiny", make_gpt2, gpt2_forward, "F32", 1),
    ("llama-tiny", make_llama, llama_forward, "F16", 2),
    ("gemma3-tiny", make_gemma3, gemma3_forward, "BF16", 1),
    ("deepseek-v2-tiny", make_deepseek_v2, deepseek_v2_forward, "F16", 1),
    ("deepseek-v2-qlora-tiny", lambda dtype: make_deepseek_v2(dtype, q_lora_rank=24), deepseek_v2_forward, "F16", 1),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--f32", action="store_true", help="store every model as F32")
    ap.add_argument("--seq-len", type=int, default=48, help="length of the reference sequence (<= 64)")
    args = ap.parse_args()
    if not 2 <= args.seq_len <= 64:
        ap.error("--seq-len must be in [2, 64]")
    for name, make, forward, dtype, shards in MODELS:
        cfg, builder = make("F32" if args.f32 else dtype)
        folder = os.path.join(args.out_dir, name)
        builder.save(folder, cfg, shards)
        ids = np.random.default_rng(42).integers(0, cfg["vocab_size"], size=args.seq_len)
        ref = write_reference(folder, ids, forward(cfg, builder.values, ids))
        print(f"{folder}: {builder.dtype}, {len(builder.records)} tensors, {shards} file(s), "
              f"mean NLL {ref['mean_nll']:.4f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
