"""The torch runner on CUDA: the same code as on CPU (device-agnostic), checked against the CPU run
on the same random weights, plus chunked prefill over scattered pages against one-shot prefill."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.synthetic import SyntheticArtifact

PAGE = 16


class CpuParts:
    """A SyntheticArtifact whose parts are made once on the CPU and copied to the asked device, so
    runners on both devices see identical weights (the generator differs per device)."""

    def __init__(self, artifact: SyntheticArtifact) -> None:
        self.meta, self.path = artifact.meta, artifact.path
        self._parts = artifact.load_parts("cpu")

    def load_parts(self, device: str | torch.device = "cpu") -> dict[str, dict[str, torch.Tensor]]:
        return {n: {k: v.to(device) for k, v in p.items()} for n, p in self._parts.items()}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


@pytest.mark.parametrize("shape,weights", [("smollm2-135m", "int4"), ("qwen3-0.6b", "int8")])
def test_cuda_matches_cpu_and_chunking(shape: str, weights: str) -> None:
    artifact = CpuParts(SyntheticArtifact(shape, weights, seed=3))
    vocab = artifact.meta.config.vocab_size
    prompt = torch.randint(0, vocab, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    cpu = TorchModelRunner(artifact, num_pages=8, page_size=PAGE, device="cpu", dtype=torch.float32)
    gpu = TorchModelRunner(artifact, num_pages=8, page_size=PAGE, device="cuda", dtype=torch.float32)
    ref = cpu.forward_logits(prompt)
    one_shot = gpu.forward_logits(prompt)
    assert one_shot.device.type == "cuda" and one_shot.dtype == torch.float32
    err = rel_err(one_shot, ref)
    print(f"\n{shape} {weights}: cuda f32 vs cpu f32 rel {err:.2e}")
    assert err < 1e-4  # measured 1.3e-6 / 1.6e-6 (H200, torch 2.11+cu130)

    # chunks 30 + 37 then 3 single-token steps, pages scattered: same rows as one-shot
    pages = [6, 1, 4, 0, 7]
    rows, start = [], 0
    for n in (30, 37, 1, 1, 1):
        work = SequenceWork(seq_id=1, token_ids=prompt[start:start + n], start_pos=start, block_table=pages,
                            sample=False, sampling=SamplingParams(temperature=0.0))
        rows.append(gpu.batch_logits(ScheduledBatch([work]), all_rows=True))
        start += n
    err = rel_err(torch.cat(rows), one_shot)
    print(f"{shape} {weights}: chunked vs one-shot rel {err:.2e}")
    assert err < 1e-4  # measured 1.0e-6 / 1.6e-6

    # default dtype (bf16) on CUDA: within bf16 error of f32, and run() samples on the device
    fast = TorchModelRunner(artifact, num_pages=8, page_size=PAGE, device="cuda")
    assert fast.dtype == torch.bfloat16 and fast.kv.k[0].dtype == torch.bfloat16
    err = rel_err(fast.forward_logits(prompt), one_shot)
    print(f"{shape} {weights}: cuda bf16 vs f32 rel {err:.2e}")
    assert err < 0.05  # measured 1.1e-2 / 1.3e-2
    work = SequenceWork(seq_id=2, token_ids=prompt, start_pos=0, block_table=[0, 1, 2, 3, 4], sample=True,
                        sampling=SamplingParams(temperature=0.0))
    logits = gpu.batch_logits(ScheduledBatch([work]))
    assert gpu.run(ScheduledBatch([work])).sampled == {2: int(logits[0].argmax())}
