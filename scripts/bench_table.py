"""One line a result from a folder of `llama-bench -o json` / `ninfer bench -o json` files named
NAME_ROUND.json (scripts/gpu_session.sh, scripts/cpu_peer_ab.sh):

    python3 scripts/bench_table.py OUTDIR
"""
import glob
import json
import sys

for path in sorted(glob.glob(sys.argv[1] + "/*_[12].json")):
    try:
        rows = json.load(open(path))
    except ValueError as e:
        print(f"{path}: no result ({e})")
        continue
    for r in rows:
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        print(f"{path.split('/')[-1]:45s} {test:6s} {r['avg_ts']:9.2f} ± {r['stddev_ts']:.2f}")
