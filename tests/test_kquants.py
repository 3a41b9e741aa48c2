"""llama.cpp's block formats kept as they are (K-quants, Q5_0/Q5_1, IQ4_NL/IQ4_XS): block
dequantization against gguf-py's reference on random blocks, tiny GGUF files of every type through
the torch runner against transformers loading the same file, and a real Q4_K_M of the default model
made with llama.cpp's quantize tool (skipped without the tool or the file)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_synth import random_blocks, write_tiny_gguf
from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.quant import dequantize, quantize
from ninfer.engine.request import SamplingParams
from ninfer.engine.quant_blocks import GGUF_BLOCK_TYPES, INT4_CODED, code_group, dequantize_blocks, int4_codes, int8_codes
from ninfer.formats import BLOCK_FORMATS, TensorFormat
from torch_model_helpers import assert_greedy_agrees, hf_from_gguf, hf_greedy, hf_logits, ours_greedy

BLOCK_TYPES = [Q[name.upper()] for name in BLOCK_FORMATS]


def _fmt(qtype: Q) -> TensorFormat:
    return TensorFormat(GGUF_BLOCK_TYPES[qtype.name])


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_dequantize_is_gguf_reference(qtype: Q) -> None:
    """Bit-equal to gguf.quants.dequantize, on random bits with finite f16 fields and on raw random
    bits (NaN / inf where the reference has them)."""
    rng = np.random.default_rng(int(qtype))
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    for blocks in (random_blocks(rng, qtype, 5, 4 * 256), rng.integers(0, 256, (7, 3 * nbytes), dtype=np.uint8)):
        ref = gguf.quants.dequantize(blocks, qtype)
        with np.errstate(all="ignore"):
            ours = dequantize(_fmt(qtype), {"": torch.from_numpy(blocks)}).numpy()
        assert ours.shape == ref.shape == (blocks.shape[0], blocks.shape[1] // nbytes * elements)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_round_to_nearest_quantizers(name: str) -> None:
    """Our q4_k / q6_k quantizers write blocks gguf-py reads back to within the code's step."""
    w = torch.randn(16, 512) * 0.02
    fmt = TensorFormat(name)
    parts = quantize(w, fmt)
    assert parts[""].shape == fmt.stored_shapes((16, 512))[""] and parts[""].dtype == torch.uint8
    held = gguf.quants.dequantize(parts[""].numpy(), Q[name.upper()])
    np.testing.assert_array_equal(dequantize(fmt, parts).numpy(), held)
    rel = (torch.from_numpy(held) - w).norm() / w.norm()
    assert rel < (0.12 if name == "q4_k" else 0.03), rel


@pytest.mark.parametrize("name", INT4_CODED)
def test_int4_codes_rebuild_the_weight(name: str) -> None:
    """The packed CPU kernel's form: q4_k exactly, q5_0/q5_1 up to d rounded to bf16."""
    qtype = Q[name.upper()]
    data = torch.from_numpy(random_blocks(np.random.default_rng(1), qtype, 32, 512))
    w = dequantize(TensorFormat(name), {"": data})
    rebuilt = sum(((q.float() - 8).view(32, -1, 32) * s.unsqueeze(-1) + z.unsqueeze(-1)).view(32, 512)
                  for q, s, z in int4_codes(TensorFormat(name), data))
    tol = 0.0 if name == "q4_k" else 2 ** -8 * 32 * w.abs().max().item()
    assert (rebuilt - w).abs().max().item() <= tol


# ---- tiny K-quant models against transformers ------------------------------------------------------

# The mix llama.cpp's quantize tool gives a Q4_K_M (q4_k, attn_v / ffn_down in q6_k, some q5_0), and
# one file with every other block type.
MIXES = {
    "q4_k_m": dict(linear_type=Q.Q4_K, embed_type=Q.Q6_K,
                   type_overrides={"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "blk.1.attn_k.weight": Q.Q5_0,
                                   "blk.0.attn_output.weight": Q.Q5_1}),
    "others": dict(linear_type=Q.Q5_K, embed_type=Q.IQ4_XS,
                   type_overrides={"attn_q.weight": Q.Q2_K, "attn_k.weight": Q.Q3_K, "attn_v.weight": Q.IQ4_NL,
                                   "ffn_up.weight": Q.IQ4_XS, "blk.1.ffn_gate.weight": Q.Q6_K}),
}
TINY = dict(hidden=256, ffn=512, head_dim=64, weight_scale=0.1)
F32_LOGIT_TOL = 1e-4
# bf16 compute: measured ‖Δ‖/‖ref‖ 0.011 (q4_k_m) and 0.031 (others) against transformers, the same
# with and without the packed decode kernel (logits span about ±9)
BF16_REL_TOL = 0.06


