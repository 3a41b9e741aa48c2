"""Fidelity of a compressed KV cache (--kv-dtype) against the uncompressed one (bf16 on the cuda
backend, the attention dtype on the torch backend).

Teacher-forced: both runners see the same tokens (the reference's greedy choices), so each step's
logits compare like for like. Reports max |Δlogit| over the prompt's last position and 64 decode
steps, and greedy agreement (steps whose argmax matches the reference's).

    python scripts/kv_dtype_fidelity.py                                  # default model, CPU
    python scripts/kv_dtype_fidelity.py --synthetic llama-8b --device cuda:0 --weights bf16
    python scripts/kv_dtype_fidelity.py --backend cuda --kv-dtype fp8                  # H200, default model
    python scripts/kv_dtype_fidelity.py --backend cuda --synthetic llama-8b --kv-dtype int8
"""
from __future__ import annotations

import argparse
import json

import torch

from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press adapted from wine making. ") * 4


def run(runner, prompt: list[int], forced: list[int] | None, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of the prompt's last position and of each decode step; the decode feeds `forced`
    (teacher forcing) or, when None, the runner's own greedy choices. -> (rows, tokens fed)."""
    pages = list(range(-(-(len(prompt) + steps + 1) // runner.page_size)))

    def step(tokens: list[int], start: int) -> torch.Tensor:
        work = SequenceWork(seq_id=0, token_ids=tokens, start_pos=start, block_table=pages, sample=True,
                            sampling=SamplingParams(temperature=0.0))
        return runner.batch_logits(ScheduledBatch([work]))[0].float().cpu()

    rows = [step(prompt, 0)]
    fed: list[int] = []
    for i in range(steps):
        t = forced[i] if forced is not None else int(rows[-1].argmax())
        fed.append(t)
        rows.append(step([t], len(prompt) + i))
    return rows, fed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default=None)
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--device", default=None, help="default: cpu for torch, cuda:0 for cuda")
    ap.add_argument("--backend", default="torch", choices=["torch", "cuda"])
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.synthetic:
        from ninfer.engine.synthetic import SyntheticArtifact
        artifact = SyntheticArtifact(args.synthetic, weights=args.weights)
        prompt = [(i * 7919) % 20000 + 10 for i in range(200)]
    else:
        from ninfer.engine.artifact import Artifact
        from ninfer.engine.model_store import resolve_model
        from ninfer.engine.tokenizer import Tokenizer
        from ninfer.paths import cache_dir
        artifact = Artifact.open(resolve_model(None, cache_dir(), announce=False))
        prompt = Tokenizer.from_metadata(artifact.meta).encode(TEXT)
    pages = -(-(len(prompt) + args.steps + 1) // 64)
    device = args.device or ("cuda:0" if args.backend == "cuda" else "cpu")

    def runner(kv_dtype: str):
        if args.backend == "cuda":
            from ninfer.engine.backends.cuda_runner import CudaModelRunner
            return CudaModelRunner(artifact, num_pages=pages, device=device, cuda_graph=False, kv_dtype=kv_dtype)
        return TorchModelRunner(artifact, num_pages=pages, device=device, kv_dtype=kv_dtype)

    ref_runner = runner("auto")
    ref_rows, forced = run(ref_runner, prompt, None, args.steps)
    ours, _ = run(runner(args.kv_dtype), prompt, forced, args.steps)
    delta = max((a - b).abs().max().item() for a, b in zip(ref_rows, ours))
    scale = max(a.abs().max().item() for a in ref_rows)
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(ref_rows, ours)) / len(ours)
    ref_kv = ref_runner.k_cache[0].dtype if args.backend == "cuda" else ref_runner.kv.k[0].dtype
    report = {"model": args.synthetic or "default", "backend": args.backend, "device": device,
              "kv_dtype": args.kv_dtype, "reference_kv": str(ref_kv).removeprefix("torch."), "prompt_tokens": len(prompt),
              "steps": args.steps, "max_abs_dlogit": delta, "max_abs_logit": scale, "greedy_agreement": agree}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
