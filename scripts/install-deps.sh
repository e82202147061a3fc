#!/usr/bin/env bash
# Installs what dtactor needs on Debian bookworm, from Debian's packages.
#   scripts/install-deps.sh          to build dtactor and run its jobs and examples
#   scripts/install-deps.sh --test   also what the test suite and the fuzzing
#                                    need (scripts/test.sh and .ci/run call it)
# With --test it also installs the npm packages that tests/k8s/ (the
# Kubernetes manifest checks) and tests/browser/ (playwright-core, driving
# Debian's chromium) pin in their package-lock.json; nothing else is
# downloaded from anywhere but Debian's mirror. Needs root (or sudo).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
test_stack=false
case "${1:-}" in
  "") ;;
  --test) test_stack=true ;;
  *) echo "usage: scripts/install-deps.sh [--test]" >&2; exit 2 ;;
esac

pkgs=(
  build-essential cmake ninja-build ccache pkg-config
  # LibTorch (CPU) + Gloo for c10d collectives
  libtorch-dev libgloo-dev
  # fast BLAS: LibTorch calls whatever libblas.so.3 is installed
  libopenblas0-pthread
  # actors, sockets, wire, metrics (Debian's libzmq5 is built with libsodium:
  # CURVE for job keys, docs/security.md); prometheus-cpp brings civetweb
  libcaf-dev libzmq3-dev cppzmq-dev libprotobuf-dev protobuf-compiler prometheus-cpp-dev
  # command line, config, JSON, compression, checksums
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev zlib1g-dev libdeflate-dev libxxhash-dev
  # S3 checkpoint store and data: HTTP (libcurl) and SigV4's SHA-256/HMAC
  # (OpenSSL); OpenSSL also signs checkpoint manifests and draws job keys
  libcurl4-openssl-dev libssl-dev
  # images in tar shards (data.train_shards): PNG and JPEG decoders
  libpng-dev libjpeg62-turbo-dev
  # the data sets the default job (Fashion-MNIST) and the examples in
  # examples/ (GCIDE, FreeDict eng-ita) read in place
  dataset-fashion-mnist dict-freedict-eng-ita dict-gcide
)
if $test_stack; then
  pkgs+=(
    # the C++ tests (CMake builds them only where GoogleTest is found)
    libgtest-dev libgmock-dev
    # fuzzing (scripts/fuzz.sh, docs/fuzzing.md): clang with libFuzzer and the sanitizers' runtimes
    clang libclang-rt-14-dev
    # monitoring: the Prometheus server and promtool (alert rule tests, the scrape integration test)
    prometheus
    # NumPy, to check that .npy files NumPy writes read back the same;
    # PyTorch (the same 1.13.1 as libtorch-dev), to write the scripted modules
    # the TorchScript tests train and to read back what `dtactor export` wrote
    python3-numpy python3-torch
    # PIL, to write the PNG/JPEG tar shards of the tests and of
    # examples/shards/make_tar_shards.py as PyTorch users' tools write them
    python3-pil
    # a real S3 server that checks signatures, for the S3 tests: Ceph's radosgw
    # on a one-machine cluster (scripts/rgw/start-rgw.sh); iproute2 for `ss`
    radosgw ceph-mon ceph-osd iproute2 curl
    # a real one-machine Slurm for the Slurm tests (scripts/slurm/start-slurm.sh)
    slurmctld slurmd slurm-client munge
    # a real browser for the status page's test (headless, driven by playwright-core)
    chromium
    # a real etcd for the leader lease's tests (tests/etcd_lease_test.cpp)
    etcd-server
  )
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if $test_stack; then
  # Node.js and npm, for the offline checks of deploy/kubernetes (tests/k8s):
  # the machine's own where it has them (its node may come with its npm),
  # else Debian's (bookworm: nodejs 18, npm 9).
  command -v node >/dev/null || missing+=(nodejs)
  command -v npm >/dev/null || missing+=(npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Make sure libblas.so.3 resolves to OpenBLAS, not the reference BLAS.
for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu; do
  target=$(update-alternatives --list "$alt" 2>/dev/null | grep openblas-pthread | head -1 || true)
  if [ -n "$target" ]; then $SUDO update-alternatives --set "$alt" "$target" >/dev/null; fi
done
if $test_stack; then
  # The npm packages the tests use, at the versions each package-lock.json
  # pins (the npm registry); again only when the lock file is newer than the
  # last install.
  for dir in tests/k8s tests/browser; do
    d="$(dirname "$0")/../$dir"
    if [ ! "$d/node_modules/.package-lock.json" -nt "$d/package-lock.json" ]; then
      (cd "$d" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    fi
  done
  echo "install-deps: build, run and test packages present; libblas.so.3 -> $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3); tests/k8s and tests/browser node_modules from their package-lock.json"
else
  echo "install-deps: build and run packages present; libblas.so.3 -> $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3) (the tests' packages: scripts/install-deps.sh --test)"
fi
