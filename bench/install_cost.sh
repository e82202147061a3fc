#!/usr/bin/env bash
# What scripts/install-deps.sh costs on a bare Debian bookworm machine: the
# light set (build and run dtactor, the README's first command) and the full
# set (--test, what scripts/test.sh installs), each from its own fresh copy of
# a bare system. Packages installed, bytes downloaded (the .deb archives apt
# fetched) and the wall time of the script (apt-get update, the downloads and
# the unpacking; with --test also npm ci in tests/k8s and tests/browser).
#
# The bare machine is emulated: `debootstrap bookworm` (Debian's default
# variant: the required and important packages, as a minimal server image)
# into a chroot with /proc mounted and Debian's sources as this machine has
# them (bookworm, bookworm-updates, bookworm-security on deb.debian.org).
# The downloads go over this machine's network, so the time says as much
# about the link to the mirror as about the packages.
#
# Usage (root; needs debootstrap): bench/install_cost.sh [--work /tmp/install_cost] [--out bench/install_cost_results.json]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=/tmp/install_cost
out=$root/bench/install_cost_results.json
cmdline=$(echo "bench/install_cost.sh $*" | sed 's/ *$//')
while [ $# -gt 0 ]; do
  case "$1" in
    --work) work=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: bench/install_cost.sh [--work DIR] [--out FILE]" >&2; exit 2 ;;
  esac
done
command -v debootstrap >/dev/null || { echo "install_cost: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
mirror=http://deb.debian.org/debian

mkdir -p "$work"
if [ ! -e "$work/base/.done" ]; then
  rm -rf "$work/base"
  debootstrap bookworm "$work/base" "$mirror" >"$work/debootstrap.log" 2>&1
  cat >"$work/base/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  # As container images do: services are not started inside the chroot.
  printf '#!/bin/sh\nexit 101\n' >"$work/base/usr/sbin/policy-rc.d"
  chmod +x "$work/base/usr/sbin/policy-rc.d"
  rm -f "$work/base/var/cache/apt/archives/"*.deb
  touch "$work/base/.done"
fi

# measure NAME ARGS: a fresh copy of the base, the script run inside it.
measure() {
  local name=$1; shift
  local dir=$work/$name
  rm -rf "$dir"
  cp -a "$work/base" "$dir"
  cp /etc/resolv.conf "$dir/etc/resolv.conf"
  mkdir -p "$dir/src/scripts"
  cp "$root/scripts/install-deps.sh" "$dir/src/scripts/"
  # The npm packages --test installs: every tests/*/ with a package-lock.json.
  for lock in "$root"/tests/*/package-lock.json; do
    local t
    t=$(basename "$(dirname "$lock")")
    mkdir -p "$dir/src/tests/$t"
    cp "$root/tests/$t/package.json" "$lock" "$dir/src/tests/$t/"
  done
  # Where this machine reaches the internet through a proxy with its own
  # certificate authority (as here), the chroot gets that CA too, for npm
  # (apt uses plain http); a bare machine on an open network needs none.
  local extra_ca=""
  if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$dir/etc/ssl"
    cat /usr/local/share/ca-certificates/*.crt >"$dir/etc/ssl/extra-ca.pem"
    extra_ca=/etc/ssl/extra-ca.pem
  fi
  mount -t proc proc "$dir/proc"
  trap 'umount "'"$dir"'/proc" 2>/dev/null || true' RETURN
  local before after t0 t1 debs
  before=$(chroot "$dir" dpkg-query -W -f='${Status}\n' | grep -c "install ok installed")
  t0=$(date +%s.%N)
  chroot "$dir" env ${extra_ca:+NODE_EXTRA_CA_CERTS=$extra_ca} bash /src/scripts/install-deps.sh "$@" >"$work/$name.log" 2>&1
  t1=$(date +%s.%N)
  after=$(chroot "$dir" dpkg-query -W -f='${Status}\n' | grep -c "install ok installed")
  debs=$(find "$dir/var/cache/apt/archives" -name '*.deb' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  local npm_bytes=0
  [ -d "$dir/root/.npm/_cacache" ] && npm_bytes=$(du -sb "$dir/root/.npm/_cacache" | cut -f1)
  local used
  used=$(du -sxb "$dir" | cut -f1)
  echo "{\"name\": \"$name\", \"args\": \"$*\", \"packages_before\": $before, \"packages_after\": $after, \"packages_installed\": $((after - before)), \"deb_bytes_downloaded\": $debs, \"npm_cache_bytes\": $npm_bytes, \"wall_s\": $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}'), \"root_bytes_after\": $used}" >"$work/$name.json"
  tail -1 "$work/$name.log"
  cat "$work/$name.json"
}

base_bytes=$(du -sxb "$work/base" | cut -f1)
measure light
measure full --test
rm -rf "$work/light" "$work/full"

PYTHONPATH="$root/bench" python3 - "$out" "$cmdline" "$work" "$base_bytes" <<'EOF'
import json, sys, os
out, cmd, work, base_bytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import bench_meta
light = json.load(open(os.path.join(work, "light.json")))
full = json.load(open(os.path.join(work, "full.json")))
res = {"bare_machine": "debootstrap bookworm (default variant) in a chroot, /proc mounted, deb.debian.org",
       "bare_root_bytes": base_bytes, "light": light, "full": full}
F = bench_meta.figure
bench_meta.write(out, res, "scripts/install-deps.sh on a bare Debian bookworm (debootstrap chroot): the light set against --test",
                 "Install and documentation", [
    F("packages installed by scripts/install-deps.sh (the README's first command)", ["light", "packages_installed"], "count",
      "with --test (scripts/test.sh)", ["full", "packages_installed"]),
    F("bytes downloaded (.deb archives)", ["light", "deb_bytes_downloaded"], "bytes",
      "with --test", ["full", "deb_bytes_downloaded"]),
    F("wall time of the install (apt-get update, downloads, unpacking; --test: npm ci too)", ["light", "wall_s"], "s",
      "with --test", ["full", "wall_s"]),
    F("disk used by the system after the install", ["light", "root_bytes_after"], "bytes",
      "with --test", ["full", "root_bytes_after"]),
], cmd, notes="the apt part only (the build is not in it); the downloads come from deb.debian.org over this machine's link, so "
             "their time depends on it; --test also fetched %s of npm packages" % "{:,} bytes".format(full["npm_cache_bytes"]))
print("install_cost: wrote " + out)
EOF
