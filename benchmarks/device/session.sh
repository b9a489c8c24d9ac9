#!/usr/bin/env bash
# The device session of issue #33 in two calls of the device tool (each within its 600 s), measured on an H200
# on 2026-11-28 (benchmarks/results/gpu_h200_2026-11-28_calls.txt):
#   check (434 s there, the machine's start not counted):
#     1. tests/gpu (the CUDA store stream and CUDA trials against the CPU's): 39 s;
#     2. benchmarks/gpu_check.py: the offline bundle installed with no index (30 s), the throughput benchmark at
#        224 px (bf16 eager and compiled, batch 32 and 128, store / RAM / recompute epochs, the planner's pick; 230 s),
#        then the default spec through `healsweep run` with 8 trials sharing the GPU, its quoted cells against the
#        CPU run (165 s);
#   bf16 (179 s there, on the still-warm machine: call it at once after `check`):
#     3. the same spec healing in bf16 (`heal.precision: bf16`), 8 trials sharing the GPU; its quoted cells
#        against the CPU's fp32 run (in its gpu_check.json) and against step 2's fp32 run (compare the two
#        sweep_quoted.json files here).
#   stream (one call on a fresh machine, ~8 min with its start; first run 2026-11-28, results/gpu_h200_*stream*):
#     1. tests/gpu; 2. gpu_stream.py (gpu_throughput.py --sections stream on 2026-11-28): the store's stream behind the bf16 DeiT-B (eager and
#        compiled) and ResNet-50 step against the in-RAM epoch, by gather threads 1, 2, 4 (3 interleaved rounds of
#        heals; 5 on 2026-11-28), then epoch by epoch inside one heal (16 store/RAM pairs; added after that run);
#     3. the default sweep in fp32 (install from the bundle, 8 trials sharing the GPU) against the CPU run.
#   graph (one call on a fresh machine; built 2026-11-29 without a GPU, not yet run: estimated 8-9 min):
#     1. tests/gpu (tests/gpu/test_graph_step.py: the captured step against the same step uncaptured);
#     2. gpu_graph.py: DeiT-B/16 and ResNet-50 bf16 at batch 32 and 128, heal.compile off/blocks x heal.graph
#        off/step, and the captured step with the post-step as before 2026-11-29 (restore every tensor, copy every
#        weight), targets on the device (OUT/d/graph.json);
#     3. the default sweep with heal.graph: step (install from the bundle, 8 trials sharing the GPU) against the
#        CPU run.
#   open (one call on a fresh machine; what #33 still has open after the H200 calls of 2026-11-30, est. 5-6 min),
#     each step's results kept when a later one is cut:
#     1. tests/gpu/test_graph_step.py (its fp32 ResNet case with cuDNN's deterministic algorithms, and 4 captured
#        heals in one process leaving no memory behind: both added after that run);
#     2. gpu_stream.py for DeiT-B/16, paired store/RAM (16 pairs), eager and compiled, each with heal.graph off and
#        step (the store/RAM <= 1.05 bar; the captured step through the store; OUT/e/stream.json);
#     3. with the time left, gpu_graph.py for ResNet-50, its targets now on the device (OUT/e/graph_resnet50.json).
#     On 2026-11-30 it ran the graph tests, gpu_graph.py for DeiT-B/16 and the graphsweep sweep (417 s).
#   graphsweep (added 2026-11-29; run inside `open` on 2026-11-30: 534 trials, 0 failed, 125 s, its 154 quoted cells
#     equal to the eager bf16 sweep's bit for bit): the default spec through `healsweep run` in bf16 with heal.graph:
#     step, 8 trials sharing the GPU, against the CPU's fp32 run (OUT/f/gpu_check.json). Carry .bundle.
# SESSION_DEVICE_ARGS (default empty) is passed to gpu_graph.py and gpu_stream.py: "--device cpu --tiny" checks the
# script on a CPU (tests/gpu skip there).
# Usage, from the repository root, the bundle built beforehand on a machine with package access
# (healsweep bundle --python 3.12 --freeze benchmarks/device/cuda-image-freeze.txt --out .bundle; carry .bundle):
#   bash benchmarks/device/session.sh OUT_DIR [check|bf16|stream|graph|open|graphsweep]
# Files written (the device tool returns at most 8): check: OUT/session.txt, OUT/a/{gpu_check.json,throughput.json,
# sweep_quoted.json,logs.tar.gz}; bf16: OUT/session.txt, OUT/b/{gpu_check.json,sweep_quoted.json,logs.tar.gz};
# open: OUT/session.txt, OUT/e/{stream.json,graph_resnet50.json}; graphsweep: OUT/session.txt,
# OUT/f/{gpu_check.json,sweep_quoted.json,logs.tar.gz}.
set -u
OUT=${1:?usage: session.sh OUT_DIR [check|bf16|stream|graph|open|graphsweep]}
PART=${2:-check}
LIMIT=${SESSION_LIMIT_S:-585}  # seconds this call may use in all (the device tool stops a command at 600)
T0=$(date +%s)
mkdir -p "$OUT"
left() { echo $(( LIMIT - ($(date +%s) - T0) - ${1:-0} )); }
read -r -a DEV <<< "${SESSION_DEVICE_ARGS:-}"  # e.g. --device cpu --tiny: the benchmarks on a CPU
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
SITE=/tmp/healsweep-site BUNDLE=.bundle/healsweep-offline.tar.xz
sweep_only() {  # OUT/$1, work dir $2, gpu_check.py's arguments: the default sweep alone (the bundle installed
  # unless the site is there: a machine an earlier part left warm), 45 s kept for packing its logs
  local dir=$1 work=$2 install=()
  shift 2
  mkdir -p "$OUT/$dir"
  [ -d "$SITE" ] || install=(--bundle "$BUNDLE")  # a fresh machine: nothing installed the site yet
  timeout "$(left)" python3 benchmarks/gpu_check.py "${install[@]}" --site "$SITE" --out "$OUT/$dir" --work "$work" \
    --sections sweep "$@" --sweep-timeout "$(left 45)" >> "$OUT/session.txt" 2>&1
}
gpu_tests() {  # all of tests/gpu; the whole output kept in OUT/pytest_gpu.txt, its tail in session.txt
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; uptime; git log -1 --format='%H %s'; } \
  > "$OUT/session.txt" 2>&1 || true
