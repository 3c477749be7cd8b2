#!/usr/bin/env bash
# The GPU run (issue 6), as one prepared script: a Llama-3.1-8B-shaped model with random bf16
# weights, then on it
#   1. the CUDA stage tests (tests/stages/test_cuda.py: ppring's logits on the GPU against
#      transformers on the CPU),
#   2. `ppring bench step`: the decode step time at batch 1, 16 and 64 against the HBM bound
#      (weights read / measured copy bandwidth),
#   3. `ppring bench serve`: PP=1 and PP=2 (two stage processes sharing the one GPU) and HF
#      generate, closed loops at 1, 16 and 64 requests in flight.
# Run it from the repository root on a machine with one CUDA GPU:
#     bash bench/gpu_run.sh [OUT_DIR]
# Wheels in .whl/ (pyzmq, where the machine lacks it) are installed into /tmp/site first.
set -uo pipefail

OUT_DIR=${1:-${OUT:-bench/results/gpu}}
# 16 GB of weights: in shared memory where it has room (no disk write, page-cache-fast loads).
SHM_FREE_GB=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -n 1 | tr -dc 0-9)
if [ "${SHM_FREE_GB:-0}" -ge 40 ]; then SCRATCH=/dev/shm; else SCRATCH=/tmp; fi
MODEL_DIR=${MODEL_DIR:-$SCRATCH/llama-3.1-8b-random}
# For a dry run on a CPU: PRESET=tiny DEVICE=cpu bash bench/gpu_run.sh /tmp/out
# SERVE_ARGS: more flags for `bench serve`, e.g. SERVE_ARGS=--no-baseline
PRESET=${PRESET:-llama-3-8b}
DEVICE=${DEVICE:-cuda}
LOG_DIR=/tmp/ppring-gpu-logs
mkdir -p "$OUT_DIR" "$LOG_DIR"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Whatever fails below, the logs travel back with the results.
trap 'tar czf "$OUT_DIR/logs.tgz" -C "$LOG_DIR" . 2>/dev/null' EXIT

stamp() { echo "== $(date +%T) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    | tee "$OUT_DIR/machine.txt"
python3 -c 'import sys, torch, transformers, zmq; print(sys.version.split()[0], "torch",
    torch.__version__, "transformers", transformers.__version__, "pyzmq", zmq.__version__)' \
    | tee -a "$OUT_DIR/machine.txt" || exit 1

stamp "CUDA stage tests"
python3 -m pytest -q -p no:cacheprovider tests/stages/test_cuda.py >"$OUT_DIR/test_cuda.txt" 2>&1
tests_rc=$?
tail -n 15 "$OUT_DIR/test_cuda.txt"
[ "$tests_rc" -eq 0 ] || exit 1  # timings of a wrong forward are worth nothing

stamp "random $PRESET (bf16) into $MODEL_DIR"
python3 -m bench.random_model --preset "$PRESET" --dtype bfloat16 --device "$DEVICE" \
    --out "$MODEL_DIR" 2>&1 | grep -v "Writing model shards" || exit 1

stamp "bench step"
python3 -m launch bench step --model "$MODEL_DIR" --dtype bfloat16 --device "$DEVICE" \
    --batch-sizes 1,16,64 --context 512 --steps 20 --out "$OUT_DIR" 2>&1 \
    | tee "$LOG_DIR/bench_step.log"

stamp "bench serve"
python3 -m launch bench serve --model "$MODEL_DIR" --dtype bfloat16 --device "$DEVICE" \
    --pp-sizes 1,2 --concurrency 1,16,64 --no-sweep --num-requests 128 \
    --kv-memory-gib 8 --log-dir "$LOG_DIR" --out "$OUT_DIR" ${SERVE_ARGS:-} 2>&1 \
    | tee "$LOG_DIR/bench_serve.log"
stamp "done"
