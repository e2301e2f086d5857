#!/usr/bin/env bash
# Runs a libFuzzer target for a bounded time over its corpus; new inputs it finds go to a
# scratch directory (not the checked-in corpus), crashes to fuzz/crashes/.
# Usage: scripts/run-fuzz.sh <fuzzer-binary> <corpus-dir> <seconds>
set -euo pipefail
bin=$1
corpus=$2
secs=${3:-60}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p fuzz/crashes
echo "fuzz: $(basename "$bin") for ${secs}s over $corpus"
"$bin" "$work" "$corpus" -max_total_time="$secs" -max_len=70000 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix=fuzz/crashes/ -print_final_stats=1 2>&1 | tail -n 15
echo "fuzz: $(basename "$bin") finished clean"
