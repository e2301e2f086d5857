#!/usr/bin/env bash
# Runs a libFuzzer target over its corpus, for a bounded time or until a number of executions;
# new inputs it finds go to a scratch directory (not the checked-in corpus), crashes to
# fuzz/crashes/. Fails on any finding (crash, sanitizer report, leak, timeout, out-of-memory)
# and, when <runs> is given, on fewer executions than that. FUZZ_FLAGS adds libFuzzer flags
# (later ones win); FUZZ_LOG keeps the whole output there.
# Usage: scripts/run-fuzz.sh <fuzzer-binary> <corpus-dir> <seconds> [<runs>]
set -euo pipefail
bin=$1
corpus=$2
secs=${3:-60}
runs=${4:-0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log=${FUZZ_LOG:-$work/log}
mkdir -p fuzz/crashes
limits=(-max_total_time="$secs")
if [ "$runs" -gt 0 ]; then
  limits+=(-runs="$runs")
  echo "fuzz: $(basename "$bin") for $runs executions (at most ${secs}s) over $corpus"
else
  echo "fuzz: $(basename "$bin") for ${secs}s over $corpus"
fi
# shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
if ! "$bin" "$work" "$corpus" "${limits[@]}" -max_len=70000 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix=fuzz/crashes/ -print_final_stats=1 ${FUZZ_FLAGS:-} >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "fuzz: $(basename "$bin") FAILED (artifacts in fuzz/crashes/)"
  exit 1
fi
tail -n 8 "$log"
# libFuzzer's last status line (coverage, features, corpus) and its run count and time.
grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1
grep -E '^Done [0-9]+ runs' "$log" | tail -n 1
done=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
if [ "$runs" -gt 0 ] && [ "${done:-0}" -lt "$runs" ]; then
  echo "fuzz: $(basename "$bin") ran ${done:-0} of $runs executions within ${secs}s"
  exit 1
fi
echo "fuzz: $(basename "$bin") finished clean: ${done:-?} executions"
