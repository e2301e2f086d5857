#!/usr/bin/env bash
# Same-binary A/B of one pion-gpu-attn-bench switch on the GPU machine (kernel changes that keep
# the old path behind an environment switch are measured this way before they are merged):
#   scripts/gpu-ab.sh VAR "on off" ROUNDS "dense f16 32 8 1 2048 128" "dense f32 ..." ...
# prints, per shape and round, the mean µs per call with VAR=on and VAR=off, alternating.
# VAR = BIN compares builds instead: the values are pion-gpu-attn-bench binaries (a kernel change
# against the build before it, both carried to the GPU machine), run alternately the same way:
#   scripts/gpu-ab.sh BIN "build/devcarry/bin/bench_main build/devcarry/bin/pion-gpu-attn-bench" 3 …
# PION_GPU_BIN names the directory with pion-gpu-attn-bench (default: build); PION_AB_KEY the
# JSON field compared (default us; fused_us for sparse_auto ... fused); PION_AB_LOG a file that
# gets every full JSON line (e.g. with PION_BENCH_TRACE=1's phases).
set -euo pipefail
VAR=$1
read -r -a VALUES <<<"$2"
ROUNDS=$3
shift 3
BENCH="${PION_GPU_BIN:-build}/pion-gpu-attn-bench"
KEY=${PION_AB_KEY:-us}
LOG=${PION_AB_LOG:-/dev/null}
for ((round = 1; round <= ROUNDS; ++round)); do
  for shape in "$@"; do
    line="round $round | $shape |"
    for v in "${VALUES[@]}"; do
      # shellcheck disable=SC2086
      if [ "$VAR" = BIN ]; then
        json=$("$v" $shape | head -1)
        v=$(basename "$v")
      else
        json=$(env "$VAR=$v" "$BENCH" $shape | head -1)
      fi
      echo "$VAR=$v $json" >>"$LOG"
      us=$(grep -oE "\"$KEY\": [0-9.]+" <<<"$json" | head -1 | sed 's/.*: //' || true)
      us=${us:-?}
      line="$line $VAR=$v $us"
    done
    echo "$line"
  done
done