@pytest.fixture(scope="module")
def tiny_kquant(tmp_path_factory: pytest.TempPathFactory):
    cache = {}

    def get(mix: str):
        if mix not in cache:
            root = tmp_path_factory.mktemp(f"kquant-{mix}")
            src = write_tiny_gguf(root / f"tiny.{mix}.gguf", tied=mix != "q4_k_m", **TINY, **MIXES[mix])
            from ninfer.engine.model_store import resolve_model

            artifact = Artifact.open(resolve_model(str(src.path), root / "cache", announce=False))
            cache[mix] = (src, artifact, hf_from_gguf(src.path))
        return cache[mix]

    return get



@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_int8_codes_rebuild_the_weight(name: str) -> None:
    """Every block format as int8 codes with a scale (and zero) per group: the CPU kernels' form,
    bit-equal to the dequantized weight."""
    fmt = TensorFormat(name)
    data = torch.from_numpy(random_blocks(np.random.default_rng(3), Q[name.upper()], 48, 512))
    q, scale, zero = int8_codes(fmt, data, max_elements=512 * 16)  # several slabs
    g = code_group(fmt)
    w = scale.repeat_interleave(g, dim=1) * q.float()
    if zero is not None:
        w = w + zero.repeat_interleave(g, dim=1)
    assert q.dtype == torch.int8 and torch.equal(w, dequantize_blocks(fmt, data))


@pytest.mark.parametrize("mix", list(MIXES))
def test_tiny_kquant_file_kept_and_matches_transformers(mix: str, tiny_kquant) -> None:
    """A GGUF of K-quant / IQ4 / Q5 tensors is served without convert: every tensor keeps its block
    format byte for byte, and the f32 torch model matches transformers (which dequantizes the same
    file) to 1e-4; the fast CPU path (bf16, packed int4 decode where the format is an int4 code)
    stays within bf16 error, and 12 greedy tokens of two lanes agree."""
    src, artifact, hf = tiny_kquant(mix)
    formats = artifact.meta.tensor_formats
    for name, qtype in src.types.items():
        if qtype.name in GGUF_BLOCK_TYPES:
            assert formats[name].format == GGUF_BLOCK_TYPES[qtype.name], name
    assert {f.format for f in formats.values()} >= {GGUF_BLOCK_TYPES[t.name] for t in src.types.values()
                                                    if t.name in GGUF_BLOCK_TYPES}
    parts = artifact.load_parts()
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        held = dequantize(formats[name], parts[name]).numpy()
        np.testing.assert_array_equal(held, src.hf_weights[name])
    prompts = [[1, 300, 301, 302, 303, 304], [1, 310, 299, 320, 305]]
    ref = [hf_logits(hf, ids) for ids in prompts]
    f32 = TorchModelRunner(artifact, num_pages=8, page_size=16, dtype=torch.float32)
    for ids, r in zip(prompts, ref):
        assert (f32.forward_logits(ids) - r).abs().max().item() < F32_LOGIT_TOL
    fast = TorchModelRunner(artifact, num_pages=8, page_size=16)
    for i, (ids, r) in enumerate(zip(prompts, ref)):
        assert ((fast.forward_logits(ids) - r).norm() / r.norm()).item() < BF16_REL_TOL
        step = decode_logits(fast, ids, [2 * i, 2 * i + 1])  # the packed / native decode weights
        assert ((step - r[-1]).norm() / r[-1].norm()).item() < BF16_REL_TOL
    outs = ours_greedy(f32, prompts, 12, [[0, 1], [2, 3]])
    for ids, ours in zip(prompts, outs):
        assert_greedy_agrees(ours, hf_greedy(hf, ids, 12), hf, ids, 2 * F32_LOGIT_TOL)


