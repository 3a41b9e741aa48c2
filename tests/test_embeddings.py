"""Embeddings through the engine's prefill path: a request with `pooling` gets the served model's
final normed hidden states pooled over its prompt, across prefill chunks, and they equal
transformers' last_hidden_state on the same weights (a tiny random-weight llama, float32)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.config import SchedulerConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedRequest, SamplingParams
from ninfer.engine.tokenizer import Tokenizer
from torch_model_helpers import hf_with_weights

IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183, 77, 301, 19, 48000, 3, 9, 10]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from ninfer.engine.convert import convert

    out = convert(tiny_hf_dirs["llama"], tmp_path_factory.mktemp("emb") / "llama.ninfer", weights="keep",
                  progress=False)
    artifact = Artifact.open(out)
    hf = hf_with_weights(tiny_hf_dirs["llama"], artifact.load_dequantized())
    with torch.no_grad():
        ref = hf.model(torch.tensor([IDS])).last_hidden_state[0].float()  # [T, hidden], final norm applied
    meta = artifact.meta
    runner = TorchModelRunner(artifact, num_pages=64, page_size=8, dtype=torch.float32)
    engine = Engine(runner, Tokenizer(meta.tokenizer_json, meta.special_tokens, meta.chat_template),
                    SchedulerConfig(max_concurrency=2, prefill_chunk=8), model_max_context=512)
    engine.start()
    yield engine, ref
    engine.shutdown()


def _embed(engine: Engine, rid: str, pooling: str, ids: list[int] = IDS):
    final = None
    for event in engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=ids, max_tokens=1,
                                               sampling=SamplingParams(temperature=0.0), pooling=pooling)):
        final = event
    assert final.finish_reason in ("stop", "length") and final.usage.cached_tokens == 0
    return final.embedding


def test_pooled_hidden_states_match_transformers_across_chunks(tiny) -> None:
    engine, ref = tiny  # 20 tokens in chunks of 8: three prefill units
    want = {"mean": ref.mean(0), "last": ref[-1], "cls": ref[0]}
    for pooling, expected in want.items():
        got = _embed(engine, pooling, pooling)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert (got - expected).abs().max().item() < 1e-4, pooling
    # the same prompt again: the context cache must not hand back rows it never computed
    assert (_embed(engine, "again", "mean") - want["mean"]).abs().max().item() < 1e-4


def test_generation_requests_carry_no_embedding(tiny) -> None:
    engine, _ = tiny
    events = list(engine.submit(PreparedRequest(request_id="gen", prompt_token_ids=IDS, max_tokens=2,
                                                sampling=SamplingParams(temperature=0.0))))
    assert events[-1].embedding is None


def test_embeddings_submitted_together_equal_those_alone(tiny) -> None:
    """Submitted back to back, a 4- and a 3-token prompt usually share one prefill unit (chunks of 8;
    tests/test_scheduler.py checks the packing itself): packed or not, the vectors are the same."""
    engine, _ = tiny
    prompts = {"p": IDS[:4], "q": IDS[5:8]}
    alone = {rid: _embed(engine, rid + "-alone", "mean", ids) for rid, ids in prompts.items()}
    handles = {rid: engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=ids, max_tokens=1,
                                                  sampling=SamplingParams(temperature=0.0), pooling="mean"))
               for rid, ids in prompts.items()}
    for rid, handle in handles.items():
        final = list(handle)[-1]
        assert (final.embedding - alone[rid]).abs().max().item() < 1e-4
