"""The torch runner's decode step on CPU, timed without the engine: a 32-token prompt, then 6 bursts
of 40 greedy one-row steps; prints ms a step per burst and the min / median of the last 5 (the
first warms up). Alternate two trees' runs for an A/B on a noisy machine.

Usage: python scripts/cpu_decode_step.py MODEL [THREADS]   (a GGUF or .ninfer; default 2 threads)
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.model_store import resolve_model
from ninfer.engine.request import SamplingParams
from ninfer.paths import cache_dir


def main() -> None:
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    artifact = Artifact.open(resolve_model(sys.argv[1], cache_dir(), announce=False))
    runner = TorchModelRunner(artifact, num_pages=8, page_size=64)
    greedy, pages = SamplingParams(temperature=0), list(range(8))
    prompt = list(range(100, 132))
    out = runner.run(ScheduledBatch([SequenceWork(seq_id=1, token_ids=prompt, start_pos=0, block_table=pages,
                                                  sample=True, sampling=greedy)]))
    token, pos, bursts = out.sampled[1], len(prompt), []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(40):
            out = runner.run(ScheduledBatch([SequenceWork(seq_id=1, token_ids=[token], start_pos=pos, block_table=pages,
                                                          sample=True, sampling=greedy, output_token_ids=[token])]))
            token, pos = out.sampled[1], pos + 1
        bursts.append((time.perf_counter() - t0) / 40 * 1e3)
    print("ms a step:", " ".join(f"{b:.2f}" for b in bursts),
          f"| min {min(bursts[1:]):.2f} median {statistics.median(bursts[1:]):.2f}")


if __name__ == "__main__":
    main()
