#!/usr/bin/env bash
# Capacity under the SLO, policy against policy, in one device call (docs/perf.md, issue 19):
# for each policy, one server (7B shape, dummy weights) and one `laneserve loadtest sweep` of the
# bursty RAG replay (a warm-up, then each rate and seed); prints each sweep's table, keeps
# sweep_NAME.json (and its log, a line per run, sweep_NAME.txt), the fitted step-cost model cost_NAME.json (with
# its samples; cost_full_NAME.json: fitted over every step of the trace, what `laneserve simulate` should take), the
# batcher's --step-trace trace_NAME.jsonl, the load tester's records runs_NAME/*/records.jsonl (the trace's TTFT
# report printed: the whole sweep, then each run's TTFT at the client and at the batcher) and the server log.
# A device call has 600 s: a replay of N requests at R req/s takes ~N/R s plus its drain, and each
# server ~1-2 min to start, so keep policies x rates x seeds x N/R well under that.
# Usage (repo root, on the GPU machine):
#   OUT=dir RATES=8,12,16,20,24 SEEDS=3 bash workers/tools/slo_bench.sh "default:" \
#     "slo:--slo-ttft-ms 120 --slo-tpot-ms 30 --max-num-batched-tokens 8192" \
#     "lead:--slo-ttft-ms 120 --slo-tpot-ms 30 --max-num-batched-tokens 8192 --schedule-lead-ms 3"
# Each argument is NAME:SERVE_ARGS, or NAME@DIR:SERVE_ARGS for a server run from DIR's code (another commit's
# files, e.g. `git archive COMMIT | tar -x -C DIR`, carried beside the tree; the load tester stays this tree's).
# RATES defaults to 8,12,16,20,24 and SEEDS to 2 (the headline capacities in README.md and docs/perf.md: SEEDS=3).
# LOAD_ARGS overrides the replay's shape; PROMPT_MODE is ids or text; MODEL_ARGS the model (a dry run on a CPU:
# MODEL_ARGS="--model tiny"); CLIENT_PROCS the load tester's processes (4; before 2026-12-05's last commits the
# sweeps here ran one); OFFLINE_RUNS adds issue 19's offline throughput runs (1,000
# prompts at once) on each server after its sweep; RATES=none skips the sweep. At the end every file is packed into
# OUT/slo_bench.tgz
# (a device call returns a few files only: two servers' five files each were too many, and the traces were lost).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/device_env.sh"
LOAD_ARGS=${LOAD_ARGS:-$RAG_LOAD_ARGS --num-requests 600}
MODEL_ARGS=${MODEL_ARGS:---model $(dummy_7b_dir) --load-format dummy --dtype bfloat16}  # (a CPU dry run: --model tiny)
mkdir -p /tmp/slo_bench
for spec in "$@"; do
  name=${spec%%:*}; args=${spec#*:}; code=$PWD
  if [[ $name == *@* ]]; then code=$(cd "${name#*@}" && pwd); name=${name%%@*}; fi  # NAME@DIR: DIR's code serves
  rm -rf "/tmp/slo_bench/$name"  # (runs of an earlier call on this machine would be read as this one's)
  (cd "$code" && PYTHONPATH=/tmp/site:$code exec python3 -m laneserve.cli --log-level WARNING serve $MODEL_ARGS \
    --port 8011 --cost-model-out "$OUT/cost_$name.json" --step-trace "$OUT/trace_$name.jsonl" $args \
    > "$OUT/serve_$name.log" 2>&1) &
  SERVE=$!
  for _ in $(seq 600); do grep -q "laneserve ready" "$OUT/serve_$name.log" && break; kill -0 $SERVE || break; sleep 0.5; done
  if [ "${RATES:-}" != none ]; then
    COLUMNS=200 python3 -m laneserve.cli loadtest sweep --url http://127.0.0.1:8011 $LOAD_ARGS \
      --rates ${RATES:-8,12,16,20,24} --seeds ${SEEDS:-2} --prompt-mode ${PROMPT_MODE:-ids} --slo ttft=120ms,tpot=30ms \
      --no-progress --no-plots --client-procs ${CLIENT_PROCS:-4} --out "/tmp/slo_bench/$name" 2>&1 \
      | tee "$OUT/sweep_$name.txt" | grep -E "^(rate |warm-up|laneserve|sweep:)"
    # (each run's line printed as it ends: a call cut by its time limit keeps them)
    cp "/tmp/slo_bench/$name/sweep.json" "$OUT/sweep_$name.json" && cat "/tmp/slo_bench/$name/sweep.md"
  fi
  # issue 19's offline throughput: 1,000 prompts sent at once, OFFLINE_RUNS times (seeds 0, 1, ...), on this server
  for seed in $(seq 0 $(( ${OFFLINE_RUNS:-0} - 1 ))); do
    python3 -m laneserve.cli loadtest --url http://127.0.0.1:8011 --trace synthetic --rate 100000 --num-requests 1000 \
      --input-tokens 512:1024 --output-tokens 128:256 --seed $seed --prompt-mode ${PROMPT_MODE:-ids} --no-progress \
      --no-plots --client-procs ${CLIENT_PROCS:-4} --out "/tmp/slo_bench/$name/offline$seed" 2>&1 \
      | grep -E "duration s|output tok/s" | tr -s ' ' | tr '\n' ' ' | sed "s/^/offline $name seed $seed: /"; echo
  done
  curl -s http://127.0.0.1:8011/metrics | grep -E "^laneserve:(step_time|eager_step|prefix_cache_hit_rate|num_slo|num_preempt|num_gated|pipeline_bubble|spec_decode|engine_steps|gateway_event_loop_lag|time_to_first_token_seconds)"
  kill -INT $SERVE; wait $SERVE
  grep -i "error\|traceback" "$OUT/serve_$name.log" | head -5
  if [ -d "/tmp/slo_bench/$name/runs" ]; then
    cp -r "/tmp/slo_bench/$name/runs" "$OUT/runs_$name"
    # where the batcher's time to first token went, each run's TTFT outside the batcher, and the step-cost model
    # fitted over every step (the simulator's input: cost_NAME.json is the server's last 512 steps, a drain's)
    python3 -m batcher.trace "$OUT/trace_$name.jsonl" --client "$OUT"/runs_"$name"/*/records.jsonl \
      --fit-cost-model "$OUT/cost_full_$name.json"
  fi
  [ -f "$OUT/cost_$name.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(sys.argv[2], 'fitted', {k: d.get(k) for k in 'abcdeghm'})" "$OUT/cost_$name.json" "$name"
done
(cd "$OUT" && files=$(ls | grep -v '^slo_bench.tgz$') && tar czf slo_bench.tgz $files && rm -rf $files)
