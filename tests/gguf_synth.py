"""Tiny synthetic GGUF files written with gguf.GGUFWriter, the way llama.cpp's converter writes them
(llama q/k rows permuted, [out, in] weights quantized per row in blocks of 32)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128

# A small SentencePiece vocabulary: pieces with scores (higher merges first), bytes for the rest.
SPM_PIECES = ["▁", "e", "t", "a", "o", "h", "l", "n", "s", "r", "d", "w", "i", "c", "u", "m", "g", "y",
              "he", "th", "▁t", "▁the", "ll", "▁a", "an", "er", "in", "▁w", "or", "ld", "▁wor", "▁world",
              "▁h", "el", "▁hel", "▁hell", "▁hello", "lo", "ing", "▁s", "▁i", "▁is", "▁an", "nd", "▁and",
              "▁c", "at", "▁cat", "▁d", "og", "▁dog", "re", "ar", "▁y", "ou", "▁you", "▁m", "▁my", "▁▁", "▁▁▁▁",
              "T", "H", "I", ".", ",", "!", "?", "'", "1", "2", "3"]


@dataclass
class TinyGGUF:
    path: Path
    hf_weights: dict[str, np.ndarray]  # Hugging Face names, HF row order, values as the file holds them
    types: dict[str, Q] = field(default_factory=dict)  # HF name -> GGUF type used


def spm_vocab(user_defined: tuple[str, ...] = ("<tool>",)) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    for t in user_defined:
        tokens.append(t)
        types.append(4)
        scores.append(0.0)
    return tokens, scores, types


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    from ninfer.engine.convert.gguf_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld",
              "Ġ h", "e l", "Ġh el", "l o", "Ġhel lo", "Ċ Ċ", "Ġ Ġ"]
    tokens = chars + ["".join(m.split(" ")) for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, merges, types


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to write, the values the file then holds)."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", *, tokenizer: str = "spm", tied: bool = True,
                    linear_type: Q = Q.Q4_1, embed_type: Q = Q.Q8_0, type_overrides: dict[str, Q] | None = None,
                    rope_freqs: np.ndarray | None = None, skip: tuple[str, ...] = (), seed: int = 0) -> TinyGGUF:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if tokenizer == "spm":
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
    else:
        tokens, merges, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_pad_token_id(len(tokens) - 3)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    vocab = len(tokens)
    w.add_vocab_size(vocab)

    shapes = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, HIDDEN)),
              "output_norm.weight": ("model.norm.weight", (HIDDEN,))}
    if not tied:
        shapes["output.weight"] = ("lm_head.weight", (vocab, HIDDEN))
    per_layer = {"attn_norm": ("input_layernorm", (HIDDEN,)), "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
                 "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
                 "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                 "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                 "attn_output": ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
                 "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN)), "ffn_up": ("mlp.up_proj", (FFN, HIDDEN)),
                 "ffn_down": ("mlp.down_proj", (HIDDEN, FFN))}
    if arch == "qwen3":
        per_layer |= {"attn_q_norm": ("self_attn.q_norm", (HEAD_DIM,)), "attn_k_norm": ("self_attn.k_norm", (HEAD_DIM,))}
    for i in range(LAYERS):
        for g, (h, shape) in per_layer.items():
            shapes[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{h}.weight", shape)

    out = TinyGGUF(path, {})
    overrides = type_overrides or {}
    for gname, (hname, shape) in shapes.items():
        if gname in skip:
            continue
        value = rng.standard_normal(shape).astype(np.float32) * 0.5
        if len(shape) == 1:
            qtype = Q.F32
            value = 1.0 + 0.1 * value
        else:
            qtype = embed_type if gname in ("token_embd.weight", "output.weight") else linear_type
        qtype = overrides.get(gname, qtype)
        data, held = _quantized(value, qtype)
        if arch == "llama" and ".attn_q." in gname:
            data = llama_permute(data, HEADS)
        elif arch == "llama" and ".attn_k." in gname:
            data = llama_permute(data, KV_HEADS)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
        out.hf_weights[hname] = held
        out.types[hname] = qtype
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
