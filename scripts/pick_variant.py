"""The decode variant label to run issue 9's targets with, from `scripts/gpu_session.sh mma` and `attn`
results in one or more folders: the gemv label with the best mean tg128 over its rounds (tg128_<label>_<r>.json,
'-' standing for '+'; p2 is the built-in choice), the 16k attention label (tg128_d16384_<label>[_<r>].json), and v when the sampler's
SAMPLE_VEC scan beat today's on average (sample_vec_<r>.json against sample_scan_<r>.json), and the tiled
gemv's int4 and int8 labels (`tiled`: int4_<label>_<r>.json, int8_<label>_<r>.json against their rule). A candidate
must beat the built-in choice by more than 1 % to be named; prints the label ('+'-joined; "rule" when
nothing beats the built-ins) and, on stderr, the means behind it.

    python scripts/pick_variant.py OUTDIR [OUTDIR ...]
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

MARGIN = 1.01


def means(folders: list[Path], pattern: str) -> dict[str, float]:
    """label -> mean avg_ts over the files whose name matches `pattern` (group 1: the label)."""
    runs: dict[str, list[float]] = {}
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            m = re.fullmatch(pattern, f.name)
            if not m:
                continue
            try:
                runs.setdefault(m.group(1), []).append(float(json.loads(f.read_text())[0]["avg_ts"]))
            except (ValueError, KeyError, IndexError, TypeError):
                print(f"skipped {f}: no result", file=sys.stderr)
    return {label: statistics.mean(v) for label, v in runs.items()}


def best(table: dict[str, float], default: str) -> str:
    """The fastest label; the default unless another beats it by MARGIN (or the default is missing)."""
    if not table:
        return default
    top = max(table, key=table.get)
    if default in table and table[top] <= MARGIN * table[default]:
        return default
    return top


def main() -> None:
    folders = [Path(a) for a in sys.argv[1:]]
    if not folders:
        raise SystemExit(__doc__)
    gemv = {k.replace("-", "+"): v for k, v in means(folders, r"tg128_((?!d16384)[a-z0-9-]+)_\d+\.json").items()}
    attn = means(folders, r"tg128_d16384_([a-z0-9]+)(?:_\d+)?\.json")
    sampler = means(folders, r"sample_(scan|vec)_\d+\.json")
    int4 = {k.replace("-", "+"): v for k, v in means(folders, r"int4_([a-z0-9-]+)_\d+\.json").items()}
    int8 = {k.replace("-", "+"): v for k, v in means(folders, r"int8_([a-z0-9-]+)_\d+\.json").items()}
    for name, table in (("gemv", gemv), ("16k", attn), ("sampler", sampler), ("int4", int4), ("int8", int8)):
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(table.items())), file=sys.stderr)
    # p2 is launchers.mma_variant's rule but for the lm_head-sized rows (8 there), and s32 today's
    # partition cap: neither needs naming, and naming p2 would take the lm_head's 8 away
    parts = (best(gemv, "p2").split("+") + [best(attn, "s32"), "vec" if best(sampler, "scan") == "vec" else ""]
             + best(int4, "rule").split("+") + best(int8, "rule").split("+"))
    label = "+".join(dict.fromkeys("v" if p == "vec" else p for p in parts if p and p not in ("p2", "s32", "rule")))
    print(label or "rule")


if __name__ == "__main__":
    main()
