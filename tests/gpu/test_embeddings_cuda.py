"""Embedding rows (SequenceWork.return_hidden) from the cuda runner's prompt path against the fp32
torch runner on the same random weights: a 300-token prompt in chunks of 128, each chunk's final
normed hidden rows compared (relative error per row), in fp32 mode and in bf16."""
from __future__ import annotations

import gc

import pytest
import torch

from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.synthetic import SyntheticArtifact
from test_cuda_runner import PAGE, SharedWeights

PROMPT, CHUNK = 300, 128


def _work(tokens: list[int], start: int, pages: list[int], last: bool) -> SequenceWork:
    return SequenceWork(seq_id=1, token_ids=tokens, start_pos=start, block_table=pages, sample=last,
                        sampling=SamplingParams(temperature=0.0), return_hidden=True)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_embedding_rows_match_the_fp32_torch_runner(dtype: torch.dtype, tolerance: float) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner

    artifact = SharedWeights(SyntheticArtifact("smollm2-135m", "bf16", seed=5))
    vocab = artifact.meta.config.vocab_size
    pages = list(range(-(-PROMPT // PAGE)))
    ours = CudaModelRunner(artifact, num_pages=len(pages) + 2, page_size=PAGE, device="cuda", dtype=dtype)
    truth = TorchModelRunner(artifact, num_pages=len(pages) + 2, page_size=PAGE, device="cuda", dtype=torch.float32)
    del artifact
    prompt = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    worst = 0.0
    for start in range(0, PROMPT, CHUNK):
        chunk = prompt[start:start + CHUNK]
        batch = ScheduledBatch([_work(chunk, start, pages, start + CHUNK >= PROMPT)])
        got, want = ours.run(batch).hidden[1], truth.run(batch).hidden[1]
        assert got.shape == want.shape == (len(chunk), want.shape[1])
        rel = ((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max().item()
        worst = max(worst, rel)
    print(f"\ncuda embedding rows ({dtype}) vs fp32 torch: max relative error {worst:.2e}")
    assert worst < tolerance
    del ours, truth
    gc.collect()
    torch.cuda.empty_cache()