def decode_logits(runner: TorchModelRunner, ids: list[int], pages: list[int]) -> torch.Tensor:
    """The logits of ids' last token computed as a decode row (after a prefill of the others): the
    weights' decode copy (packed int4 / native) rather than the dense one prefill reads."""
    runner.batch_logits(ScheduledBatch([SequenceWork(seq_id=0, token_ids=ids[:-1], start_pos=0, block_table=pages,
                                                     sample=False, sampling=SamplingParams())]))
    return runner.batch_logits(ScheduledBatch([SequenceWork(
        seq_id=0, token_ids=ids[-1:], start_pos=len(ids) - 1, block_table=pages, sample=True,
        sampling=SamplingParams(), output_token_ids=[ids[-1]])]))[0]


def test_tiny_kquant_packed_decode_is_taken(tiny_kquant) -> None:
    """The bf16 CPU runner keeps q4_k / q5_0 / q5_1 projections packed for decode (torch's int4
    kernel); with the native kernels q4_k is int4, q5_* 5-bit and q6_k 6-bit codes, and fused parts
    of mixed formats the narrowest codes that hold them all."""
    from ninfer.engine.ops.cpu_native_ops import NativeLinear
    from ninfer.kernels.cpu_native import INT4, INT5, INT6, INT8

    _, artifact, _ = tiny_kquant("q4_k_m")
    for kernels in ("torch", "auto"):
        runner = TorchModelRunner(artifact, num_pages=8, page_size=16, cpu_kernels=kernels)
        layer = runner.model.layers[0]
        gate_up, o_proj, down = layer.mlp.gate_up, layer.attn.o_proj, layer.mlp.down
        assert gate_up.decode_packed  # q4_k
        if not isinstance(down, NativeLinear):  # "torch", or no kernels on this CPU
            assert o_proj.repeat == 2  # q5_1: high bit and low nibble side by side (torch's layout)
            assert not down.decode_packed  # q6_k: dense
            continue
        assert gate_up.native.kind == INT4
        # q / k in q4_k, v in q6_k, fused: 6-bit codes, a scale per 16, q6_k's offset in its zeros
        assert (layer.attn.qkv.native.kind, layer.attn.qkv.native.group) == (INT6, 16)
    # q2_k / q3_k / iq4_nl fused: iq4's codes need 8 bits, so int8 codes with q2_k's zeros (0 elsewhere)
    qkv = TorchModelRunner(tiny_kquant("others")[1], num_pages=8, page_size=16).model.layers[0].attn.qkv
    if isinstance(qkv, NativeLinear):
        assert (qkv.native.kind, qkv.native.group, qkv.native.zeros is not None) == (INT8, 16, True)
        assert (o_proj.native.kind, o_proj.native.group) == (INT5, 32)  # q5_1: 5-bit codes
        assert (down.native.kind, down.native.group) == (INT6, 16)  # q6_k: 6-bit codes


def test_unsupported_block_type_names_it(tmp_path: Path) -> None:
    from ninfer.engine.convert import convert
    from ninfer.errors import ArtifactError

    src = write_tiny_gguf(tmp_path / "iq.gguf", **TINY, linear_type=Q.Q4_K, type_overrides={"blk.0.ffn_up.weight": Q.IQ3_S})
    with pytest.raises(ArtifactError, match=r"blk\.0\.ffn_up\.weight has type IQ3_S"):
        convert(src.path, tmp_path / "out.ninfer", progress=False)


# ---- a real Q4_K_M of the default model, made by llama.cpp's quantize tool --------------------------

def _llama_quantize() -> str | None:
    return os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.fixture(scope="module")
