"""GGUF files of tiny Hugging Face llama / mistral / qwen2 / gemma3 models, written the way llama.cpp's
convert_hf_to_gguf.py writes them: gguf-py's tensor map for the architecture, llama's q/k rows
permuted (LlamaModel, which MistralForCausalLM also goes through), gemma3's `1 + w` norms, and the
keys each converter sets (sliding window, rope scaling, soft-capping)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_synth import _quantized, llama_permute

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma3": gguf.MODEL_ARCH.GEMMA3}


def arch_tensors(arch: str, state: dict[str, np.ndarray], cfg: dict) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (Hugging Face name, values), as the converter changes them."""
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, t in state.items():
        hf_name = name.replace("model.language_model.", "model.")
        t = t.astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = llama_permute(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = llama_permute(t, kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        out[gname] = (hf_name, t)
    return out


def write_arch_gguf(path: Path, arch: str, state: dict[str, np.ndarray], cfg: dict, tokenizer_json: dict,
                    linear_type: Q = Q.F32, keys: dict[str, Any] | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF of architecture `arch` from a Hugging Face config dict and its tensors, with a byte-level
    vocabulary from `tokenizer_json`; `keys`: extra `{arch}.KEY` values (sliding_window, rope scaling).
    -> GGUF name -> (Hugging Face name, the values the file holds)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    for k, v in (keys or {}).items():
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        elif isinstance(v, int):
            w.add_uint32(f"{arch}.{k}", v)
        else:
            w.add_float32(f"{arch}.{k}", float(v))

    vocab = dict(tokenizer_json["model"]["vocab"])
    for added in tokenizer_json.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens: list[str | None] = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        if i < len(tokens):
            tokens[i] = t
    special = {a["id"] for a in tokenizer_json.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
    w.add_token_merges(merges)
    w.add_token_types([3 if i in special else 1 if t is not None else 5 for i, t in enumerate(tokens)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    held = arch_tensors(arch, state, cfg)
    written: dict[str, tuple[str, np.ndarray]] = {}
    for gname, (hf_name, value) in held.items():
        qtype = Q.F32 if value.ndim == 1 else linear_type
        data, values = _quantized(value, qtype)
        written[gname] = (hf_name, values)
        w.add_tensor(gname, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
