#!/usr/bin/env bash
# The GPU run (issue 13, item 5), as one prepared script: a Llama-3.1-8B-shaped model with
# random bf16 weights, then on it
#   1. the CUDA stage tests (tests/stages/test_cuda.py: ppring's logits on the GPU against
#      transformers on the CPU, graph steps against eager steps; the graph bookkeeping and the
#      Triton paged decode kernel against plain torch),
#   2. `ppring bench step`: the decode step time at batch 1, 16, 64 and 128 against the HBM
#      bound, with CUDA graphs (the default) and without (--disable-cuda-graph, into no_graph/),
#   3. `ppring bench serve`: PP=1 and PP=2 (two stage processes sharing the one GPU) and HF
#      generate in bf16, eager and compiled (a static KV cache and torch.compile, warmed up
#      untimed first), closed loops at 1, 16, 64 and 128 requests in flight.
# Run it from the repository root on a machine with one CUDA GPU:
#     bash bench/gpu_run.sh [OUT_DIR]     # default docs/perf/gpu (or $OUT where set)
# Budget: 8 minutes on one H200, model creation included (BUDGET_S=480), so that a session's
# 15 device minutes hold a machine start and a second, shorter try. Estimated from runs 1 and 2
# (docs/perf/gpu): 2 min for the tests, the model and both step benches, 2-3 for the rings,
# under 1 for HF eager, 2-3 for HF compiled (most of it compiling: not yet measured). Each
# phase has its own timeout; a failed test turns off what it tested (Triton attention, graphs)
# and the benches go on, so one failure still brings figures back. Device call: carry .whl,
# timeout_s about 540.
# To fit, the serve workload is 128 requests (the fewest that fill 128 in flight) of 16-64 new
# tokens (the mixed workload's prompts, its outputs halved), and `bench serve` runs under a
# timeout of what is left: it writes its JSON after every layout and baseline, and HF compiled
# runs last, so a cut loses only what was still running.
# PHASES: the parts to run, by default all of "tests step serve hfcompile"; a second try within
# the same session can leave out what the first brought back, e.g. PHASES="serve".
# Wheels in .whl/ (pyzmq, where the machine lacks it) are installed into /tmp/site first.
set -uo pipefail

OUT_DIR=${1:-${OUT:-docs/perf/gpu}}
# The device tool allows 600 s a command and 15 minutes of device time a session, machine start
# included: 480 s leaves room for a second, shorter try.
BUDGET_S=${BUDGET_S:-480}
# 16 GB of weights: in shared memory where it has room (no disk write, page-cache-fast loads).
SHM_FREE_GB=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -n 1 | tr -dc 0-9)
if [ "${SHM_FREE_GB:-0}" -ge 40 ]; then SCRATCH=/dev/shm; else SCRATCH=/tmp; fi
MODEL_DIR=${MODEL_DIR:-$SCRATCH/llama-3.1-8b-random}
# For a dry run on a CPU: PRESET=tiny DEVICE=cpu bash bench/gpu_run.sh /tmp/out
# SERVE_ARGS: more flags for `bench serve`, later ones winning, e.g. SERVE_ARGS=--no-baseline
# or SERVE_ARGS="--output-tokens 16,128" (the full mixed workload, if the budget allows)
PRESET=${PRESET:-llama-3-8b}
PHASES=${PHASES:-tests step serve hfcompile}
phase() { [[ " $PHASES " == *" $1 "* ]]; }
DEVICE=${DEVICE:-cuda}
# Under OUT_DIR, so the logs come back even if the run is killed before its exit trap.
LOG_DIR=$OUT_DIR/logs
mkdir -p "$OUT_DIR" "$LOG_DIR"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stamp() { echo "== $(date +%T) ${SECONDS}s $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    | tee "$OUT_DIR/machine.txt"
python3 -c 'import sys, torch, transformers, zmq; print(sys.version.split()[0], "torch",
    torch.__version__, "transformers", transformers.__version__, "pyzmq", zmq.__version__)' \
    | tee -a "$OUT_DIR/machine.txt" || exit 1
# torch.compile's GPU kernels (Triton) build a host stub with a C compiler and Python's headers
# at first use; a machine without them would fail HF compiled at the very end, so try now.
HF_COMPILE=--hf-compile
if ! phase hfcompile; then
    HF_COMPILE=""
elif python3 -c "import torch; f = torch.compile(lambda x: x.sin() + 1)
f(torch.ones(8, device='$DEVICE'))" >"$LOG_DIR/compile_check.log" 2>&1; then
    echo "torch.compile: works" | tee -a "$OUT_DIR/machine.txt"
