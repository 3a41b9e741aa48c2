"""Speculative decoding A/B on three workloads: rewrite a code file with one change, summarize a
text by quoting it, and free chat (issue 14). One Engine with --spec; requests alternate between
speculation on and off (hints["speculative"] False), interleaved so machine load hits both alike.

Reports per workload and arm: output tokens, decode tok/s (the request's timings), tokens per
decode step, drafted/accepted tokens and acceptance by draft position, and the on/off speed ratio.

  python scripts/spec_bench.py                                  # default model, CPU, lookup K=4
  python scripts/spec_bench.py --backend cuda --draft-tokens 4 --reps 5
  python scripts/spec_bench.py --synthetic llama-8b --backend cuda --max-tokens 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ninfer.engine.config import SchedulerConfig, SpecConfig
from ninfer.engine.request import PreparedRequest, SamplingParams

CODE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Inventory:
    """Items in a store, by name, with their counts and unit prices."""

    counts: dict[str, int] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, count: int, price: float) -> None:
        self.counts[name] = self.counts.get(name, 0) + count
        self.prices[name] = price

    def remove(self, name: str, count: int) -> None:
        if self.counts.get(name, 0) < count:
            raise ValueError(f"only {self.counts.get(name, 0)} {name} left")
        self.counts[name] -= count

    def value(self) -> float:
        return sum(self.counts[n] * self.prices[n] for n in self.counts)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"counts": self.counts, "prices": self.prices}))

    @classmethod
    def load(cls, path: Path) -> "Inventory":
        data = json.loads(path.read_text())
        return cls(counts=data["counts"], prices=data["prices"])
'''

TEXT = ("The lighthouse on the northern cape was built in 1872 to guide fishing boats past the reef. "
        "For ninety years a keeper lived in the small house beside it and climbed the tower every evening "
        "to light the lamp. In 1962 the lamp was electrified, and the last keeper, Margaret Hale, left the "
        "cape the following spring. The tower was then closed to visitors for three decades. In 1994 a local "
        "society restored the house and opened a small museum, which now shows the original lens, the keepers' "
        "logbooks and photographs of the shipwrecks that the light was meant to prevent. The museum is open "
        "from May to September, and the view from the gallery reaches the islands on a clear day.")

WORKLOADS = {
    "code-rewrite": "Rewrite the following Python file in full, renaming the method `value` to `total_value`. "
                    "Output only the code.\n\n" + CODE,
    "quote-summary": "Summarize the following text by quoting its most important sentences word for word.\n\n" + TEXT,
    "free-chat": "Tell me a short story about a cat who wants to become a sailor.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--synthetic", default=None, help="random weights of a named shape (prompts keep the "
                                                      "default model's token ids)")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=3, help="A/B pairs per workload")
    ap.add_argument("--warmup", choices=("each", "once"), default="each",
                    help="an unrecorded warm-up pair before each workload, or only before the first")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", default=None, help="also write the per-request records here")
    ap.add_argument("--arms", default="off,on", help="off,on (A/B) or on alone (acceptance only)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.loader import resolve_backend, start_engine
    from ninfer.engine.model_store import resolve_model
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.paths import cache_dir

    backend, device = resolve_backend(args.backend, 0)
    text_model = Artifact.open(resolve_model(args.model, cache_dir(), announce=False))
    tokenizer = Tokenizer.from_metadata(text_model.meta)
    if args.synthetic:
        from ninfer.engine.synthetic import SyntheticArtifact
        artifact = SyntheticArtifact(args.synthetic, args.weights)
    else:
        artifact = text_model
    spec = SpecConfig("lookup", draft_tokens=args.draft_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    loaded = start_engine(artifact, backend=backend, torch_device=device,
                          scheduler=SchedulerConfig(max_concurrency=1, prefix_reuse=False, max_context=4096),
                          kv_capacity=4096, kernel_cache_dir=cache_dir() / "kernels", spec=spec)
    engine = loaded.engine
    prompts = {name: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
               for name, text in WORKLOADS.items() if name in args.workloads.split(",")}
    records = []
    try:
        for w, (name, ids) in enumerate(prompts.items()):
            outputs = {}
            first = 0 if args.warmup == "each" or w == 0 else 1
            for rep in range(first, args.reps + 1):
                arms = [a for a in (("on", "off") if rep % 2 else ("off", "on")) if a in args.arms.split(",")]
                for arm in arms:  # alternate which arm goes first
                    final, out = None, []
                    rid = f"{name}-{arm}-{rep}-{time.monotonic_ns()}"
                    for ev in engine.submit(PreparedRequest(
                            request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                            max_tokens=args.max_tokens, hints={"speculative": arm == "on"})):
                        out += ev.token_ids
                        final = ev
                    outputs.setdefault(arm, out)
                    sp = final.speculative or {}
                    print(f"  {name} {arm} rep {rep}: {final.timings.predicted_n} tokens, "
                          f"{final.timings.predicted_per_second:.2f} tok/s, accepted {sp.get('accepted_tokens', 0)}/"
                          f"{sp.get('drafted_tokens', 0)} in {sp.get('rounds', 0)} rounds, by position "
                          f"{sp.get('accepted_per_position', [])}", file=sys.stderr, flush=True)
                    if rep == 0:
                        continue  # warm-up pair
                    t, sp = final.timings, final.speculative or {}
                    after_first = max(t.predicted_n - 1, 0)
                    steps = after_first - sp.get("accepted_tokens", 0)
                    records.append({"workload": name, "arm": arm, "rep": rep, "prompt_tokens": len(ids),
                                    "output_tokens": t.predicted_n, "decode_tok_s": t.predicted_per_second,
                                    "tokens_per_step": after_first / steps if steps else 0.0,
                                    "drafted": sp.get("drafted_tokens", 0), "accepted": sp.get("accepted_tokens", 0),
                                    "rounds": sp.get("rounds", 0), "fallback_steps": sp.get("fallback_steps", 0),
                                    "accepted_per_position": sp.get("accepted_per_position", [])})
            if len(outputs) == 2:
                same = outputs["on"] == outputs["off"]
                print(f"{name}: outputs identical with and without speculation: {same}", flush=True)
    finally:
        engine.shutdown()
    report(records, args.draft_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def report(records: list[dict], k: int) -> None:
    print("\n| workload | arm | out tok | decode tok/s (mean ± sd) | tok/step | accepted/drafted | "
          f"acceptance by position 1..{k} | speed-up |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for name in dict.fromkeys(r["workload"] for r in records):
        rates = {}
        for arm in ("off", "on"):
            rs = [r for r in records if r["workload"] == name and r["arm"] == arm]
            if not rs:
                continue
            tps = [r["decode_tok_s"] for r in rs]
            rates[arm] = statistics.fmean(tps)
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            rounds = sum(r["rounds"] for r in rs)
            pos = [sum(r["accepted_per_position"][i] if i < len(r["accepted_per_position"]) else 0 for r in rs)
                   for i in range(k)]
            by_pos = " ".join(f"{p / rounds:.2f}" for p in pos) if rounds else "-"
            sd = statistics.stdev(tps) if len(tps) > 1 else 0.0
            speed = f"{rates['on'] / rates['off']:.2f}x" if arm == "on" and rates.get("off") else ""
            print(f"| {name} | {arm} | {statistics.fmean(r['output_tokens'] for r in rs):.0f} | "
                  f"{rates[arm]:.1f} ± {sd:.1f} | {statistics.fmean(r['tokens_per_step'] for r in rs):.2f} | "
                  f"{accepted}/{drafted} | {by_pos} | {speed} |")


if __name__ == "__main__":
    main()
