"""Speculative verification on the cuda runner, through the real Engine and scheduler.

A verify row of width W runs as W decode rows (each query over its own context, the gated delta
rule one position at a time), and every decode-route kernel computes a row from that row alone, so
committed greedy tokens must be bit-for-bit the plain greedy tokens, in bf16 as in fp32: the
default model (llama) with --spec lookup and with oracle drafts (full, partial and no acceptance,
widths 2..5), a tiny Qwen3.5 (recurrent state restored from the per-row states on rejection), graph
replay against eager launches, and one CUDA graph per verify width.
"""
from __future__ import annotations

import pytest
import torch
from oracle_drafts import K, generate

from ninfer.engine.config import SpecConfig


class ByteTokens:
    """A stand-in tokenizer for random-weight models: token t is one letter; 0 ends a sequence."""

    stop_token_ids = frozenset({0})
    special_token_ids = frozenset({0})
    vocab_size = 512

    def token_bytes(self, token_id: int) -> bytes:
        return chr(97 + token_id % 26).encode()


@pytest.fixture(scope="module")
def llama(smollm2_artifact):
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    texts = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
             "List the numbers from 1 to 25, separated by commas.",
             "def add(a, b):\n    return a + b\n\nRewrite this function with type hints.",
             "Write a short poem about the sea."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    return artifact, tokenizer, prompts


def _llama_runner(artifact, cuda_graph: bool = True):
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    return CudaModelRunner(artifact, num_pages=64, page_size=64, device="cuda", cuda_graph=cuda_graph,
                           max_draft_tokens=K)


def test_llama_lookup_greedy_is_plain_greedy_bit_for_bit(llama) -> None:
    artifact, tokenizer, prompts = llama
    runner = _llama_runner(artifact)
    plain, _ = generate(runner, tokenizer, prompts, None)
    spec, snap = generate(runner, tokenizer, prompts, SpecConfig("lookup", draft_tokens=K, ngram_min=1, ngram_max=3))
    assert spec == plain
    assert snap.drafted_tokens > 0 and snap.accepted_tokens > 0
    assert snap.decode_rounds < snap.committed_decode_tokens


def test_llama_oracle_rounds_of_every_width_and_a_graph_per_width(llama) -> None:
    artifact, tokenizer, prompts = llama
    runner = _llama_runner(artifact)
    plain, _ = generate(runner, tokenizer, prompts, None)
    spec, snap = generate(runner, tokenizer, prompts, SpecConfig("lookup", draft_tokens=K), oracle=plain)
    assert spec == plain
    assert 0 < snap.accepted_tokens < snap.drafted_tokens
    assert {1, 2, 3, 4, 5} <= runner.graphs.widths()  # plain decode and verify widths 2..K+1
    eager = _llama_runner(artifact, cuda_graph=False)
    again, _ = generate(eager, tokenizer, prompts, SpecConfig("lookup", draft_tokens=K), oracle=plain)
    assert again == plain and eager.graphs.captures == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_5_lookup_and_oracle_greedy_is_plain_greedy(dtype) -> None:
    from test_qwen3_5_cuda import tiny_hf

    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    _, artifact = tiny_hf()
    runner = CudaModelRunner(artifact, num_pages=128, page_size=16, device="cuda", dtype=dtype, num_state_slots=6,
                             max_draft_tokens=K)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5, 9, 5], [17, 23, 99, 4, 5, 6, 7, 8, 301, 77, 19, 2, 480, 3, 9, 10],
               [400, 401, 402, 403, 404, 400, 401, 402]]
    plain, _ = generate(runner, ByteTokens(), prompts, None, max_tokens=32)
    spec, snap = generate(runner, ByteTokens(), prompts, SpecConfig("lookup", draft_tokens=K, ngram_min=1, ngram_max=2),
                          max_tokens=32)
    assert spec == plain and snap.drafted_tokens > 0
    spec, snap = generate(runner, ByteTokens(), prompts, SpecConfig("lookup", draft_tokens=K), oracle=plain,
                          max_tokens=32)
    assert spec == plain  # a rejected tail's state was restored: every later token still matches
    assert 0 < snap.accepted_tokens < snap.drafted_tokens
    assert {2, 3, 4, 5} <= runner.graphs.widths()
