"""Issue 9's targets as tables, from a folder that `scripts/gpu_session.sh targets OUTDIR` filled in one
sitting: ninfer bench's JSON (ninfer_{bf16,int8,int4,smol,16k}.json and ninfer_{bf16,int8,int4}_ub2048.json,
ceilings measured in each run),
llama-bench's JSON (llamacpp_*.json) and llama-batched-bench's JSON lines (batched_*.log):

    python3 scripts/targets_table.py OUTDIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = [("bf16", "F16"), ("int8", "Q8_0"), ("int4", "Q4_1")]
TG_TARGET = {"bf16": 0.85, "int8": 0.80, "int4": 0.70}


def load(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def row(rows: list[dict], *, prompt: int = 0, gen: int = 0, depth: int = 0, conc: int = 1) -> dict | None:
    for r in rows:
        if (r.get("n_prompt", 0) == prompt and r.get("n_gen", 0) == gen and r.get("n_depth", 0) == depth
                and r.get("n_concurrency", 1) == conc):
            return r
    return None


def batched(path: Path, pl: int) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith('{"n_kv_max"'):
            r = json.loads(line)
            if r["pl"] == pl:
                return r
    return None


def ts(r: dict | None) -> str:
    return f"{r['avg_ts']:,.1f}" if r else "—"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def pct(x: float | None) -> str:
    return f"{100 * x:.1f} %" if x is not None else "—"


def main(out: Path) -> None:
    ours = {w: load(out / f"ninfer_{w}.json") for w, _ in FORMATS}
    peer = {w: load(out / f"llamacpp_{w}.json") for w, _ in FORMATS}
    first = next((r for rows in ours.values() for r in rows), {})
    ceil = first.get("ceilings") or {}
    print(f"GPU {first.get('gpu_info', '?')}, ninfer {first.get('build_number', '?')}; read ceiling "
          f"{ceil.get('read_gbs', 0):,.0f} GB/s, matmul peak {ceil.get('matmul_tflops', 0):,.0f} TFLOP/s "
          "(each ninfer run's own probes; the rows below carry their own)\n")

    print("| tg128, 1 stream | ninfer tok/s | bytes / token | GB/s | of read roofline | target | "
          "llama.cpp | ninfer / llama.cpp |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for w, t in FORMATS:
        r, p = row(ours[w], gen=128), row(peer[w], gen=128)
        print(f"| {w} / {t} | {ts(r)} | {r['bytes_per_token'] / 1e9:.2f} GB | {r['achieved_gbs']:,.0f} | "
              f"{pct(r.get('bandwidth_ratio'))} | {pct(TG_TARGET[w])} | {ts(p)} | "
              f"{ratio(r['avg_ts'], p and p['avg_ts'])} |" if r else f"| {w} / {t} | — | | | | | {ts(p)} | |")

    bf16_pp = row(ours["bf16"], prompt=2048)
    print("\n| pp2048 | ninfer tok/s | TFLOP/s | of matmul peak | of ninfer bf16 | llama.cpp | ninfer / llama.cpp |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    for w, t in FORMATS:
        r, p = row(ours[w], prompt=2048), row(peer[w], prompt=2048)
        if not r:
            print(f"| {w} / {t} | — | | | | {ts(p)} | |")
            continue
        print(f"| {w} / {t} | {ts(r)} | {r['achieved_tflops']:,.1f} | {pct(r.get('matmul_ratio'))} | "
              f"{ratio(r['avg_ts'], bf16_pp and bf16_pp['avg_ts'])} | {ts(p)} | {ratio(r['avg_ts'], p and p['avg_ts'])} |")

    ub = {w: row(load(out / f"ninfer_{w}_ub2048.json"), prompt=2048) for w, _ in FORMATS}
    if any(ub.values()):
        print("\n| pp2048 at -ub 2048 (one forward pass) | ninfer tok/s | TFLOP/s | of matmul peak | of ninfer bf16 "
              "| llama.cpp (-ub 512) | ninfer / llama.cpp |\n|---|---:|---:|---:|---:|---:|---:|")
        for w, t in FORMATS:
            r, p = ub[w], row(peer[w], prompt=2048)
            print(f"| {w} / {t} | {ts(r)} | {r['achieved_tflops']:,.1f} | {pct(r.get('matmul_ratio'))} | "
                  f"{ratio(r['avg_ts'], ub['bf16'] and ub['bf16']['avg_ts'])} | {ts(p)} | "
                  f"{ratio(r['avg_ts'], p and p['avg_ts'])} |" if r else f"| {w} / {t} | — | | | | {ts(p)} | |")

    print("\n| 8 streams, tg128 total (context 128) | ninfer tok/s | 8 streams / 1 (ninfer) | llama.cpp batched "
          "(npl 8) | llama.cpp 8 / 1 | ninfer / llama.cpp |\n|---|---:|---:|---:|---:|---:|")
    for w, t in FORMATS:
        r8, r1 = row(ours[w], gen=128, depth=128, conc=8), row(ours[w], gen=128, depth=128)
        b8, b1 = batched(out / f"batched_{w}.log", 8), batched(out / f"batched_{w}.log", 1)
        s8, s1 = b8 and b8["speed_tg"], b1 and b1["speed_tg"]
        print(f"| {w} / {t} | {ts(r8)} | {ratio(r8 and r8['avg_ts'], r1 and r1['avg_ts'])} | "
              f"{f'{s8:,.1f}' if s8 else '—'} | {ratio(s8, s1)} | {ratio(r8 and r8['avg_ts'], s8)} |")

    smol, smol_peer = load(out / "ninfer_smol.json"), load(out / "llamacpp_smol.json")
    print("\n| SmolLM2-135M int4 / Q4_1 | ninfer tok/s | llama.cpp | ninfer / llama.cpp |\n|---|---:|---:|---:|")
    for name, kw in (("tg128", dict(gen=128)), ("pp512", dict(prompt=512))):
        r, p = row(smol, **kw), row(smol_peer, **kw)
        print(f"| {name} | {ts(r)} | {ts(p)} | {ratio(r and r['avg_ts'], p and p['avg_ts'])} |")

    r, p = row(load(out / "ninfer_16k.json"), gen=128, depth=16384), row(load(out / "llamacpp_16k.json"), gen=128,
                                                                          depth=16384)
    print("\n| tg128 @ 16,384-token context, bf16 / F16 | ninfer tok/s | bytes / token (KV included) | of read roofline "
          "| target | llama.cpp | ninfer / llama.cpp |\n|---|---:|---:|---:|---:|---:|---:|")
    if r:
        print(f"| llama-8b | {ts(r)} | {r['bytes_per_token'] / 1e9:.2f} GB | {pct(r.get('bandwidth_ratio'))} | 80.0 % | "
              f"{ts(p)} | {ratio(r['avg_ts'], p and p['avg_ts'])} |")
    else:
        print(f"| llama-8b | — | | | 80.0 % | {ts(p)} | |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
