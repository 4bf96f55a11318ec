#!/usr/bin/env bash
# Issue #19's GPU check, a few minutes on one CUDA device: the decode step captured in CUDA graphs under
# every block-set kind, and the commands that report ms/token on it.
#
#     bash scripts/check_cuda.sh [OUT_DIR]          # default: cuda_check/
#
# Run it from the repository's root where torch sees a CUDA device and `import lab, serve` works: a
# CUDA build of torch with the project installed (`pip install -e .` next to it; requirements.lock pins
# the CPU wheel), or, on a machine whose image already holds torch, the packages it lacks carried in
# as wheels and PYTHONPATH set to the checkout (docs/inference.md, "On a GPU"). It writes into OUT_DIR:
#   pytest.txt      the `gpu` tests (tests/test_cuda.py, tests/test_fast.py's CUDA graphs)
#   generate.jsonl  `blocklab generate --device cuda` per block set, eager and --compile (graphs)
#   depth.json      `blocklab depth --device cuda --dtype bfloat16`
#   decode.json     `scripts/bench_decode.py --device cuda`: eager and graphs per dtype and block set
#   traffic/        `blocklab traffic --serve gpt2-random --serve-dtype bfloat16` (workers on the GPU)
#   summary.txt     each step's exit status and seconds
# and exits 1 if any step failed, 0 if all passed.
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'  # this header
    exit 0
fi
out=${1:-cuda_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 - <<'EOF' || { echo "no CUDA device or no blocklab here: nothing checked" >&2; exit 1; }
import torch
import lab, serve  # noqa: F401
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

failed=0
step() {  # step NAME COMMAND...: run it, note its status and time in summary.txt
    local name=$1 start=$SECONDS
    shift
    "$@"
    local status=$?
    printf '%-10s exit %d, %d s\n' "$name" "$status" "$((SECONDS - start))" | tee -a "$out/summary.txt"
    [ "$status" -eq 0 ] || failed=1
}

generate_all() {
    for blocks in all skip=3,4,5 keep=0,1,11 overwrite=5 exit=6 adaptive=0.9 speculate=6; do
        for compile in "" --compile; do
            python3 -m lab.cli generate --model gpt2-random --device cuda --dtype bfloat16 --blocks "$blocks" \
                --prompt "def main(" --max-new-tokens 64 --seed 1 --json $compile || return 1
        done
    done > "$out/generate.jsonl"
}

step pytest bash -c "python3 -m pytest -q -m gpu tests/test_cuda.py tests/test_fast.py > '$out/pytest.txt' 2>&1"
step generate generate_all
step depth bash -c "python3 -m lab.cli depth --device cuda --dtype bfloat16 --repeats 2 --json --no-plot > '$out/depth.json'"
step decode python3 scripts/bench_decode.py --device cuda --rounds 3 --tokens 16 --json "$out/decode.json"
step traffic python3 -m lab.cli traffic --serve gpt2-random --serve-dtype bfloat16 --requests 8 --out "$out/traffic"
exit "$failed"
