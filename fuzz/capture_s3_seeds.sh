#!/usr/bin/env bash
# Seeds of fuzz_s3_xml as a real S3 server writes them: Ceph's radosgw on a
# throwaway one-machine cluster (scripts/rgw/start-rgw.sh, the server the S3
# tests use), asked with curl's SigV4 the questions dtactor's store asks:
# ListObjectsV2 (truncated, with a continuation token, and its last page),
# InitiateMultipartUpload, ListMultipartUploads, and errors (NoSuchKey,
# NoSuchBucket, SignatureDoesNotMatch). Each file starts with the target's
# selector byte. Usage: fuzz/capture_s3_seeds.sh OUT_DIR (make_corpus.sh
# runs it when Ceph's packages are installed).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
mkdir -p "$out"
dir=$(mktemp -d /tmp/dtactor-fuzz-rgw.XXXXXX)
trap 'bash scripts/rgw/stop-rgw.sh "$dir" >/dev/null 2>&1 || true; rm -rf "$dir" "$dir.log"' EXIT
RGW_PORT=${RGW_PORT:-27480} MON_PORT=${MON_PORT:-23300} bash scripts/rgw/start-rgw.sh "$dir" >/dev/null 2>"$dir.log" || { cat "$dir.log" >&2; exit 1; }
. "$dir/env.sh"
empty=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  # sha256("")
# curl signs the query string as written: parameters in sorted order, each
# with its '='.
s3() {  # SECRET curl-args...: a signed request without a body
  local secret=$1
  shift
  curl -s --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$secret" -H "x-amz-content-sha256: $empty" "$@"
}
put() {  # KEY: an object holding a few bytes
  local body="bytes of $1"
  curl -s -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
    -H "x-amz-content-sha256: $(printf '%s' "$body" | sha256sum | cut -d' ' -f1)" -X PUT --data-binary "$body" "$S3_ENDPOINT/dtactor/$1"
}
seed() {  # NAME SELECTOR-OCTAL: the body on stdin
  { printf "\\$2"; cat; } >"$out/seed-rgw-$1"
}
s3 "$AWS_SECRET_ACCESS_KEY" -X PUT -o /dev/null "$S3_ENDPOINT/dtactor"
for k in ckpt/run-1/ckpt-000000500.manifest ckpt/run-1/ckpt-000000500.g2.r0-of-2.part ckpt/run-1/ckpt-000000500.g2.r1-of-2.part \
         ckpt/run-1/sub/other other-job/ckpt-000000100.manifest; do
  put "$k"
done
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor?list-type=2&max-keys=2&prefix=ckpt%2Frun-1%2F" >"$dir/page1"
seed list-objects-v2-page1 020 <"$dir/page1"
token=$(sed -n 's|.*<NextContinuationToken>\(.*\)</NextContinuationToken>.*|\1|p' "$dir/page1" | jq -sRr 'rtrimstr("\n") | @uri')
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor?continuation-token=$token&list-type=2&max-keys=2&prefix=ckpt%2Frun-1%2F" | seed list-objects-v2-page2 020
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor?list-type=2" | seed list-objects-v2-bucket 000
s3 "$AWS_SECRET_ACCESS_KEY" -X POST "$S3_ENDPOINT/dtactor/ckpt/run-1/ckpt-000000600.g3.r1-of-2.part?uploads=" | seed initiate-multipart 002
s3 "$AWS_SECRET_ACCESS_KEY" -X POST -o /dev/null "$S3_ENDPOINT/dtactor/other-job/ckpt-000000200.g1.r0-of-1.part?uploads="
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor?prefix=ckpt%2Frun-1%2F&uploads=" | seed list-multipart-uploads 023
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor?uploads=" | seed list-multipart-uploads-bucket 003
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/dtactor/ckpt/run-1/no-such-object" | seed error-no-such-key 001
s3 "$AWS_SECRET_ACCESS_KEY" "$S3_ENDPOINT/no-such-bucket?list-type=2" | seed error-no-such-bucket 001
s3 wrong-secret "$S3_ENDPOINT/dtactor?list-type=2" | seed error-signature 001
