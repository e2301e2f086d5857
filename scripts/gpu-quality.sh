#!/usr/bin/env bash
# The quality lab (issue 55) in one GPU call: trains the model (bench/quality/train.py), evaluates
# it through a real pion-server on the CUDA backend (bench/quality/eval.py) and meanwhile runs
# gpu_attention_test (every CUDA kernel and form against the scalar reference); everything ends
# before a deadline, and what comes back fits the device tool's limits: the checkpoint's shards
# and results.tgz (logs, config.json, the loss curve, quality.json/md and the PNGs) under $OUT.
#
#   python3 build/devcarry/unpack.py   # a gpu-bundle (scripts/gpu-bundle.sh build) carried
#   scripts/gpu-quality.sh
#
# Environment (defaults in brackets):
#   PION_QL_DEADLINE_S  seconds from the start by which everything has ended [585]
#   PION_QL_MINUTES     train.py --minutes; 0: no training, evaluate bench/quality/out [5]
#   PION_QL_EVAL_ARGS   eval.py's arguments beyond --ckpt/--bin/--out [a reduced grid]
#   PION_QL_TESTS       1: gpu_attention_test beside the evaluation [1]
#   OUT                 where the results go [bench/quality/out/run]
set -uo pipefail
start=$(date +%s)
deadline=$((start + ${PION_QL_DEADLINE_S:-585}))
minutes=${PION_QL_MINUTES:-5}
out=${OUT:-bench/quality/out/run}
ckpt=bench/quality/out
bin=build/devcarry/bin
mkdir -p "$out" "$ckpt"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/build/devcarry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$PWD/build/devcarry/py${PYTHONPATH:+:$PYTHONPATH}
left() { echo $((deadline - $(date +%s))); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$work/device.txt" 2>&1

if [ "$minutes" != 0 ]; then
  echo "== gpu-quality: train.py --minutes $minutes ($(left) s left)"
  timeout "$(($(left) - 60))" python3 bench/quality/train.py --out "$ckpt" --minutes "$minutes" \
    2>&1 | tee "$work/train.log"
  cp "$ckpt"/model-*.safetensors "$out/" 2>/dev/null
  cp "$ckpt"/config.json "$ckpt"/loss.json "$work/" 2>/dev/null
  cp "$ckpt"/loss.png "$work/" 2>/dev/null
fi

tests_pid=
if [ "${PION_QL_TESTS:-1}" = 1 ] && [ -x "$bin/gpu_attention_test" ]; then
  timeout "$(($(left) - 20))" "$bin/gpu_attention_test" >"$work/gpu_attention_test.log" 2>&1 &
  tests_pid=$!
fi
echo "== gpu-quality: eval.py ($(left) s left)"
# shellcheck disable=SC2086  # the arguments are words
timeout "$(($(left) - 15))" python3 bench/quality/eval.py --ckpt "$ckpt" --bin "$bin" \
  --out "$work/quality" ${PION_QL_EVAL_ARGS:---seqs 3 --cont 96 --needles 4 --budgets 8,16 \
  --needle-budgets 16 --selects quest,mean+shared,mean+shared+r4+l2} 2>&1 | tee "$work/eval.log" |
  grep -v "^  warnings.warn\|UserWarning"
if [ -n "$tests_pid" ]; then
  wait "$tests_pid"
  echo "gpu_attention_test exit $?" >>"$work/gpu_attention_test.log"
  tail -3 "$work/gpu_attention_test.log"
fi
tar -C "$work" -czf "$out/results.tgz" .
rm -rf "$work"
echo "== gpu-quality: $(($(date +%s) - start)) s; in $out:"; find "$out" -maxdepth 1 -type f -printf "%f %s\n"
