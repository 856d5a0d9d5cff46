#!/usr/bin/env bash
# The GPU suite and the fast-path benchmarks in one device call (../shared/docs/gpu.md):
#   bash bench/gpu_suite.sh        (on the device machine, wheels installed, $OUT set)
# Each step has its own time limit; results land in $OUT, a summary on stdout. Each PART
# fits one 10-minute device call: PART=tests the GPU tests; PART=bench the model check,
# baseline and profile; PART=serve the engine check, the speculation replay and the
# served load; PART=preempt the preemption tests on the GPU and bench/preemption.py;
# PART=flashloop the token-sparse prefill GPU tests and bench/sparse_prefill.py;
# PART=quality bench/flashloop_quality.py and the shipped model's acceptance (carry
# out/stdlib_tokens.npz); PART=residual the INT4 residual kernels' and engine's GPU tests
# (graph replay and no-sync included); PART=residual-bench bench/profile_kv_residual.py with
# graphs and bench/kv_residual.py's decode (batch 1 at 8K and 32K, 128 x 1K);
# PART=residual-capacity its memory and capacity parts (20 GiB, 24 x 8K); PART=reader-sweep
# bench/packed_reader_sweep.py (the packed reader's block_n, splits and warps); PART=residual-quick
# the packed reader's kernel tests and its engine and graph-replay tests only; PART=sealed-reader its
# kernel tests, then the sweep with the sealed pass on (one-lane), tc (tensor cores) and off (SEALED), its warps (batch 1 and 32); PART=packed-sparse
# sparse decode over INT4 planes (kernel tests, no-sync, the matrix's INT4 sparse graph cells,
# all three's batch-1 8K profile and its batch-1 speed at 8K / 32K with and without block
# rounds, TAG a suffix of the jsons); PART=sparse-decode
# the sparse decode kernels' and engine's GPU tests, the no-sync cases, the feature matrix's graph
# cells (greedy, fp32 and bf16) and bench/sparse_decode_kernels.py; PART=sparse-tune the matrix's bf16 graph cells and
# the sparse decode kernels cold (--layers 8) with variants (SPLITS, CORRECTIONS); PART=flashloop-speed bench/flashloop_speed.py (SPEC,
# VARIANTS, CASES, WARMUP: warm-up prompt tokens, e.g. the case length to keep compilation out of the TTFT;
# DECODE: tokens each request decodes; CUT: seconds after which a case is aborted and reported as cut;
# TAG: a suffix of the json's name); PART=sparse-profile bench/profile_decode.py at 8K, dense and with sparse decode attention (PROFILE:
# the variants, e.g. "dense sparse int4 all"; BATCHES, e.g. 1,16); PART=int4-prefill the INT4
# prompt chunks' kernel, engine, graph and no-sync tests and bench/profile_prefill.py at 8K (dense,
# int4; ROWS: the plan sizes, default "2048 8192"); PART=yardstick bench/plain_path.py (issue 39's plain compiled
# path) and bench/baseline.py in one call; PART=serve-sweep bench/serve.py at concurrency 16/64/128 (CONCURRENCY),
# dense and with block rounds (plot: bench/plot_serve.py); PART=prefix-cache the prefix caching engine tests on the GPU and
# bench/prefix_cache.py (64 requests sharing a 4K prefix, caching off and on): fp32 (outputs equal), bf16 with
# its noise floor (the uncached engine with other chunks), INT4 (32 requests); PART=sparse-split sparse decode's
# graphs split by part (SPECLOOP_SPARSE_SPLIT_GRAPHS=1): its engine and matrix graph tests on, then batch-1 decode
# after 8K with it off and on, one process each, alternated. Unset: tests, preempt, bench and serve, one after the other.
set -u
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Warning lines are dropped, except pytest's summary ("N passed, M warnings in ...").
step() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 \
  | awk 'tolower($0) !~ /warn/ || / passed| failed| error/' | tail -"${TAIL:-14}"; }
PART=${PART:-all}
if [ "$PART" = tests ] || [ "$PART" = all ]; then
# Two pytest runs (kernels; engine), each with the summary of every failure: one slow or
# failing file must not hide the others (a single 200 s run timed out in the middle).
TAIL=30 step 200 python -m pytest -q -rf --tb=line tests/test_kernels_norms.py tests/test_kernels_rope.py \
  tests/test_kernels_kv_write.py tests/test_kernels_paged_attention.py
