"""Write a random-weight llama GGUF of a named shape (ninfer.engine.synthetic.SHAPES) in llama.cpp's
Q4_K_M mix, or all in one type (F16, or one block type), so that ninfer and llama.cpp benchmark the
very same file:

    python scripts/synthetic_gguf.py llama-8b /tmp/llama-8b.Q4_K_M.gguf [--type q4_k_m|q4_k|q6_k|q8_0|q4_1|f16]
    ninfer bench /tmp/llama-8b.Q4_K_M.gguf --backend cuda -p 512 -n 128
    llama-bench -m /tmp/llama-8b.Q4_K_M.gguf -p 512 -n 128 -ngl 99

Blocks are random bits with their f16 scales set so that weights are of size ~0.02 (finite; the
model's output is noise, its speed is a real model's); F16 weights are normal, of size 0.02. Q4_K_M: as llama.cpp's quantize tool
assigns types (Q6_K for output.weight, or token_embd when tied, and for attn_v / ffn_down of its
`use_more_bits` layers, Q4_K elsewhere; where an input width is not a multiple of 256, Q5_0 for
Q4_K and Q8_0 for Q6_K): for smollm2-135m the same type counts as llama-quantize's Q4_K_M of the
real model (166 Q5_0, 16 Q4_K, 15 Q8_0, 14 Q6_K).
Tensors stream to the file one at a time (memory: one tensor). Tokenizer: a byte-level BPE
vocabulary padded with placeholder tokens to the shape's vocabulary size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer.engine.synthetic import SHAPES  # noqa: E402

# per type: (offset of the f16 d, mean |code product| per unit of d, offset of the min field or None,
# min / d that centres the weights)
FIELDS = {Q.Q4_K: (0, 256.0, 2, 7.5), Q.Q6_K: (208, 1024.0, None, 0.0), Q.Q5_0: (0, 8.0, None, 0.0),
          Q.Q8_0: (0, 64.0, None, 0.0), Q.Q4_1: (0, 4.0, 2, -7.5)}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}
TYPES = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0, "q4_1": Q.Q4_1, "f16": Q.F16}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(gname: str, cols: int, layers: int, kind: str, tied: bool) -> Q:
    if kind == "q4_k_m":
        qtype = Q.Q4_K
        if gname == "output.weight" or (tied and gname == "token_embd.weight"):  # tied: the output's type
            qtype = Q.Q6_K
        elif gname.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(gname.split(".")[1]), layers):
            qtype = Q.Q6_K
    else:
        qtype = TYPES[kind]
    elements = gguf.GGML_QUANT_SIZES[qtype][0]
    return FALLBACK.get(qtype, Q.Q8_0) if cols % elements else qtype


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
    if qtype == Q.F16:  # row by row: memory for one row's float32 at a time
        out = np.empty((rows, cols), dtype=np.float16)
        for r in range(0, rows, 1024):
            out[r:r + 1024] = rng.standard_normal((min(1024, rows - r), cols), dtype=np.float32) * scale
        return out.view(np.uint8)
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // elements, nbytes), dtype=np.uint8)
    d_at, unit, min_at, ratio = FIELDS[qtype]
    d = np.full((blocks.shape[0], 1), scale / unit, dtype=np.float32)
    blocks[:, d_at:d_at + 2] = d.astype(np.float16).view(np.uint8)
    if min_at is not None:
        blocks[:, min_at:min_at + 2] = (d * ratio).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    from ninfer.engine.convert.gguf_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "i n"]
    tokens = chars + ["".join(m.split(" ")) for m in merges]
    tokens += [f"<|synthetic_{i}|>" for i in range(size - len(tokens) - 2)] + ["<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (size - 2) + [3, 3]
    return tokens, types, merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=[k for k, v in SHAPES.items() if v["architecture"] == "llama"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="q4_k_m", choices=["q4_k_m", *TYPES])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c = SHAPES[args.shape]
    layers, hidden, ffn = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]
    heads, kv_heads, head_dim, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]

    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_name(f"synthetic {args.shape} {args.type}")
    w.add_block_count(layers)
    w.add_context_length(min(c["max_position_embeddings"], 8192))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-5))
    w.add_file_type({"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "f16": gguf.LlamaFileType.MOSTLY_F16}.get(
        args.type, gguf.LlamaFileType.GUESSED))
    tokens, types, merges = vocabulary(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)

    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings"):
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (hidden,), p + "attn_q.weight": (heads * head_dim, hidden),
                   p + "attn_k.weight": (kv_heads * head_dim, hidden), p + "attn_v.weight": (kv_heads * head_dim, hidden),
                   p + "attn_output.weight": (hidden, heads * head_dim), p + "ffn_norm.weight": (hidden,),
                   p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                   p + "ffn_down.weight": (hidden, ffn)}
    plan = []
    for name, shape in shapes.items():
        if len(shape) == 1:
            plan.append((name, shape, None))
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            qtype = tensor_type(name, shape[1], layers, args.type, "output.weight" not in shapes)
            elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // elements * nbytes)
            plan.append((name, shape, qtype))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, shape, qtype in plan:
        if qtype is None:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data(random_blocks(rng, qtype, *shape))
    w.close()
    counts: dict[str, int] = {}
    for _, _, qtype in plan:
        key = qtype.name if qtype is not None else "F32"
        counts[key] = counts.get(key, 0) + 1
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB, tensors by type {counts}")


if __name__ == "__main__":
    main()