def smollm2_q4_k_m(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$NINFER_TEST_Q4_K_M if set, else a Q4_K_M made from the default model's GGUF with llama.cpp's
    quantize tool ($LLAMA_QUANTIZE or llama-quantize on PATH); skips when neither is there."""
    given = os.environ.get("NINFER_TEST_Q4_K_M")
    if given:
        if not Path(given).is_file():
            pytest.skip(f"NINFER_TEST_Q4_K_M={given} is not a file")
        return Path(given)
    tool = _llama_quantize()
    if tool is None:
        pytest.skip("no llama.cpp quantize tool (set LLAMA_QUANTIZE or NINFER_TEST_Q4_K_M)")
    out = tmp_path_factory.mktemp("q4km") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    subprocess.run([tool, "--allow-requantize", str(smollm2_gguf), str(out), "Q4_K_M"], check=True,
                   capture_output=True)
    return out


@pytest.mark.slow
def test_real_q4_k_m_matches_transformers(smollm2_q4_k_m: Path, tmp_path: Path) -> None:
    from ninfer.engine.convert.gguf_reader import GGUFFile
    from ninfer.engine.model_store import resolve_model
    from ninfer.engine.tokenizer import Tokenizer

    types = {t.tensor_type for t in GGUFFile(smollm2_q4_k_m).tensors}
    assert Q.Q4_K in types and Q.Q6_K in types
    artifact = Artifact.open(resolve_model(str(smollm2_q4_k_m), tmp_path, announce=False))
    kept = {f.format for f in artifact.meta.tensor_formats.values()}
    assert {"q4_k", "q6_k"} <= kept
    tok = Tokenizer.from_metadata(artifact.meta)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    return")]
    hf = hf_from_gguf(smollm2_q4_k_m)
    f32 = TorchModelRunner(artifact, num_pages=16, page_size=16, dtype=torch.float32)
    fast = TorchModelRunner(artifact, num_pages=16, page_size=16)
    # measured 2026-12-03 on a file from llama-quantize (llama-cpp-python 0.3.36's llama.cpp, ggml 0c1e570)
    # run on the Q4_1 file (166 Q5_0, 16 Q4_K, 15 Q8_0, 14 Q6_K tensors): f32 max |Δlogit| 0.0 on both
    # prompts; bf16 1.34 and 0.44 (logits span ~±30), the same argmax at every position
    for ids in prompts:
        ref = hf_logits(hf, ids)
        assert (f32.forward_logits(ids) - ref).abs().max().item() < 1e-4
        assert (fast.forward_logits(ids) - ref).abs().max().item() < 4.0  # bf16, as for the Q4_1 file
        step = decode_logits(fast, ids, [0, 1, 2])  # native kernels: q4_k int4, the rest int8 codes
        # measured 2026-12-05 (native kernels): ‖Δ‖/‖ref‖ 0.012 and 0.013, max |Δ| 0.29 and 0.25
        assert ((step - ref[-1]).norm() / ref[-1].norm()).item() < BF16_REL_TOL
    outs = ours_greedy(f32, prompts, 16, [[0, 1, 2], [3, 4, 5]])
    for ids, ours in zip(prompts, outs):
        assert_greedy_agrees(ours, hf_greedy(hf, ids, 16), hf, ids, 2e-4)


def test_cuda_backend_keeps_block_formats_as_stored(tiny_kquant) -> None:
    """The cuda ops' weights (built without a GPU): block formats kept byte for byte, a fused
    projection of mixed formats as runs of one format each (q4_k q|k, q6_k v), no dense copy."""
    from ninfer.engine.models import architecture
    from ninfer.engine.models.weights import WeightReader
    from ninfer.engine.ops.cuda_ops import CudaOps

    _, artifact, _ = tiny_kquant("q4_k_m")
    c = artifact.meta.config
    ops = CudaOps(None, c, torch.bfloat16, torch.device("cpu"))
    model = architecture(c).model.load(WeightReader(artifact, ops, torch.device("cpu")), c)
    parts = artifact.load_parts()
    qkv = model.layers[0].attn.qkv
    assert [(s.fmt.format, s.rows) for s in qkv.segments] == [("q4_k", 384), ("q6_k", 128)]
    assert torch.equal(qkv.segments[1].parts[""], parts["model.layers.0.self_attn.v_proj.weight"][""])
    assert [s.fmt.format for s in model.layers[1].attn.qkv.segments] == ["q4_k", "q5_0", "q6_k"]
    assert model.layers[0].mlp.gate_up.fmt.format == "q4_k" and model.layers[0].mlp.down.fmt.format == "q6_k"
    assert model.embed.fmt.format == "q6_k" and model.lm_head.fmt.format == "q6_k"


def test_run_a_k_quant_gguf_without_convert(tmp_path: Path) -> None:
    """`ninfer run x.Q4_K_M.gguf` converts it once into the cache, keeping its blocks, and generates."""
    import json
    import sys

    src = write_tiny_gguf(tmp_path / "tiny.Q4_K_M.gguf", **TINY, **MIXES["q4_k_m"])
    cache = tmp_path / "cache"
    env = dict(os.environ, NINFER_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "run", str(src.path), "--raw", "--json",
                          "--max-tokens", "4", "--temperature", "0", "hello world"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 4
    (artifact,) = cache.rglob("*.ninfer")
    assert {"q4_k", "q6_k", "q5_0"} <= {f.format for f in Artifact.open(artifact).meta.tensor_formats.values()}
