#!/usr/bin/env bash
# Packs what the GPU machine needs to run the GPU tests and benchmarks — it has CUDA, PyTorch and
# numpy but no Debian packages: <build-dir>/devcarry/{bin,lib,py} with pion-server, the GPU test
# and bench binaries (xz-compressed: `python3 <build-dir>/devcarry/unpack.py` there restores
# them), the shared libraries they link, and the Python packages the tests use.
#   scripts/gpu-bundle.sh [build-dir [binary ...]]      (default: build → build/devcarry)
# Further binaries (e.g. a pion-gpu-attn-bench of the build before a kernel change, copied to
# another name, for `scripts/gpu-ab.sh BIN`) travel in bin/ under their file names.
# PION_BUNDLE_BINS (default: all five below) names the build's binaries to pack, e.g.
# PION_BUNDLE_BINS=pion-server for a run that needs only the server (a smaller bundle leaves
# room in the 64 MiB that travels for a model checkpoint).
set -euo pipefail
BUILD=${1:-build}
shift $(($# > 0 ? 1 : 0))
OUT=$BUILD/devcarry
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/py" "$OUT/pytest"
for b in ${PION_BUNDLE_BINS:-pion-server pion-server-faults gpu_attention_test pion-gpu-attn-bench pion-fetch-bench}; do
  [ -x "$BUILD/$b" ] && cp "$BUILD/$b" "$OUT/bin/"
done
for extra in "$@"; do
  cp "$extra" "$OUT/bin/"
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
# The binaries' GPU code makes them large, and the libraries they link (libcurl's among them)
# add up; a transfer to the GPU machine is capped (64 MiB there), so both travel
# xz-compressed and unpack.py restores them on the GPU machine.
cat > "$OUT/unpack.py" <<'PY'
"""Restores the bundle's compressed binaries and libraries (bin/*.xz, lib/*.xz) in place:
python3 build/devcarry/unpack.py"""
import lzma
import pathlib

here = pathlib.Path(__file__).resolve().parent
for packed in sorted([*(here / "bin").glob("*.xz"), *(here / "lib").glob("*.xz")]):
    binary = packed.with_suffix("")
    binary.write_bytes(lzma.decompress(packed.read_bytes()))
    binary.chmod(0o755)
    packed.unlink()
PY
for b in "$OUT"/bin/* "$OUT"/lib/*; do
  python3 -c 'import lzma, pathlib, sys
p = pathlib.Path(sys.argv[1])
pathlib.Path(sys.argv[1] + ".xz").write_bytes(lzma.compress(p.read_bytes(), preset=3))
p.unlink()' "$b"
done
du -sh "$OUT"
