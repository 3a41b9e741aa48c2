"""Compare two outputs of scripts/cpu_greedy_tokens.py: per run, the first step where the greedy
tokens differ, and there the f32 reference's (transformers on the dequantized GGUF) logits of the
two tokens and its top-2 margin (a near-tie when small).

Usage: PYTHONPATH=.:tests python scripts/cpu_greedy_compare.py BEFORE.json AFTER.json
"""
import json
import sys

from ninfer.engine.artifact import Artifact
from ninfer.engine.model_store import resolve_model
from ninfer.engine.tokenizer import Tokenizer
from ninfer.paths import cache_dir
from torch_model_helpers import hf_from_gguf, hf_logits

before, after = (json.load(open(p)) for p in sys.argv[1:3])
artifact = Artifact.open(resolve_model(None, cache_dir(), announce=False))
tok = Tokenizer.from_metadata(artifact.meta)
chat = tok.apply_chat_template([{"role": "user", "content": "What is the boiling point of water?"}])
texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", chat]
prompts = [tok.encode(t) for t in texts]
hf = None
for key in before:
    a, b = before[key], after[key]
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        print(f"{key}: identical ({len(a)} tokens)")
        continue
    if hf is None:
        from ninfer.engine.model_store import default_model_source
        hf = hf_from_gguf(default_model_source())
    logits = hf_logits(hf, prompts[int(key[-1])] + a[:i])[-1]
    top = logits.topk(2)
    print(f"{key}: first difference at step {i}: {a[i]} -> {b[i]}; reference logits {logits[a[i]]:.4f} / "
          f"{logits[b[i]]:.4f}, reference top-2 margin {float(top.values[0] - top.values[1]):.4f}")
