#!/usr/bin/env bash
# Stops what start-slurm.sh started (by the pid files under STATE_DIR) and
# removes the state directory.
#   scripts/slurm/stop-slurm.sh [STATE_DIR]   (default /tmp/dtactor-slurm)
set -uo pipefail
DIR=${1:-/tmp/dtactor-slurm}
[ -d "$DIR" ] || exit 0
for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
done
rm -rf "$DIR"
echo "slurm: stopped"
