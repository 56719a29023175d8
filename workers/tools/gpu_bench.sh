#!/usr/bin/env bash
# Everything the GPU issue measures, in one device call (see docs/perf.md):
#   kernel checks on the GPU, `laneserve bench` (roofline, engine decode, HF generate),
#   and a bursty RAG replay through the full stack with `laneserve loadtest`.
# Usage (repo root, on the GPU machine): OUT=dir bash workers/tools/gpu_bench.sh [bench args...]
# Optional: PERSISTENT=1 (issue 25: persistent decode, fused RoPE + K/V write, small-batch GEMV), GEMV=1 (issue 25:
# the fused GEMV path, kernels to whole steps), DRAFT=1 (issue 22's draft-model step costs), MIXED=1 (steps with a
# prompt chunk, piecewise CUDA graphs against eager), CASCADE=1 (decodes sharing a prefix: --cascade-attention's kernel
# against the partitioned one), BATCH1=1 (issue 25's batch 1: the GEMV sweep, whole steps and the breakdown);
# SKIP_*=1 skip.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/kernel_tests.txt" 2>&1
  tail -5 "$OUT/kernel_tests.txt" | tee "$OUT/kernels.txt"
  # the worker paths on the device (fp32): Triton backend (both decode kernels; the GEMV path), the draft model's
  # graph passes, the runner's (piecewise graphs against eager among them)
  WORKER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py \
    tests/test_draft_model.py tests/test_runner.py tests/test_sampling.py -k "not stack" > "$OUT/worker_tests.txt" 2>&1
  tail -5 "$OUT/worker_tests.txt" | tee -a "$OUT/kernels.txt"
fi
if [ "${PERSISTENT:-0}" = 1 ]; then  # issue 25: persistent against partitioned decode attention
  python3 -m workers.tools.kernel_bench --persistent --rope-kv --gemv --out "$OUT/persistent.json" 2>&1 \
    | tee "$OUT/persistent.txt"
  python3 -m laneserve.cli bench --parts engine --batches 1,32,128 --contexts 1024,4096 \
    --decode-attention partitioned,persistent,auto --out "$OUT/persistent_engine.json" 2>&1 \
    | tee -a "$OUT/persistent.txt"
  for skew in "32000 512 64" "16384 256 8"; do  # skewed batches: one long context among short ones (32k: the limit)
    read -r long short batch <<< "$skew"
    python3 -m laneserve.cli bench --parts engine --batches "$batch" --contexts "$short" --long-context "$long" \
      --decode-attention partitioned,auto 2>&1 | tail -3 | tee -a "$OUT/persistent.txt"
  done
fi
if [ "${GEMV:-0}" = 1 ]; then  # issue 25: the fused GEMV path for steps of <= 8 tokens (--decode-gemv-rows)
  # (the whole log kept: stop 43's call had only the summary line of a failure)
  python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py > "$OUT/fused_tests.txt" 2>&1
  tail -3 "$OUT/fused_tests.txt" | tee "$OUT/gemv.txt"
  python3 -m workers.tools.kernel_bench --gemv --out "$OUT/gemv.json" 2>&1 | grep -v "^    gemv" \
    | tee -a "$OUT/gemv.txt"  # (the sweep's per-config lines dropped)
  # (two runners in one process: stop 42's H100 ran out of memory in the second while the bench kept the first's
  # piecewise graphs, and with them its model, under a local name; fixed in bench.py, which warns if it recurs)
  python3 -m laneserve.cli bench --parts roofline,engine --batches 1,2,4,8,32,128 --contexts 1024 \
    --decode-gemv-rows 0,8 --out "$OUT/gemv_engine.json" 2>&1 | tee -a "$OUT/gemv.txt"
fi
if [ "${BATCH1:-0}" = 1 ]; then  # issue 25's batch 1: the GEMV configs' sweep, then where a step's time goes
  python3 -m workers.tools.kernel_bench --gemv --out "$OUT/batch1_kernels.json" 2>&1 | grep -v "^    gemv" \
    | tee "$OUT/batch1.txt"
  python3 -m laneserve.cli bench --parts roofline,engine,breakdown --batches 1,2,4,8,32 --breakdown-batches 1,8 \
    --contexts 1024 --out "$OUT/batch1_engine.json" 2>&1 | tee -a "$OUT/batch1.txt"
fi
if [ "${CASCADE:-0}" = 1 ]; then  # issue 19's worker lever: decodes sharing a prefix read it once (--cascade-attention)
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k cascade > "$OUT/cascade_tests.txt" 2>&1
  WORKER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py -k cascade \
    >> "$OUT/cascade_tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/cascade_tests.txt" | tee "$OUT/cascade.txt"
  python3 -m workers.tools.kernel_bench --cascade --out "$OUT/cascade.json" 2>&1 | grep -E "cascade|Error" \
    | tee -a "$OUT/cascade.txt"
fi
if [ "${MIXED:-0}" = 1 ]; then  # issue 19's worker lever: the host launch and device time of steps with a prompt chunk
  python3 -m laneserve.cli bench --parts mixed --batches 1,64 --contexts 1024 --chunks 256,1024,1920 --steps 10 \
    --piecewise-graph-tokens 0,2048 --out "$OUT/mixed.json" 2>&1 | tail -16 | tee "$OUT/mixed.txt"
fi
if [ "${DRAFT:-0}" = 1 ]; then  # issue 22: draft-and-verify steps with a ~0.33B draft shape
  python3 -m workers.tools.spec_bench --draft-model dummy --batches 1,8,32 --alpha-batches 0 \
    --json "$OUT/draft.json" 2>&1 | tee "$OUT/draft.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m laneserve.cli bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.txt"
fi
if [ "${SKIP_INT8:-0}" != 1 ]; then  # issue 8: int8 vs bf16 KV, 128 sequences at 2k context, same run
  python3 -m laneserve.cli bench --parts engine --kv-cache-dtype auto,int8 --batches 128 --contexts 2048 \
    --out "$OUT/kv_int8.json" 2>&1 | tee "$OUT/kv_int8.txt"
fi
if [ "${SKIP_REPLAY:-0}" != 1 ]; then
  MODEL=$(python3 -c 'import tempfile; from workers.tools.bench import write_dummy_model_dir as w; print(w(tempfile.mkdtemp()))')
  python3 -m laneserve.cli --log-level WARNING serve --model "$MODEL" --load-format dummy --dtype bfloat16 \
    --port 8011 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 600); do grep -q "laneserve ready" "$OUT/serve.log" && break; kill -0 $SERVE || break; sleep 0.5; done
  grep "laneserve ready\|exited\|Error" "$OUT/serve.log" | head -5
  salt=0
  for rate in ${REPLAY_RATE:-24}; do  # a space-separated list: one replay per rate, same server (each its own fresh
    salt=$((salt + 1))  # documents and question tails: a later rate would find an earlier one's in the prefix cache)
    python3 -m laneserve.cli loadtest --url http://127.0.0.1:8011 --trace rag --num-requests ${REPLAY_N:-600} \
      --salt $salt --rate $rate --burstiness 0.5 --num-docs 16 --doc-tokens 1536 --question-tokens 256:512 \
      --output-tokens 128:256 --hit-rate 0.8 --slo ttft=120ms,tpot=30ms --no-progress --no-plots \
      --out "$OUT/replay_$rate" 2>&1 | tail -40
  done
  kill -INT $SERVE; wait $SERVE
  tail -3 "$OUT/serve.log"
fi
