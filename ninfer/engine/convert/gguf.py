"""GGUF (llama.cpp) -> .ninfer: config from the `{arch}.*` keys, tokenizer rebuilt from
`tokenizer.ggml.*`, weights renamed to Hugging Face names and repacked without loss.

GGUF blocks of 32 elements (row-major along the input dimension):
  Q8_0: f16 d, 32 x int8 q                          w = q * d
  Q4_0: f16 d, 16 bytes: byte j = q[j] | q[j+16]<<4  w = (q - 8) * d
  Q4_1: f16 d, f16 m, 16 bytes as Q4_0               w = q * d + m
They map onto quant.py's int8 / int4 symmetric / int4 asymmetric group-32 layouts; only the nibble
order differs (ours: byte j = q[2j] | q[2j+1]<<4). The other block formats ninfer keeps (Q4_K, Q5_K,
Q6_K, Q2_K, Q3_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS: quant_blocks.py) are stored byte for byte.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ninfer.engine.artifact import ArtifactMetadata, SpecialTokens, write_artifact
from ninfer.engine.config import ModelConfig
from ninfer.engine.convert.common import (check_weights_mode, encode_weight, float_format, progress_bar,
                                          sha256_file, stop_token_ids)
from ninfer.engine.convert.gguf_reader import GGUFFile, GGUFTensor
from ninfer.engine.convert.gguf_tokenizer import GGUFVocab, build_tokenizer_json
from ninfer.engine.models import ARCHITECTURES, Architecture, expected_weights
from ninfer.engine.quant import DEFAULT_GROUP_SIZE, TensorFormat, dequantize
from ninfer.engine.quant_blocks import GGUF_BLOCK_TYPES
from ninfer.errors import ArtifactError, NInferError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED = {"rope_freqs.weight"}  # folded into the config (llama3 rope scaling)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HF_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")
# File-name suffixes that name a quantization, e.g. ".Q4_1", "-Q4_K_M", "-f16".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d[A-Za-z0-9_]*|[Bb]?[Ff]16|[Ff]32)$")


def gguf_architecture(name: Any) -> Architecture | None:
    """The record whose GGUF `general.architecture` is `name`."""
    return next((a for a in ARCHITECTURES.values() if a.gguf_architecture == name), None)


def hf_name(gguf_name: str, arch: Architecture) -> str | None:
    """Hugging Face name of a GGUF tensor name (None when unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in arch.gguf_layer_names:
        return f"model.layers.{m.group(1)}.{arch.gguf_layer_names[m.group(2)]}"
    return None


def read_config(src: Path, fields: dict[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None) -> ModelConfig:
    """ModelConfig from the `{arch}.*` keys."""
    arch = fields.get("general.architecture")
    record = gguf_architecture(arch)
    if record is None:
        supported = ", ".join(a.gguf_architecture for a in ARCHITECTURES.values())
        raise ArtifactError(f"{src}: unsupported architecture {arch!r} (supported: {supported})")

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ArtifactError(f"{src}: missing GGUF key {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = fields.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ArtifactError(f"{src}: cannot tell the vocabulary size (no {arch}.vocab_size, no tokens)")
    context = int(key("context_length", 4096))
    rope_scaling = _rope_scaling(src, fields, arch, context, rope_freqs)
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))  # qwen35: head_dim * partial_rotary_factor
    hybrid = _linear_attention_fields(key, layers) if f"{arch}.ssm.inner_size" in fields else {}
    own = record.gguf_fields(key, layers) if record.gguf_fields else {}
    try:
        return ModelConfig(
            architecture=record.name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=any(n.endswith(".attn_q.bias") for n in tensor_names),
            partial_rotary_factor=rotary / head_dim,
            **hybrid,
            **own,
        )
    except NInferError as e:
        raise ArtifactError(f"{src}: {e}") from None


def _linear_attention_fields(key: Any, layers: int) -> dict[str, Any]:
    """The Gated DeltaNet shape from the keys llama.cpp's qwen35 converter writes: ssm.conv_kernel,
    ssm.state_size (key head dim; llama.cpp takes the value head dim to equal it, we read it from
    inner_size), ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.inner_size (value
    heads x value head dim) and full_attention_interval (every interval-th layer is full attention,
    as llama.cpp marks its recurrent layers)."""
    value_heads = int(key("ssm.time_step_rank"))
    interval = int(key("full_attention_interval", 4))
    return dict(
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=int(key("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_value_head_dim=int(key("ssm.inner_size")) // value_heads,
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
    )


def _rope_scaling(src: Path, fields: dict[str, Any], arch: str, context: int,
                  rope_freqs: np.ndarray | None) -> dict[str, Any] | None:
    """The rope_scaling of the `{arch}.rope.scaling.*` keys (linear, yarn), or of llama3's
    precomputed `rope_freqs.weight`."""
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = float(fields.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    original = int(fields.get(f"{arch}.rope.scaling.original_context_length", 0) or context)
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor != 1.0:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if fields.get(f"{arch}.rope.scaling.{theirs}"):
                scaling[ours] = float(fields[f"{arch}.rope.scaling.{theirs}"])
        return scaling
    if kind not in ("none", None, "linear", "yarn") and factor != 1.0:
        raise ArtifactError(f"{src}: unsupported rope scaling {kind!r} (factor {factor}; supported: linear, yarn)")
    if rope_freqs is None:
        return None
    return _infer_llama3_scaling(src, np.asarray(rope_freqs, dtype=np.float64),
                                 float(fields.get(f"{arch}.rope.freq_base", 10000.0)), context)


def llama3_rope_divisors(head_dim: int, theta: float, factor: float, low: float, high: float,
                         original: int) -> np.ndarray:
    """Per-frequency divisors [head_dim/2] as llama.cpp's `rope_freqs.weight` stores them."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, out)
    return np.where(wavelen > original / low, factor, out)


def _infer_llama3_scaling(src: Path, divisors: np.ndarray, theta: float, context: int) -> dict[str, Any]:
    # llama.cpp stores the llama3 scaling as precomputed divisors; find the parameters that give them.
    head_dim = 2 * divisors.shape[0]
    factor = float(divisors.max())
    for original in sorted({8192, 4096, 2048, 1024, 16384, 32768, context}):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            guess = llama3_rope_divisors(head_dim, theta, factor, low, high, original)
            if np.allclose(guess, divisors, rtol=1e-4, atol=1e-6):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ArtifactError(f"{src}: rope_freqs.weight does not match llama3 rope scaling")


# ---- weights -------------------------------------------------------------------------------------

def _float_tensor(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    raw = np.array(data)  # copy out of the read-only memmap
    if type_name == "BF16":
        return torch.from_numpy(raw.view(np.int16).reshape(shape)).view(torch.bfloat16)
    dtype = np.float32 if type_name == "F32" else np.float16
    return torch.from_numpy(raw.view(dtype).reshape(shape))


def _quant_parts(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[TensorFormat, dict[str, torch.Tensor]]:
    rows, cols = shape
    nblocks = cols // 32
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    blocks = np.asarray(data).view(np.uint8).reshape(rows, nblocks, block_bytes)
    scales = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(rows, nblocks))
    if type_name == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols))
        return TensorFormat("int8", DEFAULT_GROUP_SIZE), {"": q, ".scales": scales}
    # GGUF byte j holds elements j (low) and j+16 (high); ours byte k holds 2k (low) and 2k+1 (high):
    # out[k<8] = lo(b[2k]) | lo(b[2k+1])<<4,  out[k>=8] = hi(b[2k-16]) | hi(b[2k-15])<<4
    qs = blocks[..., -16:]
    even, odd = qs[..., 0::2], qs[..., 1::2]  # [rows, nblocks, 8]
    packed = np.concatenate(((even & 0x0F) | ((odd & 0x0F) << 4), (even >> 4) | (odd & 0xF0)), axis=-1)
    parts = {"": torch.from_numpy(packed.reshape(rows, cols // 2)), ".scales": scales}
    if type_name == "Q4_0":
        return TensorFormat("int4", DEFAULT_GROUP_SIZE, symmetric=True), parts
    parts[".mins"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(rows, nblocks))
    return TensorFormat("int4", DEFAULT_GROUP_SIZE, symmetric=False), parts


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head: HF row h*hd + j*hd/2 + i sits at
    # GGUF row h*hd + 2i + j. Rows move whole, so this applies to packed parts and scales alike.
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def read_tensor(src: Path, tensor: GGUFTensor, weights: str) -> tuple[TensorFormat, dict[str, torch.Tensor], tuple[int, ...]]:
    """(format, stored parts, logical shape) of one GGUF tensor, as stored or dequantized."""
    type_name, shape = tensor.type_name, tensor.shape
    if type_name in ("F32", "F16", "BF16"):
        t = _float_tensor(tensor.data, type_name, shape)
        return float_format(t.dtype), {"": t}, shape
    if type_name in ("Q8_0", "Q4_0", "Q4_1") and len(shape) == 2:
        fmt, parts = _quant_parts(tensor.data, type_name, shape)
        return fmt, parts, shape
    if type_name in GGUF_BLOCK_TYPES and len(shape) == 2:
        raw = torch.from_numpy(np.array(tensor.data).reshape(shape[0], -1))
        return TensorFormat(GGUF_BLOCK_TYPES[type_name]), {"": raw}, shape
    if weights == "keep":
        kept = ", ".join(["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", *GGUF_BLOCK_TYPES])
        raise ArtifactError(f"{src}: tensor {tensor.name} has type {type_name}, which cannot be kept as is "
                            f"(kept: {kept}; convert with weights bf16, int8 or int4)")
    from gguf.quants import dequantize as gguf_dequantize

    try:
        values = gguf_dequantize(np.array(tensor.data).reshape(shape[0], -1), tensor.tensor_type)
    except (NotImplementedError, KeyError):
        raise ArtifactError(f"{src}: tensor {tensor.name} has unsupported GGUF type {type_name}") from None
    return TensorFormat("f32"), {"": torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))}, shape


def undo_transform(transform: Any, fmt: TensorFormat, parts: dict[str, torch.Tensor], shape: tuple[int, ...],
                   config: ModelConfig) -> tuple[TensorFormat, dict[str, torch.Tensor], tuple[int, ...]]:
    """Apply the record's inverse of a change llama.cpp's converter made to one tensor.

    A float tensor is transformed in float32 and kept in its dtype. A quantized weight goes through
    the transform as a tensor of its element indices; when that moves whole quantization groups (the
    value-head reorder does), the stored groups move and the weight stays bit-exact; otherwise it is
    expanded to float32 and transformed."""
    if not fmt.quantized:
        t = parts[""]
        out = transform(t.float(), config)
        return fmt, {"": out.to(t.dtype).contiguous()}, tuple(out.shape)
    index = transform(torch.arange(math.prod(shape)).reshape(shape), config)
    moved = _move_groups(parts, shape, index, fmt.group_size)
    if moved is not None:
        return fmt, moved, tuple(index.shape)
    out = transform(dequantize(fmt, parts, torch.float32), config)
    return TensorFormat("f32"), {"": out.contiguous()}, tuple(out.shape)


def _move_groups(parts: dict[str, torch.Tensor], shape: tuple[int, ...], index: torch.Tensor,
                 group: int) -> dict[str, torch.Tensor] | None:
    # index [rows', cols']: the source element of each output element. Every part stores a row's
    # groups side by side (q: group values, packed int4: group / 2 bytes, scales/mins: one each).
    rows, cols = shape
    n = rows * cols
    if index.dtype != torch.int64 or index.dim() != 2 or index.numel() != n or index.shape[1] % group:
        return None
    src = index.reshape(index.shape[0], index.shape[1] // group, group)
    start = src[..., :1]
    if (start % group).any() or not torch.equal(src, start + torch.arange(group)):
        return None  # some output group is not one whole source group
    block = (start // group).flatten()  # flat source group: row * (cols / group) + group in row
    if block.min() < 0 or block.max() >= n // group or block.unique().numel() != block.numel():
        return None  # not a permutation of the groups
    moved = {}
    for sfx, p in parts.items():
        per = p.shape[1] * group // cols
        moved[sfx] = p.reshape(n // group, per)[block].reshape(index.shape[0], -1).contiguous()
    return moved


def _model_name(src: Path, general_name: str | None) -> str:
    stem = _QUANT_SUFFIX.sub("", src.stem)
    if stem.lower() in ("", "model", "ggml-model", "ggml_model") and general_name:
        return general_name
    return stem or (general_name or "model")


def read_vocab(fields: dict[str, Any]) -> GGUFVocab:
    tokens = list(fields.get("tokenizer.ggml.tokens") or [])
    types = fields.get("tokenizer.ggml.token_type")
    scores = fields.get("tokenizer.ggml.scores")
    merges = fields.get("tokenizer.ggml.merges")
    model = fields.get("tokenizer.ggml.model")
    return GGUFVocab(
        model=model,
        pre=fields.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=list(types) if types is not None else [1] * len(tokens),
        scores=list(scores) if scores is not None else None,
        merges=list(merges) if merges is not None else None,
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        unk_token_id=fields.get("tokenizer.ggml.unknown_token_id"),
    )


def _special_tokens(fields: dict[str, Any], vocab: GGUFVocab) -> SpecialTokens:
    def tid(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(vocab.tokens) else None

    bos, eos = tid("bos_token_id"), tid("eos_token_id")
    lookup = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.token_types)) if k in (3, 4)}
    stops = stop_token_ids(lookup, [eos, tid("eot_token_id"), tid("eom_token_id")])
    return SpecialTokens(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=tid("padding_token_id"), stop_token_ids=stops,
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", vocab.model == "llama")),
        bos_token=vocab.tokens[bos] if bos is not None else None,
        eos_token=vocab.tokens[eos] if eos is not None else None,
    )


def convert_gguf(src: str | Path, out: str | Path, weights: str = "keep", progress: bool = True) -> Path:
    """Convert a GGUF file of any architecture of models/ to a .ninfer artifact at `out`; raises ArtifactError."""
    src, out = Path(src), Path(out)
    check_weights_mode(weights)
    gguf = GGUFFile(src)
    fields = gguf.fields
    by_name = {t.name: t for t in gguf.tensors}
    rope_freqs = np.array(by_name["rope_freqs.weight"].data).view(np.float32) if "rope_freqs.weight" in by_name else None
    config = read_config(src, fields, set(by_name), rope_freqs)
    vocab = read_vocab(fields)
    if not vocab.tokens:
        raise ArtifactError(f"{src}: no tokenizer (tokenizer.ggml.tokens is missing)")

    expected = expected_weights(config)
    arch = ARCHITECTURES[config.architecture]
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, TensorFormat] = {}
    permute = {"self_attn.q_proj.weight": config.num_attention_heads,
               "self_attn.k_proj.weight": config.num_key_value_heads} if config.architecture == "llama" else {}
    for tensor in progress_bar(gguf.tensors, len(gguf.tensors), f"converting {src.name}", progress):
        if tensor.name in _IGNORED:
            continue
        name = hf_name(tensor.name, arch)
        if name is None or name not in expected:
            raise ArtifactError(f"{src}: unexpected tensor {tensor.name} for architecture {config.architecture}")
        fmt, parts, shape = read_tensor(src, tensor, weights)
        transform = arch.gguf_transforms.get(_HF_LAYER_PREFIX.sub("", name))
        if transform is not None:
            fmt, parts, shape = undo_transform(transform, fmt, parts, shape, config)
        if shape != expected[name]:
            raise ArtifactError(f"{src}: tensor {tensor.name} has shape {list(shape)}, expected {list(expected[name])}")
        n_head = next((n for suffix, n in permute.items() if name.endswith(suffix)), None)
        if n_head is not None:
            parts = {s: _unpermute_rows(p, n_head) for s, p in parts.items()}
        fmt, parts = encode_weight(name, fmt, parts, shape, weights, config)
        formats[name] = fmt
        tensors.update({name + s: p for s, p in parts.items()})
    missing = [n for n in expected if n not in formats]
    if missing:
        raise ArtifactError(f"{src}: missing tensor {missing[0]}")

    general_name = fields.get("general.name")
    name = _model_name(src, general_name)
    meta = ArtifactMetadata(
        name=name,
        model_id=name,
        config=config,
        tensor_formats=formats,
        tokenizer_json=build_tokenizer_json(vocab, str(src)),
        chat_template=fields.get("tokenizer.chat_template"),
        special_tokens=_special_tokens(fields, vocab),
        source={"kind": "gguf", "sha256": sha256_file(src), "path": str(src.resolve()),
                "general_name": general_name, "weights": weights},
    )
    return write_artifact(out, tensors, meta)

