#!/usr/bin/env bash
# Alternating A/B of `ninfer bench` between another checkout (A, e.g. `git worktree add /tmp/a <commit>`
# or an unpacked `git archive`) and this one (B), on one machine:
#   scripts/ab_bench.sh A_DIR OUTDIR [ROUNDS] [-- bench args]
# Each round runs A then B with the same arguments; writes OUTDIR/{a,b}_<round>.json and prints a table.
set -uo pipefail
cd "$(dirname "$0")/.."
A="${1:?usage: scripts/ab_bench.sh A_DIR OUTDIR [ROUNDS] [-- bench args]}"
OUT="${2:?usage}"
ROUNDS="${3:-2}"
shift $(( $# >= 3 ? 3 : $# ))
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--synthetic llama-8b --backend cuda -p 512 -n 128 -r 3)
mkdir -p "$OUT"
B="$PWD"
for r in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    dir=$([ "$side" = a ] && echo "$A" || echo "$B")
    (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m ninfer.cli.main bench "${ARGS[@]}" -o json) \
      > "$OUT/${side}_$r.json" 2> "$OUT/${side}_$r.err" || echo "$side round $r failed: $(tail -3 "$OUT/${side}_$r.err")"
  done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for r in range(1, rounds + 1):
    for side in "ab":
        try:
            rows = json.load(open(f"{out}/{side}_{r}.json"))
        except (OSError, ValueError):
            continue
        for row in rows:
            test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
            print(f"round {r} {side}: {test:7} conc={row['n_concurrency']} {row['avg_ts']:10.2f} ± {row['stddev_ts']:.2f} tok/s")
PY
