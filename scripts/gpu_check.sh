#!/usr/bin/env bash
# One prepared command for a GPU machine: every CUDA path of the package measured in at most
# 8 minutes, its results written as files under $OUT (at most 8).
#
#   bash scripts/gpu_wheels.sh          # here, beforehand: the wheels the device lacks, into .whl/
#   OUT=/some/folder bash scripts/gpu_check.sh
#
# Phases, each under its own time budget (a phase that fails or runs out of time does not stop
# the next; the whole stops before GPU_CHECK_LIMIT_S, default 470 s):
#   machine    nvidia-smi and the versions                     -> nvidia-smi.txt, summary.txt
#   install    .whl/*.whl into .whl/site (no index, no deps)   -> install.log
#   tests      python -m pytest -m gpu                         -> pytest-gpu.log
#   train      nemo-replay train on CUDA, fsdp then megatron   -> train.log, train-metrics.jsonl
#   bench      python -m benchmarks.run --device cuda --quick  -> benchmarks-gpu.md, benchmarks.log
# Without CUDA the same phases run in a dry mode on the CPU (the gpu-marked files only, a short
# fsdp run, the GPU tables' code on the CPU, tiny sizes) so that the command cannot rot; a test
# runs it (tests/test_gpu_check.py). With OUT unset it writes to a new temporary folder and says
# where. WHEELS names the wheel folder (default .whl), SITE where they install (default .whl/site),
# PYTHON the interpreter (default python).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
start=$(date +%s)
limit=${GPU_CHECK_LIMIT_S:-470}
py=${PYTHON:-python}
wheels=${WHEELS:-.whl}
site=${SITE:-$root/.whl/site}
if [ -z "${OUT:-}" ]; then
    OUT=$(mktemp -d)
    echo "gpu_check: OUT is unset; writing the results to $OUT"
fi
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
summary="$OUT/summary.txt"
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    mode=cuda
else
    mode=dry
fi
echo "mode: $mode (dry: no CUDA device; every phase runs on the CPU at tiny sizes)" > "$summary"

# phase NAME BUDGET_S COMMAND...: run COMMAND under the budget left; one summary line.
phase() {
    local name=$1 budget=$2
    shift 2
    local left=$((limit - ($(date +%s) - start)))
    if [ "$left" -lt 15 ]; then
        echo "$name: skipped, $left s left of $limit" >> "$summary"
        return
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    local t0=$(date +%s)
    timeout -k 5 "$budget" "$@"
    local rc=$?
    local took=$(($(date +%s) - t0))
    local what="rc $rc"
    [ "$rc" -eq 124 ] && what="stopped at its budget"
    echo "$name: $what, $took s of $budget s" >> "$summary"
}

machine() {
    { nvidia-smi || echo "nvidia-smi: not found (dry mode: no GPU)"; } > "$OUT/nvidia-smi.txt" 2>&1
    "$py" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| devices', torch.cuda.device_count())" >> "$summary" 2>&1
}

install() {
    shopt -s nullglob
    local found=("$wheels"/*.whl)
    if [ "${#found[@]}" -eq 0 ]; then
        echo "no wheels in $wheels (run bash scripts/gpu_wheels.sh where pip can download)"
        return 1
    fi
    "$py" -m pip install --quiet --no-index --no-deps --target "$site" "${found[@]}" && \
        echo "installed into $site: ${found[*]}"
}

tests() {
    if [ "$mode" = cuda ]; then
        "$py" -m pytest -m gpu -q -p no:cacheprovider -o addopts=""
        # The fused decode's kernels compiled and run on the device against the reference decode.
        NEMO_REPLAY_REQUIRE_TRITON=1 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/support/test_fused_decode.py
    else  # the files that hold gpu-marked checks: they are collected and skipped
        "$py" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" tests/gpu tests/scoring/test_scorer_devices.py
    fi
}

train() {
    local accel=gpu steps=5 strategies="fsdp megatron" sizes=""
    # Dry: fsdp only (megatron on the CPU needs the test-only shims), the smallest model.
    [ "$mode" = dry ] && accel=cpu steps=2 strategies="fsdp" sizes="model.hidden_size=32 model.intermediate_size=64"
    local rc=0
    for s in $strategies; do
        echo "== nemo-replay train, replay.strategy=$s, trainer.accelerator=$accel, $steps steps"
        "$py" -m nemo_replay train replay.strategy="$s" trainer.accelerator="$accel" trainer.steps="$steps" \
            trainer.output_dir="$work/train-$s" trainer.progress_bar=false trainer.plot=false \
            trainer.prompts_per_step=4 trainer.group_size=4 generation.max_new_tokens=8 $sizes || rc=$?
        [ -f "$work/train-$s/metrics.jsonl" ] && sed "s/^/{\"strategy\": \"$s\", \"row\": /; s/\$/}/" \
            "$work/train-$s/metrics.jsonl" >> "$OUT/train-metrics.jsonl"
    done
    return $rc
}

bench() {
    if [ "$mode" = cuda ]; then
        "$py" -m benchmarks.run --device cuda --quick --out "$OUT/benchmarks-gpu.md"
    else
        "$py" -c "import sys; from benchmarks.gpu import main; sys.exit(main('tiny', out=sys.argv[1], device='cpu'))" \
            "$OUT/benchmarks-gpu.md"
    fi
}

phase machine 15 bash -c "$(declare -f machine); py='$py' OUT='$OUT' summary='$summary' machine"
phase install 45 bash -c "$(declare -f install); py='$py' site='$site' wheels='$wheels' install" > "$OUT/install.log" 2>&1
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
phase tests 170 bash -c "$(declare -f tests); py='$py' mode='$mode' tests" > "$OUT/pytest-gpu.log" 2>&1
phase train 100 bash -c "$(declare -f train); py='$py' mode='$mode' work='$work' OUT='$OUT' train" > "$OUT/train.log" 2>&1
phase bench 140 bash -c "$(declare -f bench); py='$py' mode='$mode' OUT='$OUT' bench" > "$OUT/benchmarks.log" 2>&1
echo "total: $(($(date +%s) - start)) s of $limit s" >> "$summary"
cat "$summary"
