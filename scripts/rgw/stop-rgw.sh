#!/bin/bash
# Usage: stop-rgw.sh DATADIR
# Stops the daemons started by start-rgw.sh (pid files in DATADIR/run) and removes DATADIR.
# Order matters (each step waits for the previous daemons to exit):
#   radosgw first (killed together with the OSD it hangs >3 s on shutdown: it unwatches
#   its control objects on the OSD), then mgr+osd while the mon is still up (an OSD whose
#   mon is gone waits osd_mon_shutdown_timeout = 5 s), then the mon.
DIR=${1:?usage: stop-rgw.sh DATADIR}
[ -d "$DIR/run" ] || { echo "stop-rgw: no $DIR/run" >&2; exit 1; }
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [ -n "$s" ] && [ "${s:0:1}" != Z ]; }
stop_group() {   # pidfile-names...
  local pids=() n p i any
  for n in "$@"; do
    [ -f "$DIR/run/$n.pid" ] || continue
    p=$(cat "$DIR/run/$n.pid"); [ -n "$p" ] || continue
    case "$(cat /proc/$p/comm 2>/dev/null)" in     # never kill a recycled pid
      ceph-mon|ceph-osd|ceph-mgr|radosgw) kill -TERM "$p" 2>/dev/null && pids+=("$p") ;;
    esac
  done
  for i in $(seq 1 60); do
    any=0; for p in "${pids[@]}"; do alive "$p" && any=1; done
    [ $any = 0 ] && return; sleep 0.05
  done
  for p in "${pids[@]}"; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
  return 0
}
stop_group client.rgw.a
stop_group mgr.x osd.0
stop_group mon.a
rm -rf "$DIR"
