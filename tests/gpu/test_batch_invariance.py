"""Batch invariance of the cuda runner: 16 requests (greedy, seeded sampling, penalties) give
bit-identical tokens and logits alone, inside batches of up to 8 with other requests' prefills
and decodes, and after a prefix-cache hit (shared pages, start_pos > 0, with and without a
copy-on-write page); under the default device profile and under profiles choosing every other
route (each gemv route, cuBLAS decode for bf16, another attention partition and prompt row block,
decode steps padded to fewer graphs)."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.synthetic import SyntheticArtifact
from ninfer.kernels.launchers import GEMV_FORMATS, GEMV_ROUTES
from ninfer.kernels.profile import DeviceProfile

N_PROMPTS, N_NEW, PAGE, LANES = 16, 24, 64, 8


def sampling_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0)
    if i % 4 == 3:
        return SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.4, frequency_penalty=0.2)
    return SamplingParams(temperature=0.7, top_k=10, min_p=0.02)


class Request:
    """One request's prompt, pages and what it produced (tokens and the logits each was drawn from)."""

    def __init__(self, i: int, prompt: list[int], pages: list[int], start: int = 0) -> None:
        self.i, self.prompt, self.pages, self.start = i, prompt, pages, start
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []

    def work(self) -> SequenceWork:
        if not self.tokens:  # the prompt (or what a prefix hit left of it)
            ids, pos = self.prompt[self.start:], self.start
        else:
            ids, pos = [self.tokens[-1]], len(self.prompt) + len(self.tokens) - 1
        return SequenceWork(seq_id=self.i, token_ids=ids, start_pos=pos, block_table=self.pages, sample=True,
                            sampling=sampling_for(self.i), output_token_ids=list(self.tokens), seed=1000 + self.i)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= N_NEW


def drive(runner, requests: list[Request], lanes: int, admit_per_step: int,
          copies: dict[int, list[tuple[int, int]]] | None = None) -> None:
    """A small scheduler: admit up to `admit_per_step` waiting prompts a step (their prefill runs in
    the same batch as the running lanes' decode), at most `lanes` running, until all are done."""
    waiting, running = list(requests), []
    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < lanes and len(admitted) < admit_per_step:
            admitted.append(waiting.pop(0))
        for r in admitted:
            runner.copy_pages((copies or {}).get(r.i, []))
        step = admitted + running  # new prompts first, then decode rows
        out, logits = runner.run_with_logits(ScheduledBatch([r.work() for r in step]))
        for row, r in enumerate(step):
            r.tokens.append(out.sampled[r.i])
            r.logits.append(logits[row])
        running = [r for r in step if not r.done]


PROFILES = {"defaults": DeviceProfile(),
            **{f"gemv-{r}": DeviceProfile(gemv={k: r for k in GEMV_FORMATS}) for r in GEMV_ROUTES},
            "cublas-p256-r64-g2.8": DeviceProfile(gemv={"bf16": "cublas"}, attention_partition=256, prompt_rows=64,
                                                  graph_rows=(2, 8))}


# every profile on bf16 and int4; int8 on each of its gemv routes (the default, tiled, warp and mma)
CASES = ([(w, p) for w in ("bf16", "int4") for p in PROFILES]
         + [("int8", "defaults"), ("int8", "gemv-warp"), ("int8", "gemv-mma")])


@pytest.mark.parametrize("weights, profile", CASES)
def test_batch_and_prefix_invariance(weights: str, profile: str) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(80, 620, (N_PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    per = -(-(max(lengths) + N_NEW) // PAGE)
    runner = CudaModelRunner(SyntheticArtifact("smollm2-135m", weights, seed=4), num_pages=3 * N_PROMPTS * per,
                             page_size=PAGE, device="cuda", profile=PROFILES[profile])

    def pages(block: int) -> list[int]:
        return list(range(block * per, (block + 1) * per))

    alone = [Request(i, p, pages(i)) for i, p in enumerate(prompts)]
    for r in alone:
        drive(runner, [r], lanes=1, admit_per_step=1)
    batched = [Request(i, p, pages(N_PROMPTS + i)) for i, p in enumerate(prompts)]
    drive(runner, batched, lanes=LANES, admit_per_step=2)

    # A second request per prompt sharing the first one's full pages: even ones start on a page
    # boundary, odd ones 10 tokens into a page they get as a copy of the shared one.
    hits, copies = [], {}
    for i, p in enumerate(prompts):
        own = pages(2 * N_PROMPTS + i)
        if i % 2 == 0:
            k = (len(p) - 1) // PAGE
            start = k * PAGE
        else:
            k = (len(p) - 11) // PAGE
            start = k * PAGE + 10
            copies[i] = [(alone[i].pages[k], own[k])]
        assert k >= 1 and start < len(p)
        hits.append(Request(i, p, alone[i].pages[:k] + own[k:], start))
    drive(runner, hits, lanes=LANES, admit_per_step=2, copies=copies)

    assert runner.graphs.captures >= 3  # decode graphs of several row counts and split buckets
    for a, b, h in zip(alone, batched, hits):
        assert a.tokens == b.tokens == h.tokens, f"request {a.i}: {a.tokens} / {b.tokens} / {h.tokens}"
        for step, (la, lb, lh) in enumerate(zip(a.logits, b.logits, h.logits)):
            assert torch.equal(la, lb) and torch.equal(la, lh), f"request {a.i} step {step}: logits differ"
    assert len({tuple(r.tokens) for r in alone}) > 1  # the requests did not all collapse to one output


def test_prompt_matmul_calls_keep_rows() -> None:
    """cuBLAS kept from split-K gives a row its lone block's bits in one call over many blocks, at
    SmolLM2's and llama-8b's projection shapes (what lets the prompt route make one call per
    projection), and block_mm with call_rows gives the blocks' bits at any row count."""
    from ninfer.engine.ops.cuda_ops import block_mm, calls_keep_rows, no_split_k

    dev = torch.device("cuda")
    assert no_split_k()
    g = torch.Generator(device=dev).manual_seed(5)
    for N, K in [(960, 576), (576, 1536), (6144, 4096), (4096, 14336)]:
        w_t = torch.randn(N, K, generator=g, device=dev, dtype=torch.bfloat16).t()
        assert calls_keep_rows(w_t, 128, 1024), (N, K)
    x = torch.randn(1000, 576, generator=g, device=dev).to(torch.bfloat16)
    w_t = (torch.randn(960, 576, generator=g, device=dev) * 0.04).to(torch.bfloat16).t()
    ref = block_mm(x, w_t, 128)
    for n in (1, 127, 129, 700, 1000):
        assert torch.equal(block_mm(x[:n], w_t, 128, 512), ref[:n]), n
