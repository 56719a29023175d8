#!/usr/bin/env bash
# Mixed against streams lanes (issue 21, docs/lanes.md) in one device call: for each mode, one server
# (7B shape, dummy bf16 weights) and, against it: offline throughput (1,000 prompts of 512-1,024
# tokens, 128-256 outputs, all at once; RUNS times), batch-1 decode (3 requests of 512 + 512 tokens,
# 6 s apart), and a `laneserve loadtest sweep` of the bursty RAG replay (RATES, SEEDS).
# Usage (repo root, on the GPU machine):
#   OUT=dir RUNS=2 RATES=16,24 SEEDS=3 bash workers/tools/lanes_bench.sh "mixed:" "streams:--lanes streams"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
LOAD_ARGS=${LOAD_ARGS:-$RAG_LOAD_ARGS --num-requests 300}
MODEL=$(dummy_7b_dir)
URL=http://127.0.0.1:8011
summary() {  # one line from a loadtest report
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]+'/report.json'))['summary']; print(sys.argv[2], \
'output tok/s %.0f, TTFT p50 %.1f p95 %.1f ms, TPOT p50 %.2f p95 %.2f ms, ITL p95 %.1f ms, finished %d/%d' % ( \
s['output_tok_s'], s['ttft_ms']['p50'], s['ttft_ms']['p95'], s['tpot_ms']['p50'], s['tpot_ms']['p95'], \
s['itl_ms']['p95'], s['finished'], s['sent']))" "$1" "$2"
}
for spec in "$@"; do
  name=${spec%%:*}; args=${spec#*:}
  python3 -m laneserve.cli --log-level WARNING serve --model "$MODEL" --load-format dummy --dtype bfloat16 \
    --port 8011 $args > "$OUT/serve_$name.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 600); do grep -q "laneserve ready" "$OUT/serve_$name.log" && break; kill -0 $SERVE || break; sleep 0.5; done
  for i in $(seq ${RUNS:-2}); do
    python3 -m laneserve.cli loadtest --url $URL --trace synthetic --rate 100000 --num-requests 1000 \
      --input-tokens 512:1024 --output-tokens 128:256 --seed $i --no-progress --out /tmp/lb_$name/offline$i > /dev/null 2>&1
    summary /tmp/lb_$name/offline$i "$name offline run $i:"
  done
  python3 -m laneserve.cli loadtest --url $URL --trace synthetic --rate 0.16 --burstiness 100 --num-requests 3 \
    --input-tokens 512 --output-tokens 512 --no-progress --out /tmp/lb_$name/batch1 > /dev/null 2>&1
  summary /tmp/lb_$name/batch1 "$name batch 1:"
  if [ -n "${RATES:-}" ]; then
    python3 -m laneserve.cli loadtest sweep --url $URL $LOAD_ARGS --rates $RATES --seeds ${SEEDS:-3} \
      --slo ttft=120ms,tpot=30ms --no-progress --no-plots --out "/tmp/lb_$name/sweep" > /dev/null 2>&1
    cp "/tmp/lb_$name/sweep/sweep.json" "$OUT/sweep_$name.json" && grep '^| [0-9]' "/tmp/lb_$name/sweep/sweep.md" | head -20
  fi
  kill -INT $SERVE; wait $SERVE
  grep -i "error\|traceback" "$OUT/serve_$name.log" | head -5
done