TAIL=30 step 330 python -m pytest -q -rf --tb=line tests/test_cuda_graphs.py tests/test_fused_layer_ops.py \
  tests/test_attention_backends.py tests/test_cuda_no_sync.py tests/test_forward_batch.py tests/test_multi_loop.py \
  tests/test_fused_projections.py
fi
if [ "$PART" = preempt ] || [ "$PART" = all ]; then
TAIL=12 step 300 python -m pytest -q -rf --tb=short tests/test_preemption.py tests/test_snapshot.py
fi
[ "$PART" = tests ] && exit 0
if [ "$PART" = flashloop ]; then
  TAIL=8 step 150 python -m pytest -q -rf --tb=short tests/test_token_sparse_prefill.py tests/test_cuda_no_sync.py
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=20 step 330 python bench/sparse_prefill.py --model /tmp/ouro14 --out "$OUT/sparse_prefill_h200.json"
  exit 0
fi
if [ "$PART" = residual-quick ]; then  # after a packed-reader change: its kernel, engine and graph tests
  TAIL=12 step 200 python -m pytest -q -rf --tb=short tests/test_kernels_packed_attention.py
  TAIL=12 step 330 python -m pytest -q -rf --tb=short tests/test_kv_residual_engine.py tests/test_cuda_graphs.py \
    -k "cuda or int4"  # (over 200 s at 54f0c8f)
  exit 0
fi
if [ "$PART" = residual ]; then
  TAIL=12 step 200 python -m pytest -q -rf --tb=short tests/test_kernels_residual_encode.py \
    tests/test_kernels_packed_attention.py tests/test_kernels_int4_groups.py
  TAIL=12 step 300 python -m pytest -q -rf --tb=short tests/test_kv_residual_engine.py tests/test_cuda_graphs.py \
    tests/test_cuda_no_sync.py -k "cuda or int4 or spec4 or spec5"
  exit 0
fi
if [ "$PART" = residual-bench ]; then  # CUDA graphs on both sides
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=12 step 120 python bench/profile_kv_residual.py --model /tmp/ouro14 --graphs --prompt 8192 \
    --out "$OUT/profile_kv_residual_graphs_h200.json"
  TAIL=20 step 420 python bench/kv_residual.py --model /tmp/ouro14 --out "$OUT/kv_residual_decode_h200.json" \
    --parts decode --lengths 8192,32768 --decode-tokens 32 --concurrent 128 --concurrent-prompt 1024
  exit 0
fi
if [ "$PART" = reader-sweep ]; then  # the packed reader alone against the BF16 kernel, batch 1 and 32
  TAIL=80 step 300 python bench/packed_reader_sweep.py --out "$OUT/packed_reader_sweep_h200.json"
  TAIL=30 step 200 python bench/packed_reader_sweep.py --batch 32 --lengths 1024 --splits engine,8 --warps default \
    --out "$OUT/packed_reader_sweep_b32_h200.json"
  exit 0
fi
if [ "$PART" = sealed-reader ]; then  # the packed reader's sealed pass: its kernel tests, then on/off sweeps
  TAIL=8 step 150 python -m pytest -q -rf --tb=short -n 8 -p xdist tests/test_kernels_packed_attention.py \
    tests/test_kernels_sparse_decode.py
  TAIL=60 step 200 python bench/packed_reader_sweep.py --depth 0,3 --block-n 32 --splits engine --warps default \
    --sealed ${SEALED:-on,tc,off} --sealed-warps ${SEALED_WARPS:-default} --sealed-chunk 32 \
    --out "$OUT/packed_reader_sweep_sealed${TAG:-}_h200.json"
  TAIL=30 step 150 python bench/packed_reader_sweep.py --batch 32 --lengths 8192 --depth 0,3 --block-n 32 \
    --splits engine --warps default --sealed ${SEALED:-on,tc,off} --sealed-warps ${SEALED_WARPS:-default} --sealed-chunk 32 \
    --out "$OUT/packed_reader_sweep_sealed${TAG:-}_b32_h200.json"
  exit 0