case "$PART" in
  check)
    mkdir -p "$OUT/a"
    { echo "## tests/gpu"; gpu_tests
      echo "## check (install, throughput, fp32 sweep) from $(date -u +%T)"; } >> "$OUT/session.txt"
    timeout "$(left)" python3 benchmarks/gpu_check.py --bundle "$BUNDLE" --site "$SITE" --out "$OUT/a" --work /tmp/gca \
      --sections throughput sweep --throughput-args "--extra-batches 128 --repeats 2 --precisions bf16" \
      --throughput-timeout 280 --sweep-timeout 200 >> "$OUT/session.txt" 2>&1 ;;
  bf16) sweep_only b /tmp/gcb --heal-precision bf16 ;;
  stream)
    mkdir -p "$OUT/c"
    { echo "## tests/gpu"; gpu_tests
      echo "## stream (gpu_stream.py) from $(date -u +%T)"; } >> "$OUT/session.txt"
    timeout "$(left 200)" python3 benchmarks/gpu_stream.py "${DEV[@]}" --models deit_b16 resnet50 \
      --repeats 3 --mode-threads 1 2 4 --pairs 16 --json "$OUT/c/stream.json" >> "$OUT/session.txt" 2>&1
    echo "## fp32 sweep from $(date -u +%T)" >> "$OUT/session.txt"
    sweep_only c /tmp/gcc ;;
  graph)
    mkdir -p "$OUT/d"
    { echo "## tests/gpu"; gpu_tests
      echo "## gpu_graph.py from $(date -u +%T)"; } >> "$OUT/session.txt"
    timeout "$(left 210)" python3 benchmarks/gpu_graph.py "${DEV[@]}" --json "$OUT/d/graph.json" >> "$OUT/session.txt" 2>&1
    echo "## sweep with heal.graph: step from $(date -u +%T)" >> "$OUT/session.txt"
    sweep_only d /tmp/gcd --heal-graph step ;;
  open)
    mkdir -p "$OUT/e"
    { echo "## tests/gpu/test_graph_step.py tests/gpu/test_cuda_streams.py tests/gpu/test_cuda_stream.py"; timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_graph_step.py tests/gpu/test_cuda_streams.py tests/gpu/test_cuda_stream.py -W ignore::UserWarning -s --tb=short -p no:logging 2>&1 | grep -v DEBUG | tee "$OUT/e/pytest.txt" | tail -40
      echo "## gpu_stream.py deit_b16, paired, heal.graph off and step, from $(date -u +%T)"; } >> "$OUT/session.txt"
    timeout "$(left 10)" python3 benchmarks/gpu_stream.py "${DEV[@]}" --models deit_b16 --repeats 0 --pairs 16 \
      --pairs-graph off step --json "$OUT/e/stream.json" >> "$OUT/session.txt" 2>&1
    if [ "$(left)" -gt 150 ]; then
      echo "## gpu_graph.py resnet50 from $(date -u +%T)" >> "$OUT/session.txt"
      timeout "$(left)" python3 benchmarks/gpu_graph.py "${DEV[@]}" --models resnet50 \
        --json "$OUT/e/graph_resnet50.json" >> "$OUT/session.txt" 2>&1
    fi ;;
  graphsweep) sweep_only f /tmp/gcf --heal-precision bf16 --heal-graph step ;;
  *) echo "unknown part $PART: check, bf16, stream, graph, open or graphsweep" >&2; exit 2 ;;
esac
echo "## ended $(date -u +%T) ($(( $(date +%s) - T0 )) s)" >> "$OUT/session.txt"
for d in "$OUT"/*/; do  # the logs of a check cut before it packed them
  if [ -d "$d/logs" ]; then tar czf "$d/logs.tar.gz" -C "$d" logs && rm -rf "$d/logs"; fi
done
cat "$OUT/session.txt"
