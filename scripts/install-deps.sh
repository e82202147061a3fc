#!/usr/bin/env bash
# Installs everything dtactor needs to build, test and run on Debian bookworm.
# Debian packages, and the npm packages tests/k8s/package-lock.json pins
# (the manifest checks); nothing is downloaded from anywhere else. Needs root.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

pkgs=(
  build-essential cmake ninja-build ccache pkg-config git
  # LibTorch (CPU) + Gloo for c10d collectives
  libtorch-dev libgloo-dev
  # fast BLAS: LibTorch calls whatever libblas.so.3 is installed
  libopenblas0-pthread
  # actors, sockets, wire, metrics (Debian's libzmq5 is built with libsodium:
  # CURVE for job keys, docs/security.md)
  libcaf-dev libzmq3-dev cppzmq-dev libprotobuf-dev protobuf-compiler prometheus-cpp-dev
  # command line, config, JSON, compression, tests
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev zlib1g-dev libxxhash-dev libgtest-dev libgmock-dev
  # fuzzing (scripts/fuzz.sh, docs/fuzzing.md): clang with libFuzzer and the sanitizers' runtimes
  clang libclang-rt-14-dev
  # monitoring: the Prometheus server and promtool (alert rule tests, the scrape integration test)
  prometheus
  # data sets, read in place
  dataset-fashion-mnist dict-freedict-eng-ita dict-gcide
  # NumPy, to check that .npy files NumPy writes read back the same (tests);
  # PyTorch (the same 1.13.1 as libtorch-dev), to write the scripted modules
  # the TorchScript tests train and to read back what `dtactor export` wrote
  python3-numpy python3-torch
  # PIL, to write the PNG/JPEG tar shards of the tests and of
  # examples/shards/make_tar_shards.py as PyTorch users' tools write them
  python3-pil
  # S3 checkpoint store: HTTP (libcurl) and SigV4's SHA-256/HMAC (OpenSSL);
  # OpenSSL also signs checkpoint manifests (HMAC-SHA256) and draws job keys' MAC keys
  libcurl4-openssl-dev libssl-dev
  # images in tar shards (data.train_shards): PNG and JPEG decoders
  libpng-dev libjpeg62-turbo-dev
  # a real S3 server that checks signatures, for the S3 tests: Ceph's radosgw
  # on a one-machine cluster (scripts/rgw/start-rgw.sh); iproute2 for `ss`
  radosgw ceph-mon ceph-osd iproute2 curl
  # a real one-machine Slurm for the Slurm tests (scripts/slurm/start-slurm.sh)
  slurmctld slurmd slurm-client munge
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm, for the offline checks of deploy/kubernetes (tests/k8s):
# the machine's own where it has them (its node may come with its npm),
# else Debian's (bookworm: nodejs 18, npm 9).
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Make sure libblas.so.3 resolves to OpenBLAS, not the reference BLAS.
for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu; do
  target=$(update-alternatives --list "$alt" 2>/dev/null | grep openblas-pthread | head -1 || true)
  if [ -n "$target" ]; then $SUDO update-alternatives --set "$alt" "$target" >/dev/null; fi
done
# The npm packages the Kubernetes manifest checks use, at the versions
# tests/k8s/package-lock.json pins (the npm registry; nothing else).
(cd "$(dirname "$0")/../tests/k8s" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
echo "install-deps: all packages present; libblas.so.3 -> $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3); tests/k8s/node_modules from package-lock.json"
