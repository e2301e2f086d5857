#!/usr/bin/env bash
# Packs what the GPU machine needs to run the GPU tests and benchmarks — it has CUDA, PyTorch and
# numpy but no Debian packages: build/devcarry/{bin,lib,py} with pion-server, the GPU test and
# bench binaries, the shared libraries they link, and the Python packages the tests use.
#   scripts/gpu-bundle.sh [build-dir]      (default: build)
set -euo pipefail
BUILD=${1:-build}
OUT=build/devcarry
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/py" "$OUT/pytest"
for b in pion-server gpu_attention_test pion-attn-bench pion-gpu-attn-bench pion-fetch-bench; do
  [ -x "$BUILD/$b" ] && cp "$BUILD/$b" "$OUT/bin/"
done
ldd "$OUT"/bin/* | awk '$3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libpthread*|libdl.so*|librt.so*) ;;
    *) cp -L "$lib" "$OUT/lib/" ;;
  esac
done
# py/: on PYTHONPATH always; pytest/: only where the machine has no pytest of its own (a
# second pytest would clash with the plugins of the one installed there).
for pkg in redis async_timeout; do
  src=/usr/lib/python3/dist-packages/$pkg
  [ -e "$src" ] && cp -r "$src" "$OUT/py/"
done
for pkg in pytest _pytest pluggy iniconfig packaging py.py; do
  src=/usr/lib/python3/dist-packages/$pkg
  [ -e "$src" ] && cp -r "$src" "$OUT/pytest/"
done
cp -r clients/python/pion "$OUT/py/" 2>/dev/null || true
du -sh "$OUT"