fi
if [ "$PART" = sparse-decode ]; then  # sparse decode attention: kernels, engine, no-sync, graphs, matrix graph cells
  TAIL=6 step 120 python -m pytest -q -rf --tb=line -n 8 -p xdist tests/test_kernels_sparse_decode.py
  TAIL=8 step 300 python -m pytest -q -rf --tb=line tests/test_cuda_no_sync.py tests/test_sparse_decode_engine.py \
    -k "sparse or cuda"
  TAIL=8 step 150 python -m pytest -q -rf --tb=line tests/test_cuda_graphs.py
  TAIL=12 step 300 python -m pytest -q -rf --tb=line tests/test_flashloop_matrix.py -k "graph and ${CELLS:-greedy}"
  TAIL=12 step 100 python bench/sparse_decode_kernels.py --reps 10 --out "$OUT/sparse_decode_kernels_h200.json"
  exit 0
fi
if [ "$PART" = packed-sparse ]; then  # sparse decode over INT4 planes: kernels, no-sync, matrix INT4 cells, profile
  TAIL=6 step 120 python -m pytest -q -rf --tb=line -n 8 -p xdist tests/test_kernels_packed_attention.py \
    tests/test_kernels_sparse_decode.py
  TAIL=8 step 150 python -m pytest -q -rf --tb=line tests/test_cuda_no_sync.py -k "sparse or int4"
  TAIL=30 step 200 python -m pytest -q -rf --tb=line -s tests/test_flashloop_matrix.py -k "graph and decode and int4"
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=30 step 120 python bench/profile_decode.py --model /tmp/ouro14 --prompt 8192 --batches 1 --steps 20 \
    --max-model-len 33024 --top 20 --sparse-decode-attention '{}' --kv-residual-quantization '{}' \
    --token-sparse-prefill '{}' --out "$OUT/profile_decode_all_8k_${TAG:-kept}_h200.json"
  TAIL=12 step 200 python bench/flashloop_speed.py --model /tmp/ouro14 --speculation none,block --variants all \
    --cases 1x8192,1x32768 --max-model-len 33024 --decode-tokens 32 \
    --out "$OUT/flashloop_speed_none-block_all_b1_${TAG:-kept}_h200.json"
  exit 0
fi
if [ "$PART" = sparse-tune ]; then  # the matrix's bf16 graph cells; the sparse decode kernels cold (8 layers), variants
  timeout 330 python -m pytest -q -rf --tb=line -s tests/test_flashloop_matrix.py -k bf16 > "$OUT/bf16_cells.log" 2>&1
  grep -E "bf16 cell|passed|failed|FAIL|Error" "$OUT/bf16_cells.log" | tail -60
  TAIL=40 step 240 python bench/sparse_decode_kernels.py --reps 10 --layers 8 --max-context 33024 --profile \
    --select-variants "" --split-variants "${SPLITS:-auto@512,auto@512:r10,auto@512:g128,32@512,64@256}" \
    --correction-variants "${CORRECTIONS:-4,32,64,17:64,32:64}" --out "$OUT/sparse_decode_kernels_cold_h200.json"
  exit 0
fi
if [ "$PART" = sparse-profile ]; then  # where a decode step's time goes, dense and with sparse decode attention, 8K
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  for v in ${PROFILE:-dense sparse}; do  # dense, sparse, int4, all (the three FlashLoop updates)
    sda=(); [ "$v" = sparse ] || [ "$v" = all ] && sda=(--sparse-decode-attention '{}')
    [ "$v" = int4 ] || [ "$v" = all ] && sda+=(--kv-residual-quantization '{}')
    [ "$v" = all ] && sda+=(--token-sparse-prefill '{}')
    TAIL=50 step 250 python bench/profile_decode.py --model /tmp/ouro14 --prompt 8192 --batches "${BATCHES:-1,16}" --steps 20 \
      --max-model-len 33024 --top 20 "${sda[@]}" --out "$OUT/profile_decode_${v}_8k_h200.json"
  done
  exit 0
