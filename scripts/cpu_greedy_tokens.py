"""Greedy tokens of the default CPU path (bf16, packed int4 decode) on the fidelity prompts of
tests/test_model_fidelity.py, for checking that a speed change leaves them unchanged: prints one
JSON object {prompt index: [64 tokens]} (single lane, then the three prompts as lanes of one batch).

Usage: NINFER_CACHE=... PYTHONPATH=.:tests python scripts/cpu_greedy_tokens.py > before.json
(then again after the change, and compare; 1 thread, so the thread count is not a variable).
"""
import json

import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.model_store import resolve_model
from ninfer.engine.tokenizer import Tokenizer
from ninfer.paths import cache_dir
from torch_model_helpers import ours_greedy

torch.set_num_threads(1)
STEPS = 64
artifact = Artifact.open(resolve_model(None, cache_dir(), announce=False))
tok = Tokenizer.from_metadata(artifact.meta)
chat = tok.apply_chat_template([{"role": "user", "content": "What is the boiling point of water?"}])
texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", chat]
prompts = [tok.encode(t) for t in texts]
runner = TorchModelRunner(artifact, num_pages=48, page_size=16)
per = -(-(max(map(len, prompts)) + STEPS) // 16)
out = {}
for i, ids in enumerate(prompts):
    out[f"single{i}"] = ours_greedy(runner, [ids], STEPS, [list(range(per))])[0]
batched = ours_greedy(runner, prompts, STEPS, [[i + 3 * j for j in range(per)][::-1] for i in range(3)])
for i, toks in enumerate(batched):
    out[f"batch{i}"] = toks
print(json.dumps(out))
