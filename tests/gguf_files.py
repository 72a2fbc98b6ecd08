"""Tiny GGUF files written on the spot with the gguf package: a Llama with random F32 weights and
the demo's byte-level BPE tokenizer (ChatML template, <|MASK|> among its special tokens), as
llama.cpp's converter lays them out; and one whose architecture transformers does not convert."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.tools.demo import CHAT_TEMPLATE, build_tokenizer, conversations

SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


def tokenizer_fields(vocab_size: int = 400):
    """(tokens, token types, merges, eos id, pad id) of the demo's tokenizer, trained on demo text."""
    texts = [m["content"] for c in conversations(200, seed=3) for m in c["messages"]]
    tok = build_tokenizer(texts, vocab_size=vocab_size).backend_tokenizer
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    types = [3 if t in special else 1 for t in tokens]  # 3: control, 1: normal (llama.cpp's)
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges, vocab["<|im_end|>"], vocab["<|endoftext|>"]


def write_llama_gguf(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (hidden 64, F32); its embedding has spare rows past the tokenizer, as real
    checkpoints round theirs up. arch: general.architecture (another name for the unsupported case)."""
    import gguf

    s = SHAPE
    tokens, types, merges, eos, pad = tokenizer_fields()
    rows = -(-len(tokens) // 64) * 64
    head_dim = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(2048)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(rows)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    w.add_pad_token_id(pad)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def add(name, *shape, scale=0.05):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", rows, s["hidden"])
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(s["hidden"], np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(s["hidden"], np.float32))
        add(f"blk.{i}.attn_q.weight", s["hidden"], s["hidden"])
        add(f"blk.{i}.attn_k.weight", s["kv_heads"] * head_dim, s["hidden"])
        add(f"blk.{i}.attn_v.weight", s["kv_heads"] * head_dim, s["hidden"])
        add(f"blk.{i}.attn_output.weight", s["hidden"], s["hidden"])
        add(f"blk.{i}.ffn_gate.weight", s["ffn"], s["hidden"])
        add(f"blk.{i}.ffn_up.weight", s["ffn"], s["hidden"])
        add(f"blk.{i}.ffn_down.weight", s["hidden"], s["ffn"])
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], np.float32))
    add("output.weight", rows, s["hidden"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
