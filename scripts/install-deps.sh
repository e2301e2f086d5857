#!/usr/bin/env bash
# Installs what Pion needs to build, run and test, from Debian packages only.
# Idempotent: does nothing when everything is already installed.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config clang clang-format
  libspdlog-dev libfmt-dev libcli11-dev libtomlplusplus-dev libxxhash-dev zlib1g-dev libhnswlib-dev
  libcurl4-openssl-dev nlohmann-json3-dev libssl-dev
  libgtest-dev libgmock-dev
  redis-server redis-tools
  python3 python3-pytest python3-redis python3-numpy python3-psutil
  # tests/test_quality_trained.py trains a small model; OpenBLAS is libtorch's recommended BLAS
  # (--no-install-recommends drops it): on the reference BLAS a training step is ~8x slower.
  python3-torch libopenblas0-serial
  curl
  prometheus
  etcd-server etcd-client
  libhwy-dev libbenchmark-dev
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
