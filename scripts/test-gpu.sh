#!/usr/bin/env bash
# The GPU tests (make test-gpu), on a machine with an NVIDIA GPU:
#   1. gpu_attention_test: every CUDA kernel and form against the scalar reference, plus the
#      residency engine's GPU tier (promotion, demotion of unpinned replicas, pins);
#   2. compute-sanitizer: memcheck and synccheck on the Smoke cases (every kernel, the cluster
#      decode's 16- and 32-key tiles), racecheck on them, on the one-launch SHARED
#      sparse-auto's test, and memcheck and racecheck on the eight-group batched kernel's
#      (BatchedSmoke) and the streaming decode's (StreamDecodeSmoke) — fp16, bf16 and fp8, each
#      in a process of its own — memcheck on back-to-back overlapping decodes
#      (StreamDecodeBackToBack) and on the selection paths (top-k, sparse-auto with RECENT, the
#      receipts' bound and AUDIT);
#   3. the Stage 2 and residency end-to-end suites against a real pion-server with
#      --attention-backend cuda (and pion-server-faults for the failed-GPU-copy case);
#   4. the transformers integration (tests/test_hf.py: Stage 1 over TCP, shm and CUDA IPC; Stage 2).
# PION_GPU_BIN names the directory with pion-server and gpu_attention_test (default: build).
# Arguments pick steps (default: all four): kernels, sanitizers, suites, hf — e.g.
# `scripts/test-gpu.sh kernels sanitizers` then `scripts/test-gpu.sh suites hf` where one
# command may only run for a few minutes.
# Every step runs even when an earlier one fails (a sanitizer's report does not hide the
# end-to-end suites'); the script then names the failed steps and exits 1.
set -euo pipefail
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(kernels sanitizers suites hf)
for s in "${steps[@]}"; do
  case $s in
    kernels | sanitizers | suites | hf) ;;
    *)
      echo "test-gpu: unknown step '$s' (steps: kernels sanitizers suites hf)" >&2
      exit 2
      ;;
  esac
done
# wants STEP: whether STEP was asked for.
wants() { [[ " ${steps[*]} " == *" $1 "* ]]; }
BIN=$(cd "${PION_GPU_BIN:-build}" && pwd)
PY=${PYTHON:-python3}
# A gpu-bundle still packed (bin/*.xz): restore its binaries first.
if compgen -G "$BIN/*.xz" >/dev/null && [ -f "$BIN/../unpack.py" ]; then
  "$PY" "$BIN/../unpack.py"
fi
failed=()
# step NAME CMD...: runs CMD, and records NAME when it fails.
step() {
  local name=$1
  shift
  echo "== test-gpu: $name"
  if ! "$@"; then
    failed+=("$name")
    echo "== test-gpu: $name FAILED" >&2
  fi
}
wants kernels && step gpu_attention_test "$BIN/gpu_attention_test"
sanitizers() {
  if command -v compute-sanitizer >/dev/null 2>&1 ||
    [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    # --num-cuda-barriers: room to track every mbarrier of a test's launches (the default table
    # overflows over the cluster kernels' many launches: synccheck then fails the launch, and
    # racecheck reports hazards against barriers it no longer tracks).
    smoke='GpuExecutor.Smoke:GpuTier.*'
    run() { step "$1 $2" "$CS" --tool "$1" --num-cuda-barriers 65536 --error-exitcode 1 \
      "$BIN/gpu_attention_test" --gtest_filter="$2"; }
    run memcheck "$smoke"
    run synccheck "$smoke"
    run racecheck "$smoke"
    run racecheck GpuExecutor.SparseAutoSharedOneLaunch
    run memcheck GpuExecutor.BatchedSmoke
    run racecheck GpuExecutor.BatchedSmoke
    run memcheck GpuExecutor.StreamDecodeSmoke
    run racecheck GpuExecutor.StreamDecodeSmoke
    run memcheck GpuExecutor.StreamDecodeBackToBack
    # The selection paths: top-k, sparse-auto with RECENT, the receipt's bound and AUDIT's
    # rescoring (downloads of every visible key's score).
    run memcheck 'GpuExecutor.TopK:GpuExecutor.SparseAuto:GpuExecutor.SparseAutoTiedAndCrowdedScores'
  else
    echo "compute-sanitizer not found: the sanitizer runs need it" >&2
    failed+=("compute-sanitizer (not found)")
  fi
}
wants sanitizers && sanitizers
wants suites && PION_SERVER="$BIN/pion-server" PION_TEST_SERVER_ARGS="--attention-backend cuda" \
  PION_FAULT_SERVER="$BIN/pion-server-faults" \
  step "Stage 2 and residency suites (cuda)" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_attend_prefix.py tests/test_attend_gpu.py tests/test_residency.py \
  tests/test_attend_mla.py
# The transformers integration (skipped with the reason where PyTorch or transformers is not
# installed: the module skips itself, and pytest's exit 5, "no tests collected", is no failure).
hf_suite() {
  local rc=0
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_hf.py || rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}
wants hf && PION_SERVER="$BIN/pion-server" \
  PION_TEST_SERVER_ARGS="--attention-backend cuda --gpu-memory 8gb" \
  step "transformers integration" hf_suite
if [ ${#failed[@]} -gt 0 ]; then
  printf 'test-gpu: %d step(s) failed:\n' "${#failed[@]}" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "test-gpu: no step failed (${steps[*]})"