fi
if [ "$PART" = sparse-split ]; then  # sparse decode's graph variants per part: tests with it on, then off / on speed
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1 &
  SPECLOOP_SPARSE_SPLIT_GRAPHS=1 TAIL=8 step 150 python -m pytest -q -rf --tb=line tests/test_sparse_decode_engine.py \
    tests/test_cuda_graphs.py -k "cuda or graph or padding"
  SPECLOOP_SPARSE_SPLIT_GRAPHS=1 TAIL=8 step 150 python -m pytest -q -rf --tb=line tests/test_flashloop_matrix.py \
    -k "graph and decode"
  wait
  for rep in 1 2; do
    for split in 0 1; do
      SPECLOOP_SPARSE_SPLIT_GRAPHS=$split TAIL=6 step 90 python bench/flashloop_speed.py --model /tmp/ouro14 \
        --speculation none --variants dense,sparse-decode-recipe --cases 1x8192 --max-model-len 33024 --decode-tokens 64 \
        --kv-bytes "${KV_BYTES:-53687091200}" --out "$OUT/flashloop_speed_sparse_split${split}_r${rep}.json"
    done
  done
  exit 0
fi
if [ "$PART" = flashloop-speed ]; then  # bench/flashloop_speed.py: SPEC (none,block) and VARIANTS, CASES
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=60 step ${LIMIT:-560} python bench/flashloop_speed.py --model /tmp/ouro14 --speculation "${SPEC:-none}" \
    --variants "${VARIANTS:-dense,prefill,sparse-decode,int4,all}" --cases "${CASES:-1x8192,1x32768,32x8192}" \
    --max-model-len 33024 ${WARMUP:+--warmup-tokens "$WARMUP"} ${DECODE:+--decode-tokens "$DECODE"} \
    ${CUT:+--case-seconds "$CUT"} \
    --out "$OUT/flashloop_speed_$(echo "${SPEC:-none}" | tr , -)${TAG:+_$TAG}_h200.json"
  exit 0
fi
if [ "$PART" = residual-capacity ]; then
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=20 step 500 python bench/kv_residual.py --model /tmp/ouro14 --out "$OUT/kv_residual_capacity_h200.json" \
    --parts memory,capacity --lengths 8192 --decode-tokens 32 --capacity-bytes $((20 << 30)) \
    --capacity-requests 24 --capacity-prompt 8192 --capacity-decode 64 --sparse
  exit 0
fi
if [ "$PART" = quality ]; then
  TAIL=24 step 330 python bench/flashloop_quality.py --streams out/stdlib_tokens.npz --out "$OUT/flashloop_quality_h200.json"
  TAIL=6 step 200 python bench/acceptance.py --device cuda --dtype float32 --prompts 4 --prompt-len 64 --max-tokens 48 \
    --ks 1,2,4,8 --ds 1,2,3 --temperatures 0,0.8 --out "$OUT/acceptance_default_cuda.json" \
    --trace-out "$OUT/acceptance_traces.json"
  exit 0
fi
if [ "$PART" = yardstick ]; then  # issue 39: the engine against the plain compiled path, same call
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  TAIL=30 step 330 python bench/plain_path.py --model /tmp/ouro14 --out "$OUT/plain_path.json"
  TAIL=12 step 200 python bench/baseline.py --model /tmp/ouro14 --out "$OUT/baseline_fast_path.json"
  exit 0
fi
if [ "$PART" = serve-sweep ]; then  # issue 39 item 4: HTTP load at concurrency 16/64/128, dense and block rounds
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  for mode in dense block; do
    extra=""; [ "$mode" = block ] && extra="--speculation block"
    server="python3 -m server --model /tmp/ouro14 --served-model-name ouro-1.4b-random --port 8000 --log-level warning $extra"
    $server & pid=$!
    for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
    for c in ${CONCURRENCY:-16 64 128}; do
      TAIL=4 step 90 python bench/serve.py --base-url http://127.0.0.1:8000 --prompt-len 256 --output-len 64 --seed 0 \
        --num-requests $((c > 32 ? 2 * c : 64)) --concurrency $c --label "${GPU_NAME:-GPU}, random ouro-1.4b (bf16), $mode, concurrency $c" \
        --server-command "$server" --out "$OUT/serve_sweep_${mode}_c$c.json"
    done
    kill -INT $pid; wait $pid
  done
  exit 0
