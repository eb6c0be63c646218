#!/usr/bin/env bash
# The device run: on the GPU machine, from the project root, with .device/ carried (prepare.sh).
#   bash bench/device/run.sh [SECTION ...]     # default: every section, in this order
# Sections: ceilings gpu-tests greedy engine kernels hf engine-eager serve greedy-eager. Each has its own time limit and
# appends JSON lines to $OUT/results.jsonl, so a run that is cut short still reports what it
# finished; report.py prints the table at the end. It also runs on a machine without a GPU
# (a dry run): each GPU section then records "no device".
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/llmserve-device}; mkdir -p "$OUT"
J=$OUT/results.jsonl
D=$(pwd)/.device
M=${MODELS:-/tmp/llmserve-models}
SECTIONS=${*:-ceilings gpu-tests greedy engine kernels hf engine-eager serve greedy-eager}
# One budget for the whole run (the device tool allows 10 minutes a command): a section gets its
# own limit or what is left, whichever is less, and is skipped with under 20 s left.
BUDGET=${BUDGET:-540}
START=$(date +%s)
limit() { local left=$((BUDGET - ($(date +%s) - START))); echo $(( left < $1 ? left : $1 )); }
PY=${PYTHON:-python3}
note() { echo "{\"section\": \"$1\", \"status\": \"$2\"}" >> "$J"; echo "== $1: $2"; }

if ! $PY -c "import fastapi, uvicorn, pydantic, lmformatenforcer, gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$D"/whl/*.whl \
    || { note setup "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# llmserve itself, editable (its entry points register the built-in plugins); no index, no build env.
$PY -c "import llmserve" 2>/dev/null \
  || $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || { note setup "install failed"; exit 1; }
$PY - <<'PY' || { note setup "imports failed"; exit 1; }
import importlib, llmserve.cli, fastapi, uvicorn, pydantic, lmformatenforcer, gguf, triton  # noqa
print("imports ok: torch", __import__("torch").__version__, "triton", triton.__version__)
PY
GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
[ "$GPU" = 1 ] && nvidia-smi -L && $PY bench/device/models.py "$D/tok" "$M"

for s in $SECTIONS; do
  if [ "$GPU" != 1 ]; then note "$s" "no device"; continue; fi
  if [ "$(limit 20)" -lt 20 ]; then note "$s" "skipped: the run's budget is spent"; continue; fi
  case $s in
    ceilings) timeout "$(limit 60)" $PY -c "
import json, sys; sys.path.insert(0, 'bench')
from engine_bench import ceilings
bw, tf = ceilings('cuda'); print(f'copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s')
open('$J', 'a').write(json.dumps({'section': 'ceilings', 'bandwidth_gbs': bw, 'tflops': tf}) + '\n')" ;;
    gpu-tests) timeout "$(limit 150)" $PY -m pytest -q -p no:cacheprovider -x tests/backends/test_triton_attention.py \
                 tests/backends/test_decode_graphs.py $(grep -rl "mark.gpu" tests) -k "gpu or cuda or triton or graph" 2>&1 | tail -15 ;;
    kernels) timeout "$(limit 60)" $PY bench/device/kernels.py --json "$J" ;;
    greedy) timeout "$(limit 120)" $PY bench/device/greedy.py "$M/m-small" --json "$J" ;;
    greedy-eager) timeout "$(limit 90)" $PY bench/device/greedy.py "$M/m-small" --json "$J" -- --enforce-eager ;;
    engine) timeout "$(limit 120)" $PY bench/engine_bench.py --model "$M/m-1b" --dtype bfloat16 --device cuda \
              --concurrency 1 32 128 --json "$J" --label graphs ;;
    engine-eager) timeout "$(limit 90)" $PY bench/engine_bench.py --model "$M/m-1b" --dtype bfloat16 --device cuda \
              --concurrency 1 32 128 --json "$J" --label eager --enforce-eager ;;
    hf) timeout "$(limit 180)" $PY bench/device/hf_compiled.py "$M/m-1b" --batch 1 32 128 --json "$J" 2>&1 | grep -v "it/s" ;;
    serve) timeout "$(limit 120)" $PY bench/serve_bench.py --model "$M/m-1b" --dtype bfloat16 --device cuda \
             --concurrency 1 32 128 --max-tokens 128 --rounds 1 --skip-peer --skip-plain-generate --log-dir "$OUT" \
             --llmserve-args "--max-num-seqs 128" \
             --json "$OUT/serve.json" 2>&1 | tail -12 ;;
    *) echo "unknown section $s" ;;
  esac
  [ $? -eq 124 ] && note "$s" "timed out"
done
$PY bench/device/report.py "$J" "$OUT/serve.json"
