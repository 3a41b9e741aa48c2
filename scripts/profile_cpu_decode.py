"""Where a CPU decode step of the torch runner spends its time: 100 timed greedy steps of one
sequence, then cProfile over 50 more (top functions by own time).

Usage: NINFER_CACHE=/tmp/nc python scripts/profile_cpu_decode.py [MODEL.ninfer]
(default: the default model from the cache, converted on first use).
"""
import cProfile
import io
import pstats
import sys
import time

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.model_store import resolve_model
from ninfer.paths import cache_dir

a = Artifact.open(sys.argv[1] if len(sys.argv) > 1 else resolve_model(None, cache_dir(), announce=False))
r = TorchModelRunner(a, num_pages=8, page_size=64)
sp = SamplingParams(temperature=0)
prompt = list(range(100, 132))
out = r.run(ScheduledBatch([SequenceWork(seq_id=1, token_ids=prompt, start_pos=0, block_table=list(range(8)), sample=True, sampling=sp)]))
gen = [out.sampled[1]]
def step():
    o = r.run(ScheduledBatch([SequenceWork(seq_id=1, token_ids=[gen[-1]], start_pos=len(prompt)+len(gen)-1, block_table=list(range(8)), sample=True, sampling=sp, output_token_ids=gen)]))
    gen.append(o.sampled[1])
for _ in range(10): step()
t=time.perf_counter()
for _ in range(100): step()
dt=(time.perf_counter()-t)/100
print(f"runner decode {dt*1e3:.2f} ms/token ({1/dt:.1f} tok/s)")
pr = cProfile.Profile(); pr.enable()
for _ in range(50): step()
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:4000])
