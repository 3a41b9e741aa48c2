"""Tiny synthetic GGUF files written with gguf.GGUFWriter, the way llama.cpp's converter writes them
(llama q/k rows permuted, [out, in] weights quantized per row in blocks of 32; qwen35 from a Hugging
Face Qwen3.5 model with convert_hf_to_gguf.py's tensor changes and keys)."""
from __future__ import annotations

import zlib
from collections.abc import Callable
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


# llama.cpp block types gguf-py cannot quantize, for random_blocks: (offset of the f16 d, mean |code
# product| per unit of d, offset of the f16 min field or None, min / d that centres the weights).
BLOCK_FIELDS = {
    Q.Q4_K: (0, 256.0, 2, 7.5), Q.Q5_K: (0, 512.0, 2, 15.5), Q.Q6_K: (208, 1024.0, None, 0.0),
    Q.Q2_K: (80, 12.0, 82, 1.5), Q.Q3_K: (108, 32.0, None, 0.0), Q.IQ4_NL: (0, 60.0, None, 0.0),
    Q.IQ4_XS: (0, 960.0, None, 0.0), Q.Q5_0: (0, 8.0, None, 0.0), Q.Q5_1: (0, 8.0, 2, -15.5),
}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, scale: float = 0.5) -> np.ndarray:
    """[rows, cols / QK * bytes] uint8 blocks of `qtype`: random bits, the f16 fields (d, and dmin or
    m) set so that weights are of size ~`scale` and roughly centred (always finite)."""
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // elements, nbytes), dtype=np.uint8)
    d_at, unit, min_at, ratio = BLOCK_FIELDS.get(qtype, (0, 1.0, None, 0.0))  # others: d first, as most
    d = scale / unit * rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1))
    blocks[:, d_at:d_at + 2] = d.astype(np.float16).view(np.uint8)
    if min_at is not None:
        blocks[:, min_at:min_at + 2] = (d * ratio * rng.uniform(0.8, 1.2, size=d.shape)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _quantized(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to write, the values the file then holds)."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    try:
        data = gguf.quants.quantize(w.astype(np.float32), qtype)
    except NotImplementedError:  # K-quants, IQ4: random blocks of w's size (w's values are random anyway)
        data = random_blocks(np.random.default_rng(zlib.crc32(w.tobytes())), qtype, *w.shape,
                             scale=float(np.abs(w).mean()))
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", *, tokenizer: str = "spm", tied: bool = True,
                    linear_type: Q = Q.Q4_1, embed_type: Q = Q.Q8_0, type_overrides: dict[str, Q] | None = None,
                    rope_freqs: np.ndarray | None = None, skip: tuple[str, ...] = (), seed: int = 0,
                    hidden: int = HIDDEN, ffn: int = FFN, head_dim: int = HEAD_DIM,
                    weight_scale: float = 0.5) -> TinyGGUF:
    """type_overrides: GGUF tensor name, or a per-layer name without `blk.N.` (e.g. "attn_v.weight"),
    -> its GGUF type. K-quant types need hidden, ffn and HEADS * head_dim multiples of 256."""
    HIDDEN, FFN, HEAD_DIM = hidden, ffn, head_dim  # noqa: N806 - the module defaults, overridden
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
        value = rng.standard_normal(shape).astype(np.float32) * weight_scale
        if len(shape) == 1:
            qtype = Q.F32
            value = 1.0 + 0.1 * value
        else:
            qtype = embed_type if gname in ("token_embd.weight", "output.weight") else linear_type
        qtype = overrides.get(gname, overrides.get(gname.split(".", 2)[-1] if gname.startswith("blk.") else gname, qtype))
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


# ---- qwen35 (Qwen3.5), as llama.cpp's convert_hf_to_gguf.py writes it ------------------------------

