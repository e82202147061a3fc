#!/usr/bin/env bash
# Rewrites the seed files (seed-*) of fuzz/corpus/ from real code paths and
# real data (docs/fuzzing.md); files named regression-* (inputs fuzzing
# found) are kept. Needs the fuzz build (scripts/fuzz.sh builds it) and
# /usr/bin/python3.11 with NumPy; seeds from a real run need a normal build
# (DTACTOR_BIN_DIR, default build/) and strace, the S3 ones radosgw.
# Usage: fuzz/make_corpus.sh [FUZZ_BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-${DTACTOR_FUZZ_BUILD_DIR:-build-fuzz}}
corpus=fuzz/corpus
find "$corpus" -name 'seed-*' -delete 2>/dev/null || true
mkdir -p "$corpus"
nice -n 10 cmake --build "$build" --target fuzz_make_seeds >/dev/null
# The in-process cluster run, manifests, ZAP, key file, rendezvous, config.
"$build/fuzz/fuzz_make_seeds" "$corpus" 2>&1 | grep '^make_seeds' || true
/usr/bin/python3.11 fuzz/make_data_seeds.py "$corpus"
# Tar shards as Python's tarfile writes them (ustar, prefix, GNU, pax), with PNG and JPEG members.
mkdir -p "$corpus/tar_shard"
tars=$(mktemp -d)
/usr/bin/python3.11 tests/data/make_tar_fixtures.py "$tars"
for f in "$tars"/*.tar; do cp "$f" "$corpus/tar_shard/seed-$(basename "$f")"; done
rm -rf "$tars"

# Configs: every example job, as users write them.
for f in examples/*.toml examples/torchscript/*.toml examples/custom_task/*.toml; do
  cp "$f" "$corpus/config_toml/seed-$(basename "$(dirname "$f")")-$(basename "$f")"
done

# Cloud preemption notices as tests/fake_metadata.py serves them (before and
# after the notice), prefixed with the target's cloud selector byte.
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
mkdir -p "$corpus/preemption_notice"
for cloud in aws gcp azure; do
  /usr/bin/python3.11 tests/fake_metadata.py --cloud "$cloud" --port-file "$tmp/$cloud.port" &
  for _ in $(seq 50); do [ -s "$tmp/$cloud.port" ] && break; sleep 0.1; done
  base="http://127.0.0.1:$(cat "$tmp/$cloud.port")"
  fetch() {  # NAME SELECTOR-BYTE-OCTAL curl-args...
    local name=$1 sel=$2
    shift 2
    { printf "\\$sel"; curl -s "$@"; } >"$corpus/preemption_notice/seed-$cloud-$name"
  }
  for when in before after; do
    [ "$when" = after ] && curl -s "$base/__control/notice" >/dev/null
    case $cloud in
      aws)
        token=$(curl -s -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' "$base/latest/api/token")
        fetch "$when" 000 -H "X-aws-ec2-metadata-token: $token" "$base/latest/meta-data/spot/instance-action" ;;
      gcp) fetch "$when" 001 -H 'Metadata-Flavor: Google' "$base/computeMetadata/v1/instance/preempted" ;;
      azure) fetch "$when" 002 -H 'Metadata: true' "$base/metadata/scheduledevents?api-version=2020-07-01" ;;
    esac
  done
done
printf '\003Wed, 25 Nov 2026 08:30:00 GMT' >"$corpus/preemption_notice/seed-time-rfc1123"
printf '\0032026-11-25T08:30:00.250Z' >"$corpus/preemption_notice/seed-time-rfc3339"

# A real run of dtactor (coordinator + 2 nodes under strace), when a normal
# build is at DTACTOR_BIN_DIR (default build/).
bin_dir=${DTACTOR_BIN_DIR:-build}
if [ -x "$bin_dir/dtactor" ] && [ -x "$bin_dir/dtactor-train" ] && command -v strace >/dev/null; then
  bash fuzz/capture_real_run.sh "$bin_dir" "$corpus"
else
  echo "make_corpus: no dtactor build at $bin_dir (or no strace): no seeds from a real run" >&2
fi

# Shard indexes as `dtactor data index` writes them (docs/data.md).
if [ -x "$bin_dir/dtactor" ]; then
  mkdir -p "$tmp/shards" "$corpus/shard_index"
  for i in 0 1 2; do head -c $((1000 * (i + 1))) /dev/urandom >"$tmp/shards/train-00$i.bin"; done
  "$bin_dir/dtactor" data index "$tmp/shards/train-*.bin" >/dev/null
  cp "$tmp/shards/dtactor-shards.json" "$corpus/shard_index/seed-three-shards"
  "$bin_dir/dtactor" data index "$tmp/shards/train-000.bin" >/dev/null
  cp "$tmp/shards/dtactor-shards.json" "$corpus/shard_index/seed-three-shards-indexed-twice"
else
  echo "make_corpus: no dtactor build at $bin_dir: no shard index seeds" >&2
fi

# S3 responses from a real radosgw, when Ceph's packages are here.
if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null; then
  bash fuzz/capture_s3_seeds.sh "$corpus/s3_xml"
else
  echo "make_corpus: no radosgw here: the S3 seeds are AWS's documented shapes only" >&2
fi

# The tabular task's CSV as its make_data.py writes it (first byte: 3 classes).
/usr/bin/python3.11 examples/custom_task/make_data.py "$tmp/csv" >/dev/null
mkdir -p "$corpus/custom_task_csv"
{ printf '\002'; head -n 40 "$tmp/csv/train.csv"; } >"$corpus/custom_task_csv/seed-spirals"

du -sh "$corpus" | sed 's/^/make_corpus: /'
for d in "$corpus"/*/; do printf 'make_corpus: %-22s %3d files %7d bytes\n' "$(basename "$d")" "$(ls "$d" | wc -l)" "$(cat "$d"/* | wc -c)"; done
