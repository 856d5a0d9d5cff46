#!/usr/bin/env bash
# Interleaved A/B in one device call: the tree before a change (old) against the working tree
# (new), each run a process of its own, for issue 36's speed condition ("bench/baseline.py and
# bench/flashloop_speed.py at 1x8K do not get slower").
#
# Here, in the repo root, before the call (old-tree/ travels as untracked files; never commit it):
#   rm -rf old-tree && mkdir old-tree && git archive 36f741f specloop | tar -x -C old-tree
# Device call (no wheels: neither script imports the serving stack), timeout_s 600:
#   OLD=old-tree bash bench/ab.sh            (or: bash bench/ab.sh old-tree)
# Afterwards here: rm -rf old-tree
#
# Per round (ROUNDS, default 3; odd rounds old then new, even rounds new then old), for each PART:
# - baseline: bench/baseline.py whole (it has no case flags; about 15 s of cases on the H200),
#   --decode-tokens BASE_DECODE; the A/B rows are its batch-1 decode after 8K and its 8K TTFT;
# - flashloop: bench/flashloop_speed.py --speculation none --variants VARIANTS (dense,all) --cases
#   1xLENGTH --warmup-tokens LENGTH (kernels of the 8K prompt compile before the timed case).
# Each process runs with `cd <tree>` and PYTHONPATH=<tree>, so `import specloop` is that tree's
# package (checked first); the bench scripts are the tree's own when it has bench/baseline.py,
# else the working tree's (bench/{baseline,flashloop_speed,kv_residual}.py are identical at
# 36f741f and 4a8472a). One random checkpoint (MODEL, PRESET) is written once by the new tree.
# Triton's disk cache is shared: the first run pays the compiles in its wall time, not in the
# metrics (each script warms up in-process before it times anything).
# Every run has a time limit (LIMIT_*, cut to what is left of BUDGET, seconds since the script
# started); a pair (old and new of one part and round) starts only when the rest of BUDGET holds
# both runs (each estimated as the last run of that part + 10 s), else both are skipped and the
# call still ends with a summary. Expected on the H200 (estimated from bench/results, not yet
# measured): ~35 s a warm baseline run, ~30 s a warm flashloop run, a minute more for the first
# runs' compiles, ~20 s for the checkpoint: 7-9 min for the defaults. If pairs were skipped,
# run PARTS=baseline and PARTS=flashloop in two calls. Per-run JSONs and logs
# stay in WORK; bench/ab_summary.py merges them into $OUT/ab_summary.json (runs, table, every raw
# JSON, log tails) and prints the table: old / new medians, new/old, per-round values.
# Knobs: ROUNDS=3 PARTS="baseline flashloop" MODEL=/tmp/ouro14 PRESET=ouro-1.4b LENGTH=8192
# DECODE=64 BASE_DECODE=128 VARIANTS=dense,all DEVICE=cuda MAX_MODEL_LEN=33024 (empty: the model's)
# KV_BYTES (empty: the script's 100 GiB) BUDGET=550 LIMIT_BASELINE=200 LIMIT_FLASHLOOP=200 PYTHON=python
# WORK=/tmp/ab. baseline.py is CUDA-only (a CPU smoke run needs a shim that moves it to the CPU).
set -u
OLD=${1:-${OLD:-}}
[ -n "$OLD" ] && [ -f "$OLD/specloop/__init__.py" ] || { echo "ab.sh: OLD=<dir holding the old specloop/>"; exit 2; }
NEW=$(pwd -P); OLD=$(cd "$OLD" && pwd -P)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/ab}; rm -rf "$WORK"; mkdir -p "$WORK"
ROUNDS=${ROUNDS:-3}; PARTS=${PARTS:-baseline flashloop}; PY=${PYTHON:-python}
MODEL=${MODEL:-/tmp/ouro14}; PRESET=${PRESET:-ouro-1.4b}; LENGTH=${LENGTH:-8192}
DECODE=${DECODE:-64}; BASE_DECODE=${BASE_DECODE:-128}; VARIANTS=${VARIANTS:-dense,all}; DEVICE=${DEVICE:-cuda}
MAX_MODEL_LEN=${MAX_MODEL_LEN-33024}; KV_BYTES=${KV_BYTES:-}; BUDGET=${BUDGET:-550}
declare -A LIMIT=([baseline]=${LIMIT_BASELINE:-200} [flashloop]=${LIMIT_FLASHLOOP:-200})
declare -A NEED=([baseline]=60 [flashloop]=50)  # a run's expected wall, then the last one's + 10 s
export PYTHONUNBUFFERED=1
tree_of() { [ "$1" = old ] && echo "$OLD" || echo "$NEW"; }
bench_of() { [ -f "$1/bench/baseline.py" ] && echo "$1/bench" || echo "$NEW/bench"; }
code_hash() { (cd "$1" && find specloop -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12); }

