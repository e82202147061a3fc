#!/bin/bash
# Usage: test-s3.sh DATADIR  -- SigV4 smoke test against the rgw started by start-rgw.sh
set -u
. "$1/env.sh"
S="aws:amz:us-east-1:s3"; U="$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY"
E=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855   # sha256("")
B=bkt-$RANDOM; rc=0
tmp=$(mktemp); echo "hello ceph $RANDOM" > "$tmp"; SHA=$(sha256sum "$tmp" | cut -d' ' -f1)
req() { # expected_code description curl-args...
  local want=$1 d=$2; shift 2
  local out code; out=$(curl -s -w '\n%{http_code}' --aws-sigv4 "$S" "$@"); code=${out##*$'\n'}; body=${out%$'\n'*}
  if [ "$code" = "$want" ]; then echo "ok   $code $d"; else echo "FAIL $code (want $want) $d: $body"; rc=1; fi
}
req 200 "PUT bucket"            --user "$U" -H "x-amz-content-sha256: $E" -X PUT "$S3_ENDPOINT/$B"
req 200 "PUT object"            --user "$U" -H "x-amz-content-sha256: $SHA" -T "$tmp" "$S3_ENDPOINT/$B/dir/obj.txt"
req 200 "GET object"            --user "$U" -H "x-amz-content-sha256: $E" -o /dev/null "$S3_ENDPOINT/$B/dir/obj.txt"
got=$(curl -s --aws-sigv4 "$S" --user "$U" -H "x-amz-content-sha256: $E" "$S3_ENDPOINT/$B/dir/obj.txt")
[ "$got" = "$(cat "$tmp")" ] && echo "ok       GET body matches" || { echo "FAIL GET body '$got'"; rc=1; }
req 200 "LIST v2 (sorted, pre-encoded query)" --user "$U" -H "x-amz-content-sha256: $E" -o /dev/null "$S3_ENDPOINT/$B?list-type=2&prefix=dir%2F"
req 403 "GET wrong secret"      --user "$AWS_ACCESS_KEY_ID:wrong" -H "x-amz-content-sha256: $E" "$S3_ENDPOINT/$B/dir/obj.txt"
body403=$(curl -s --aws-sigv4 "$S" --user "$AWS_ACCESS_KEY_ID:wrong" -H "x-amz-content-sha256: $E" "$S3_ENDPOINT/$B/dir/obj.txt")
echo "$body403" | grep -q '<Code>SignatureDoesNotMatch</Code>' && echo "ok       wrong secret -> SignatureDoesNotMatch" || { echo "FAIL body: $body403"; rc=1; }
req 403 "PUT wrong secret"      --user "$AWS_ACCESS_KEY_ID:wrong" -H "x-amz-content-sha256: $SHA" -T "$tmp" "$S3_ENDPOINT/$B/x.txt"
req 403 "unknown access key"    --user "NOSUCHKEY:x" -H "x-amz-content-sha256: $E" "$S3_ENDPOINT/$B/dir/obj.txt"
req 400 "payload hash mismatch" --user "$U" -H "x-amz-content-sha256: $E" -T "$tmp" "$S3_ENDPOINT/$B/y.txt"
req 204 "DELETE object"         --user "$U" -H "x-amz-content-sha256: $E" -X DELETE "$S3_ENDPOINT/$B/dir/obj.txt"
req 204 "DELETE bucket"         --user "$U" -H "x-amz-content-sha256: $E" -X DELETE "$S3_ENDPOINT/$B"
rm -f "$tmp"; exit $rc