def reorder_v_heads(w: np.ndarray, axis: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by
    key head -> tiled. With num_k_heads and num_v_per_k swapped it is its own inverse."""
    shape = list(w.shape)
    w = w.reshape(shape[:axis] + [num_k_heads, num_v_per_k, head_dim] + shape[axis + 1:])
    return np.swapaxes(w, axis, axis + 1).reshape(shape)


def qwen35_gguf_tensors(state: dict[str, np.ndarray], cfg: dict) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (Hugging Face text-model name, values), from Hugging Face tensors (multimodal names
    included), doing what Qwen3_5TextModel.modify_tensors does: skip mtp.* and the vision tower, drop
    `language_model.`, reorder value heads when there are more of them than key heads, A_log ->
    -exp(A_log), dt_bias -> dt_proj.bias, squeeze the conv taps, add 1 to every norm but the gated
    one, then gguf-py's QWEN35 tensor map."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg["num_hidden_layers"])
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, t in state.items():
        if name.startswith("mtp") or name.startswith("model.visual"):
            continue
        name = hf_name = name.replace("language_model.", "")
        t = t.astype(np.float32)
        if r > 1 and "linear_attn." in name:
            if ".in_proj_qkv." in name:
                t = np.concatenate([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, nk, r, dv)])
            elif ".in_proj_z." in name:
                t = reorder_v_heads(t, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
                t = reorder_v_heads(t, 0, nk, r, 1)
            elif ".conv1d" in name:
                t = t.squeeze()
                t = np.concatenate([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, nk, r, dv)])
            elif ".out_proj." in name:
                t = reorder_v_heads(t, 1, nk, r, dv)
        if name.endswith(".A_log"):
            t = -np.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        out[gname] = (hf_name, t)
    return out


def add_model_keys(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The shape keys every decoder GGUF carries, from a Hugging Face config dict."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])


def add_byte_level_vocab(w: gguf.GGUFWriter, tokenizer_json: dict, vocab_size: int, pre: str, bos: int,
                         eos: int) -> None:
    """A gpt2-style (byte-level BPE) vocabulary from a tokenizer.json dict, padded to vocab_size."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    for added in tokenizer_json.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens: list[str | None] = [None] * vocab_size
    for t, i in vocab.items():
        if i < len(tokens):
            tokens[i] = t
    special = {a["id"] for a in tokenizer_json.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
    w.add_token_merges(merges)
    w.add_token_types([3 if i in special else 1 if t is not None else 5 for i, t in enumerate(tokens)])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)


def write_tensors(w: gguf.GGUFWriter, tensors: dict[str, tuple[str, np.ndarray]],
                  qtype_of: Callable[[str, np.ndarray], Q]) -> dict[str, tuple[str, np.ndarray]]:
    """Writes each GGUF name -> (Hugging Face name, values) in the type qtype_of(name, values) gives,
    then the whole file, and closes it. -> GGUF name -> (Hugging Face name, the values the file holds)."""
    held: dict[str, tuple[str, np.ndarray]] = {}
    for gname, (hf_name, value) in tensors.items():
        qtype = qtype_of(gname, value)
        data, values = _quantized(value, qtype)
        held[gname] = (hf_name, values)
        w.add_tensor(gname, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_qwen35_gguf(path: Path, state: dict[str, np.ndarray], cfg: dict, tokenizer_json: dict,
                      linear_type: Q = Q.F32, embed_type: Q = Q.F32) -> dict[str, np.ndarray]:
    """A qwen35 GGUF of a Hugging Face Qwen3.5 text config `cfg` and its tensors `state`, with the keys
    Qwen3NextModel.set_gguf_parameters writes and the byte-level vocabulary of `tokenizer_json` (a
    tokenizer.json dict). -> GGUF name -> (Hugging Face name, the values the file holds, dequantized)."""
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_name("tiny qwen3.5")
    add_model_keys(w, cfg)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"].get("partial_rotary_factor", 0.25)))
    add_byte_level_vocab(w, tokenizer_json, cfg["vocab_size"], "qwen35", cfg["bos_token_id"], cfg["eos_token_id"])

    def qtype_of(gname: str, value: np.ndarray) -> Q:
        if value.ndim == 1 or ".ssm_conv1d." in gname:
            return Q.F32  # llama.cpp keeps 1-D tensors and the conv taps in F32
        return embed_type if gname in ("token_embd.weight", "output.weight") else linear_type

    return write_tensors(w, qwen35_gguf_tensors(state, cfg), qtype_of)