META=(--meta "rounds=$ROUNDS" --meta "parts=$PARTS" --meta "length=$LENGTH" --meta "decode=$DECODE"
      --meta "base_decode=$BASE_DECODE" --meta "variants=$VARIANTS" --meta "model=$MODEL" --meta "preset=$PRESET"
      --meta "new_git=$(git -C "$NEW" rev-parse --short HEAD 2>/dev/null || echo none)"
      --meta "new_dirty_files=$(git -C "$NEW" status --porcelain -uno 2>/dev/null | wc -l)")
for side in old new; do  # which specloop each side imports (from a neutral directory, as a script does)
  t=$(tree_of $side)
  got=$(cd /tmp && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" $PY -c 'import specloop; print(specloop.__file__)')
  [ "$got" = "$t/specloop/__init__.py" ] || { echo "ab.sh: $side imports $got, not $t"; exit 2; }
  META+=(--meta "${side}_tree=$t" --meta "${side}_bench=$(bench_of "$t")" --meta "${side}_code_sha=$(code_hash "$t")")
  echo "$side: $t (specloop *.py sha256 $(code_hash "$t"), bench $(bench_of "$t"))"
done
if [ ! -f "$MODEL/config.json" ]; then
  $PY -m specloop.cli random-checkpoint "$MODEL" --preset "$PRESET" >"$WORK/checkpoint.log" 2>&1 \
    || { tail -5 "$WORK/checkpoint.log"; exit 1; }
fi
gpu=$(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>/dev/null | head -1)
META+=(--meta "gpu=${gpu:-none}")
echo "checkpoint ready at ${SECONDS} s; gpu: ${gpu:-none}"

skip() {  # round, side, part
  echo "r$1 $2 $3: skipped, $((BUDGET - SECONDS)) s of BUDGET left"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" skipped 0 - - >>"$WORK/runs.tsv"
}
one() {  # one run: round, side, part
  local r=$1 side=$2 part=$3 t bench json log left limit t0 rc
  t=$(tree_of "$side"); bench=$(bench_of "$t"); json=$WORK/ab_${part}_${side}_r$r.json; log=${json%.json}.log
  left=$((BUDGET - SECONDS))
  [ "$left" -lt "${NEED[$part]}" ] && { skip "$r" "$side" "$part"; return; }
  limit=${LIMIT[$part]}; [ "$limit" -gt "$left" ] && limit=$left
  local cmd
  if [ "$part" = baseline ]; then
    cmd=("$bench/baseline.py" --model "$MODEL" --decode-tokens "$BASE_DECODE" --out "$json")
  else
    cmd=("$bench/flashloop_speed.py" --model "$MODEL" --device "$DEVICE" --speculation none --variants "$VARIANTS"
         --cases "1x$LENGTH" --warmup-tokens "$LENGTH" --decode-tokens "$DECODE"
         ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"} ${KV_BYTES:+--kv-bytes "$KV_BYTES"} --out "$json")
  fi
  t0=$SECONDS
  (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$limit" $PY "${cmd[@]}") >"$log" 2>&1
  rc=$?
  local wall=$((SECONDS - t0))
  NEED[$part]=$((wall + 10))
  echo "r$r $side $part: rc $rc, ${wall} s (at ${SECONDS} s)"
  [ "$rc" = 0 ] || tail -3 "$log" | cut -c1-160
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$side" "$part" "$rc" "$wall" "$json" "$log" >>"$WORK/runs.tsv"
}

for r in $(seq "$ROUNDS"); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for part in $PARTS; do  # a pair starts only when both of its runs fit: half a pair is no A/B
    pair=$((BUDGET - SECONDS >= 2 * NEED[$part]))
    for side in $order; do
      if [ "$pair" = 1 ]; then one "$r" "$side" "$part"; else skip "$r" "$side" "$part"; fi
    done
  done
done
$PY "$NEW/bench/ab_summary.py" --runs "$WORK/runs.tsv" --out "$OUT/ab_summary.json" "${META[@]}"
