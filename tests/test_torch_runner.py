"""TorchModelRunner on tiny random-weight models: paged KV bookkeeping (chunked prefill, scattered
pages, batching lanes), sampling through run(), page copies, and the packed int4 decode path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner, kv_bytes_per_token
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.ops.torch_ops import Linear
from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.engine.request import SamplingParams
from ninfer.errors import NInferError

GREEDY = SamplingParams(temperature=0.0)
PROMPT_A = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183]
PROMPT_B = [1, 22, 9004, 17, 300, 41, 8]
DECODE = [310, 44, 2006]  # fixed "sampled" tokens fed back in decode steps
# f32, same weights, different chunking / batching / pages: only summation order may differ
# (measured max |Δlogit| 3e-7 on logits of magnitude ~0.8).
SAME_MATH_TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from ninfer.engine.convert import convert

    root = tmp_path_factory.mktemp("runner_tiny")
    return {
        "llama": Artifact.open(convert(tiny_hf_dirs["llama"], root / "llama.ninfer", weights="keep", progress=False)),
        "qwen3-int4": Artifact.open(convert(tiny_hf_dirs["qwen3"], root / "qwen3.ninfer", weights="int4",
                                            progress=False)),
        "llama-int4": Artifact.open(convert(tiny_hf_dirs["llama"], root / "llama-int4.ninfer", weights="int4",
                                            progress=False)),
    }


def work(seq_id: int, tokens: list[int], start: int, pages: list[int], sample: bool = False) -> SequenceWork:
    return SequenceWork(seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=pages, sample=sample,
                        sampling=GREEDY)


def chunked_logits(runner: TorchModelRunner, seq_id: int, tokens: list[int], chunks: list[int],
                   pages: list[int]) -> torch.Tensor:
    """Feed `tokens` in chunks of the given sizes; -> logits of every position [len(tokens), vocab]."""
    rows, start = [], 0
    for n in chunks:
        batch = ScheduledBatch([work(seq_id, tokens[start:start + n], start, pages)])
        rows.append(runner.batch_logits(batch, all_rows=True))
        start += n
    assert start == len(tokens)
    return torch.cat(rows)


def test_chunked_prefill_and_decode_match_one_shot(tiny) -> None:
    runner = TorchModelRunner(tiny["llama"], num_pages=12, page_size=4, dtype=torch.float32)
    tokens = PROMPT_A + DECODE  # 16 tokens: 4 pages of 4
    ref = runner.forward_logits(tokens)
    pages = [9, 2, 6, 0]  # scattered, not in order
    ours = chunked_logits(runner, 0, tokens, [5, 4, 4, 1, 1, 1], pages)  # 3 prefill chunks + 3 decode steps
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < SAME_MATH_TOL
    # the same through contiguous pages (the no-gather view path) agrees too
    runner2 = TorchModelRunner(tiny["llama"], num_pages=12, page_size=4, dtype=torch.float32)
    ours2 = chunked_logits(runner2, 0, tokens, [13, 1, 1, 1], [4, 5, 6, 7])
    assert (ours2 - ref).abs().max().item() < SAME_MATH_TOL


def test_two_sequences_batched_match_each_alone(tiny) -> None:
    runner = TorchModelRunner(tiny["llama"], num_pages=12, page_size=4, dtype=torch.float32)
    alone_a = runner.forward_logits(PROMPT_A + DECODE)
    alone_b = runner.forward_logits(PROMPT_B + DECODE)
    pages_a, pages_b = [3, 10, 1, 7], [8, 0, 5]
    # step 1: A prefills its first 9 tokens alone
    rows_a = [runner.batch_logits(ScheduledBatch([work(1, PROMPT_A[:9], 0, pages_a)]), all_rows=True)]
    rows_b = []
    # step 2: A's last prompt chunk and B's whole prompt in one batch
    step = runner.batch_logits(ScheduledBatch([work(1, PROMPT_A[9:], 9, pages_a), work(2, PROMPT_B, 0, pages_b)]),
                               all_rows=True)
    rows_a.append(step[:4])
    rows_b.append(step[4:])
    # steps 3..5: both decode, B listed first (row order follows the batch)
    for i, t in enumerate(DECODE):
        step = runner.batch_logits(ScheduledBatch([work(2, [t], len(PROMPT_B) + i, pages_b),
                                                   work(1, [t], len(PROMPT_A) + i, pages_a)]), all_rows=True)
        rows_b.append(step[:1])
        rows_a.append(step[1:])
    assert (torch.cat(rows_a) - alone_a).abs().max().item() < SAME_MATH_TOL
    assert (torch.cat(rows_b) - alone_b).abs().max().item() < SAME_MATH_TOL


def test_run_samples_only_flagged_rows_greedy_is_argmax(tiny) -> None:
    art = tiny["llama"]
    a = TorchModelRunner(art, num_pages=8, page_size=4, dtype=torch.float32)
    b = TorchModelRunner(art, num_pages=8, page_size=4, dtype=torch.float32)

    def batch() -> ScheduledBatch:
        return ScheduledBatch([work(1, PROMPT_A, 0, [0, 1, 2, 3], sample=True),
                               work(2, PROMPT_B[:4], 0, [4, 5], sample=False)])

    logits = a.batch_logits(batch())  # one row: the sampling sequence's last position
    assert logits.shape == (1, art.meta.config.vocab_size) and logits.dtype == torch.float32
    out = b.run(batch())
    assert out.sampled == {1: int(logits[0].argmax())}


def test_copy_pages_moves_kv_for_every_layer(tiny) -> None:
    runner = TorchModelRunner(tiny["llama"], num_pages=8, page_size=4, dtype=torch.float32)
    runner.batch_logits(ScheduledBatch([work(1, PROMPT_A[:8], 0, [2, 4])]))
    runner.copy_pages([(2, 0), (4, 5)])
    for cache in (*runner.kv.k, *runner.kv.v):
        assert torch.equal(cache[0], cache[2]) and torch.equal(cache[5], cache[4])
        assert cache[2].abs().sum() > 0
    # continuing from the copies gives the same logits as continuing from the originals
    cont = [work(1, PROMPT_A[8:], 8, [0, 5, 1, 6])]
    ref = [work(1, PROMPT_A[8:], 8, [2, 4, 3, 7])]
    x = runner.batch_logits(ScheduledBatch(cont), all_rows=True)
    y = runner.batch_logits(ScheduledBatch(ref), all_rows=True)
    assert torch.equal(x, y)


def test_rejects_bad_block_tables(tiny) -> None:
    runner = TorchModelRunner(tiny["llama"], num_pages=4, page_size=4, dtype=torch.float32)
    with pytest.raises(NInferError, match="outside"):
        runner.batch_logits(ScheduledBatch([work(1, PROMPT_B, 0, [0, 4])]))
    with pytest.raises(NInferError, match="outside"):
        runner.copy_pages([(0, 9)])


def test_forward_logits_leaves_runner_cache_alone(tiny) -> None:
    runner = TorchModelRunner(tiny["llama"], num_pages=4, page_size=4, dtype=torch.float32)
    runner.forward_logits(PROMPT_A)
    assert all(c.abs().sum() == 0 for c in runner.kv.k)


def test_kv_bytes_per_token(tiny) -> None:
    """The advertised figure is what the cache tensors hold per token (CPU keeps KV in float32)."""
    c = tiny["llama"].meta.config  # 2 layers, 2 kv heads, head_dim 16
    for dtype in (torch.float32, torch.bfloat16):
        runner = TorchModelRunner(tiny["llama"], num_pages=2, page_size=4, dtype=dtype)
        held = sum(t.numel() * t.element_size() for t in (*runner.kv.k, *runner.kv.v)) // (2 * 4)
        assert runner.kv_bytes_per_token == held == 2 * 2 * 2 * 16 * 4 == kv_bytes_per_token(c, "cpu", dtype)
    assert kv_bytes_per_token(c, "cuda", torch.bfloat16) == 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("symmetric", [False, True])
def test_packed_int4_linear_matches_dense(symmetric: bool) -> None:
    torch.manual_seed(0)
    fmt = TensorFormat("int4", 32, symmetric=symmetric)
    parts = [quantize(torch.randn(96, 128), fmt), quantize(torch.randn(64, 128), fmt)]  # two fused weights
    dense = torch.cat([dequantize(fmt, p) for p in parts])  # [160, 128]
    lin = Linear(dense.to(torch.bfloat16))
    lin.attach_int4(fmt, parts)
    x = torch.randn(3, 128)
    packed = lin(x.to(torch.bfloat16)).float()  # 3 rows: the packed kernel
    ref = x @ dense.t()
    assert packed.shape == ref.shape
    # bf16 activations and bf16 scales: relative error 2.9e-3 measured
    assert ((packed - ref).norm() / ref.norm()).item() < 1e-2


def test_packed_int8_linear_matches_dense() -> None:
    """int8 (as two int4 halves) through the packed kernel equals the dense weight up to bf16 rounding."""
    torch.manual_seed(1)
    fmt = TensorFormat("int8", 32, symmetric=True)
    w = torch.randn(208, 96)
    w[0, :32] = 0.0  # an all-zero group (scale 0)
    parts = quantize(w, fmt)
    parts[""][1, :4] = torch.tensor([-128, 127, -127, 0], dtype=torch.int8)  # the int8 extremes
    dense = dequantize(fmt, parts)
    lin = Linear(dense.to(torch.bfloat16))
    lin.attach_int8(fmt, [parts])
    assert lin.packed is not None and lin.repeat == 2  # both halves in one packed weight
    x = torch.randn(2, 96)
    packed = lin(x.to(torch.bfloat16), torch.float32)
    ref = x @ dense.t()
    assert packed.dtype == torch.float32
    assert ((packed - ref).norm() / ref.norm()).item() < 1e-2  # measured 3.1e-3


@pytest.mark.parametrize("kernels", ["torch", "auto"])  # the torch ops, and the native kernels where they build
@pytest.mark.parametrize("model", ["qwen3-int4", "llama-int4"])  # llama: the native decode attention too
def test_bf16_packed_decode_close_to_f32(tiny, kernels, model) -> None:
    art = tiny[model]
    fast = TorchModelRunner(art, num_pages=8, page_size=4, dtype=torch.bfloat16, cpu_kernels=kernels)
    assert fast.model.layers[0].attn.qkv.decode_packed  # int4 weights kept packed for decode
    assert (type(fast.ops).__name__ == "NativeCpuOps") == (fast.cpu_kernels is not None)
    if kernels == "torch":
        assert fast.cpu_kernels is None
    ref = TorchModelRunner(art, num_pages=8, page_size=4, dtype=torch.float32).forward_logits(PROMPT_A + DECODE)
    ours = chunked_logits(fast, 0, PROMPT_A + DECODE, [13, 1, 1, 1], [0, 1, 2, 3])  # decode rows: packed path
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 0.03  # measured 0.010 (bf16 activations, KV and scales)
