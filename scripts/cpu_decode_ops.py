"""CPU decode cost of the torch runner on the default model, as robust to a shared machine as we
have: process CPU time per token on 1 thread (6 rounds of 64 greedy tokens after a 128-token
prompt; median and min of the last 5), and the torch profiler's aten op count and self CPU time
per decode step. For A/B runs of two checkouts, run it in each alternately.

Usage: PYTHONPATH=.:scripts python scripts/cpu_decode_ops.py [LABEL]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import bench_cpu as B
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.tokenizer import Tokenizer

torch.set_num_threads(1)
label = sys.argv[1] if len(sys.argv) > 1 else "ninfer"
artifact = B.artifact_for(B.find_gguf())
ids = B.prompt_ids(Tokenizer.from_metadata(artifact.meta))
runner = TorchModelRunner(artifact, num_pages=4, page_size=64)
greedy = SamplingParams(temperature=0.0)
table = [0, 1, 2, 3]


def prefill() -> list[int]:
    seq = SequenceWork(seq_id=0, token_ids=ids, start_pos=0, block_table=table, sample=True, sampling=greedy)
    return [runner.run(ScheduledBatch([seq])).sampled[0]]


def step(out: list[int]) -> None:
    seq = SequenceWork(seq_id=0, token_ids=[out[-1]], start_pos=len(ids) + len(out) - 1, block_table=table,
                       sample=True, sampling=greedy, output_token_ids=out)
    out.append(runner.run(ScheduledBatch([seq])).sampled[0])


per_token = []
for _ in range(6):
    out = prefill()
    t0 = time.process_time()
    for _ in range(64):
        step(out)
    per_token.append((time.process_time() - t0) / 64 * 1e3)
out = prefill()
for _ in range(5):
    step(out)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        step(out)
events = prof.key_averages()
ops = sum(e.count for e in events) / 5
self_ms = sum(e.self_cpu_time_total for e in events) / 5 / 1e3
print(f"{label}: decode CPU ms/token median {statistics.median(per_token[1:]):.2f} min {min(per_token[1:]):.2f}; "
      f"aten ops/step {ops:.0f}, profiler self CPU {self_ms:.1f} ms/step")
