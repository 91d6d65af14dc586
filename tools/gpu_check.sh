#!/bin/bash
# One call's worth of GPU checks on a lent GPU machine (see /work/.library/device): the GPU tests, then the
# benchmarks of issue 4 with CUDA graphs for mixed steps on and off, every log and JSON under $OUT (8 files).
#
# Preconditions on that machine (its image lacks some packages and the 98 MB default GGUF exceeds one transfer):
#   here:  ../shared/tools/gpu-wheels quart hypercorn orjson gguf pydantic          (-> .whl/), plus
#          pytest-asyncio and pytest-timeout (tests/e2e/test_process_engine.py imports pytest_asyncio; the image
#          lacks both): python3 -m pip download --no-deps -d .whl pytest-asyncio==1.5.0 pytest-timeout==2.4.0
#          split -n 2 -d ~/.cache/voltserve/SmolLM2-135M-Instruct.Q4_1.gguf .gguf-parts/part.
#          sha256sum ~/.cache/voltserve/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1 > .gguf-parts/sha256
#   call 1 (carry .whl, .gguf-parts/part.00): mkdir -p /root/stage && cp .gguf-parts/part.00 /root/stage/ &&
#          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#          (and anything else that needs no GGUF, e.g. python3 -m pytest tests/kernels)
#   call 2, at once (carry .gguf-parts/part.01, .gguf-parts/sha256): cp .gguf-parts/part.01 /root/stage/ &&
#          mkdir -p ~/.cache/voltserve && cat /root/stage/part.0? > ~/.cache/voltserve/SmolLM2-135M-Instruct.Q4_1.gguf
#          && echo "$(cat .gguf-parts/sha256)  $HOME/.cache/voltserve/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
#          && bash tools/gpu_check.sh
# The machine goes cold ~30 s after a call: make call 2 right after call 1. About 8 minutes in all.
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
test -d /tmp/site/quart || { echo "no wheels under /tmp/site: run call 1 first (the machine went cold?)"; exit 3; }
L=$OUT/checks.log B=$OUT/bench.jsonl S=$OUT/server.log
one_line() {  # a JSON report file as one line ("null" when the run wrote none)
  python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$1" 2>/dev/null || echo null
}
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$L" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_graph_capture.py >> "$L" 2>&1
echo "kernel tests rc=$?" >> "$L"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/e2e >> "$L" 2>&1
echo "e2e tests rc=$?" >> "$L"

http() {  # $1 = VOLTSERVE_MIXED_GRAPHS (1/0): 2 HTTP runs of 64 streams, then the same load offline
  VOLTSERVE_MIXED_GRAPHS=$1 VOLTSERVE_DEVICE=cuda VOLTSERVE_GPU_BUSY_LOG_INTERVAL=2 \
    python3 -m hypercorn -k uvloop api:app --bind 127.0.0.1:8011 >> "$S" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
  for r in 1 2; do
    rm -f /tmp/h.json
    timeout 60 python3 tools/bench_serving.py --base-url http://127.0.0.1:8011 --processes 4 --concurrency 64 \
      --num-requests 640 --max-tokens 256 --out /tmp/h.json >> "$L" 2>&1
    echo "{\"http_mixed_graphs\": $1, \"run\": $r, \"report\": $(one_line /tmp/h.json)}" >> "$B"
  done
  kill $pid; wait $pid
  rm -f /tmp/o.json
  VOLTSERVE_MIXED_GRAPHS=$1 VOLTSERVE_DEVICE=cuda timeout 90 python3 tools/bench_serving.py \
    --offline smollm2-135m-instruct --concurrency 64 --num-requests 640 --max-tokens 256 --out /tmp/o.json >> "$L" 2>&1
  echo "{\"offline_mixed_graphs\": $1, \"report\": $(one_line /tmp/o.json)}" >> "$B"
}

bench() {  # $1 = name, rest = bench_decode.py arguments
  local name=$1; shift
  rm -f /tmp/d.json
  timeout 120 python3 tools/bench_decode.py --device cuda --graphs on --mixed-graphs on,off "$@" --out /tmp/d.json >> "$L" 2>&1
  echo "{\"$name\": $(one_line /tmp/d.json)}" >> "$B"
}

http 1
bench churn --batch 64 --churn 256 --prompt-len 40 --steps 256 --repeats 3
bench decode --batch 1,8,64 --steps 64 --repeats 5 --prefill 512
http 0
grep -E "passed|failed|rc=" "$L"
python3 - "$B" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        print(json.dumps(json.loads(line))[:700])
    except ValueError:
        print("unreadable:", line[:200])
PY