else
    HF_COMPILE=""
    echo "torch.compile: fails ($(tail -n 1 "$LOG_DIR/compile_check.log")); HF compiled skipped" \
        | tee -a "$OUT_DIR/machine.txt"
fi

GRAPH_FLAG=()
if phase tests; then
    stamp "CUDA stage tests"
    # The kernel first, then the graphs, then the stage: a failure does not stop the benches
    # (their figures are the point of the run); it turns off what failed, and the test output
    # says why.
    timeout -k 10 90 python3 -m pytest -q -x -p no:cacheprovider \
        tests/stages/test_triton_attention.py >"$OUT_DIR/test_triton.txt" 2>&1
    triton_rc=$?
    tail -n 5 "$OUT_DIR/test_triton.txt"
    if [ "$triton_rc" -ne 0 ]; then
        echo "Triton kernel tests failed (rc $triton_rc): benches use torch's attention, no graphs"
        export PPRING_TRITON_ATTENTION=0
        GRAPH_FLAG=(--disable-cuda-graph)
    fi
    timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/stages/test_cuda.py \
        tests/stages/test_cuda_graphs.py >"$OUT_DIR/test_cuda.txt" 2>&1
    tests_rc=$?
    tail -n 15 "$OUT_DIR/test_cuda.txt"
    failed_tests=$(grep -E "^(FAILED|ERROR)" "$OUT_DIR/test_cuda.txt")
    if [ "$tests_rc" -ne 0 ] && grep -q "graph" <<<"$failed_tests"; then
        echo "CUDA graph tests failed: benches run without graphs"
        GRAPH_FLAG=(--disable-cuda-graph)
    elif [ "$tests_rc" -ne 0 ]; then
        echo "CUDA stage tests failed (rc $tests_rc):" \
            "the figures below are of a stage that is wrong"
    fi
fi

stamp "random $PRESET (bf16) into $MODEL_DIR"
python3 -m bench.random_model --preset "$PRESET" --dtype bfloat16 --device "$DEVICE" \
    --out "$MODEL_DIR" 2>&1 | grep -v "Writing model shards" || exit 1

STEP_ARGS=(--model "$MODEL_DIR" --dtype bfloat16 --device "$DEVICE" --batch-sizes 1,16,64,128
    --context 512 --steps 20)
if phase step; then
    if [ ${#GRAPH_FLAG[@]} -eq 0 ]; then
        stamp "bench step (CUDA graphs)"
        timeout -k 10 120 python3 -m launch bench step "${STEP_ARGS[@]}" --out "$OUT_DIR" 2>&1 \
            | tee "$LOG_DIR/bench_step.log"
    fi
    stamp "bench step --disable-cuda-graph"
    timeout -k 10 120 python3 -m launch bench step "${STEP_ARGS[@]}" --disable-cuda-graph \
        --out "$OUT_DIR/no_graph" 2>&1 | tee "$LOG_DIR/bench_step_no_graph.log"
fi

# 16 GiB of KV a stage: 128 requests of the longest (512 + 64 tokens) at once fit at PP=1.
# On a CPU (the dry run) a stage's KV is host memory, allocated whole: a tiny model needs little.
if [ "$DEVICE" = cpu ]; then kv_gib=0.25; else kv_gib=16; fi
phase serve || { stamp "done"; exit 0; }
left_s=$((BUDGET_S - SECONDS))
[ "$left_s" -ge 60 ] || left_s=60
stamp "bench serve (${left_s}s left)"
# SIGINT: Python unwinds, so the rings are stopped and the JSON so far stays written.
timeout -s INT -k 30 "$left_s" \
    python3 -m launch bench serve --model "$MODEL_DIR" --dtype bfloat16 --device "$DEVICE" \
    --pp-sizes 1,2 --concurrency 1,16,64,128 --no-sweep --num-requests 128 \
    --output-tokens 16,64 --hf-dtypes bfloat16 $HF_COMPILE "${GRAPH_FLAG[@]}" \
    --kv-memory-gib "$kv_gib" --log-dir "$LOG_DIR" --out "$OUT_DIR" ${SERVE_ARGS:-} 2>&1 \
    | tee "$LOG_DIR/bench_serve.log"
[ "${PIPESTATUS[0]}" -eq 124 ] && echo "bench serve: cut at the ${BUDGET_S}s budget"
stamp "done"