fi
if [ "$PART" = prefix-cache ]; then  # issue 41: tests on the GPU, then the shared-prefix benchmark
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1 &
  TAIL=8 step 100 python -m pytest -q -rf --tb=short tests/test_prefix_caching.py tests/test_prefix_caching_int4.py -k cuda
  wait
  TAIL=8 step 110 python bench/prefix_cache.py --model /tmp/ouro14 --dtype float32 --requests 16 \
    --out "$OUT/prefix_cache_fp32.json"  # outputs must be equal (the run fails otherwise)
  TAIL=8 step 130 python bench/prefix_cache.py --model /tmp/ouro14 --noise-floor 1024 --out "$OUT/prefix_cache_bf16.json"
  TAIL=8 step 200 python bench/prefix_cache.py --model /tmp/ouro14 --requests 32 --kv-residual-quantization '{}' \
    --out "$OUT/prefix_cache_int4.json"
  exit 0
fi
if [ "$PART" = int4-prefill ]; then
  # INT4 prompt chunks: their kernel and engine tests (no -n: one GPU), the no-sync case, then an
  # 8K prompt's first token and kernels, INT4 against dense in one engine process each
  python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1 &
  TAIL=6 step 150 python -m pytest -q -rf --tb=line tests/test_kernels_chunk_attention.py \
    tests/test_kernels_residual_encode.py tests/test_kernels_seals.py tests/test_cuda_no_sync.py
  TAIL=6 step 200 python -m pytest -q -rf --tb=line tests/test_kv_residual_engine.py -k "chunk or cuda or triton"
  # the encoder runs inside decode graphs
  TAIL=6 step 150 python -m pytest -q -rf --tb=line tests/test_cuda_graphs.py -k "int4 or residual"
  wait
  for rows in ${ROWS:-2048 8192}; do  # the engine's default plan, and 8192 rows (4 calls for an 8K prompt)
    TAIL=40 step 150 python bench/profile_prefill.py --model /tmp/ouro14 --prompt 8192 --variants dense,int4 --reps 2 \
      --rows "$rows" --out "$OUT/profile_prefill_8k_rows${rows}_h200.json" --trace "$OUT/trace$rows"
  done
  exit 0
fi
[ "$PART" = preempt ] && python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1 \
  && step 200 python bench/preemption.py --model /tmp/ouro14 --out "$OUT/preemption_h200_exact_lengths.json" \
  && step 200 python bench/preemption.py --model /tmp/ouro14 --stop-every 64 --out "$OUT/preemption_h200_early_stops.json" \
  && exit 0
python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b >/dev/null 2>&1
if [ "$PART" = bench ] || [ "$PART" = all ]; then
step 100 python bench/model_check.py --model /tmp/ouro14 --out "$OUT/model_check_ouro-1.4b.json"
step 150 python bench/baseline.py --model /tmp/ouro14 --out "$OUT/baseline_fast_path_h200.json"
TAIL=24 step 90 python bench/profile_decode.py --model /tmp/ouro14 --out "$OUT/profile_decode_h200.json"
fi
if [ "$PART" = serve ] || [ "$PART" = all ]; then
TAIL=3 step 60 python bench/engine_gpu_check.py --out "$OUT/engine_gpu_check.json"
step 120 python bench/acceptance.py --model /tmp/ouro14 --device cuda --dtype bfloat16 --modes block,pipeline \
  --ks 4 --ds 1 --temperatures 0 --prompts 3 --replay bench/results/acceptance_traces.json \
  --out "$OUT/acceptance_ouro-1.4b_replay.json"
  python3 -m server --model /tmp/ouro14 --served-model-name ouro-1.4b-random --port 8000 --log-level warning &
  for _ in $(seq 90); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  for c in 16 64; do
    step 60 python bench/serve.py --base-url http://127.0.0.1:8000 --prompt-len 256 --output-len 64 --seed 0 \
      --num-requests 64 --concurrency $c --label "H200, random ouro-1.4b (bf16), concurrency $c" \
      --server-command 'python3 -m server --model /tmp/ouro14 --served-model-name ouro-1.4b-random --port 8000 --log-level warning' \
      --out "$OUT/serve_gpu_ouro-1.4b_c$c.json"
  done
  kill %1
fi
