# Sourced by the shell tests (cli_test.sh, custom_task_test.sh,
# tune_batch_test.sh): a scratch directory removed on exit ($work), and
# ok/bad lines counted into a summary; `finish` prints it and exits 1 when
# anything failed.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pass=0
failed=0
ok() { pass=$((pass + 1)); echo "ok - $1"; }
bad() { failed=$((failed + 1)); echo "not ok - $1"; }
finish() {
  echo "$pass passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit $?
}
