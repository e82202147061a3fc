#!/bin/bash
# Start a throwaway single-node Ceph (1 mon, 1 memstore OSD, 1 radosgw) on 127.0.0.1.
# Usage: start-rgw.sh [DATADIR]
# Env: RGW_PORT (default 17480), MON_PORT (v2, default 13300; v1 = MON_PORT+1),
#      S3_ACCESS_KEY, S3_SECRET_KEY, S3_UID, WITH_MGR=0|1 (default 0),
#      OBJECTSTORE=memstore|bluestore (default memstore), STORE_BYTES (default 1 GiB),
#      RGW_DNS_NAME (e.g. localhost: enables virtual-hosted-style bkt.localhost; path-style always works)
# Prints "export ..." lines (also written to $DIR/env.sh) on success.
# Daemons daemonize (fork); stop them with stop-rgw.sh $DIR.
# On failure: prints log tails, kills what it started, keeps $DIR for inspection, exits 1.
set -euo pipefail
T0=$(date +%s%N)
RGW_PORT=${RGW_PORT:-17480}
MON_PORT=${MON_PORT:-13300}
MON_PORT1=$((MON_PORT+1))
for port in $MON_PORT $MON_PORT1 $RGW_PORT; do
  ss -Htan "sport = :$port" | grep -q . && { echo "start-rgw: port $port already in use" >&2; exit 1; }
done
DIR=${1:-$(mktemp -d /tmp/ceph-rgw.XXXXXX)}
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
ACCESS=${S3_ACCESS_KEY:-TESTACCESSKEY0000001}
SECRET=${S3_SECRET_KEY:-testsecretkey0000000000000000000000000001}
UID_=${S3_UID:-testuser}
WITH_MGR=${WITH_MGR:-0}
OBJECTSTORE=${OBJECTSTORE:-memstore}
STORE_BYTES=${STORE_BYTES:-1073741824}
RGW_DNS_NAME=${RGW_DNS_NAME:-}
CONF=$DIR/ceph.conf
KR=$DIR/keyring
FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
mkdir -p "$DIR"/{mon.a,osd.0,mgr.x,run,log}

log() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[%d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*" >&2; }
fail() {
  log "FAILED: $*"; tail -n 20 "$DIR"/log/*.log >&2 || true
  for f in "$DIR"/run/*.pid; do [ -f "$f" ] || continue; p=$(cat "$f")
    case "$(cat /proc/$p/comm 2>/dev/null)" in ceph-mon|ceph-osd|ceph-mgr|radosgw) kill -9 "$p";; esac; done
  echo "start-rgw: failed, data/logs kept in $DIR" >&2; exit 1; }

cat > "$CONF" <<EOC
[global]
fsid = $FSID
mon_host = [v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$MON_PORT1]
public_addr = 127.0.0.1
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = $KR
run_dir = $DIR/run
admin_socket = $DIR/run/\$name.asok
pid_file = $DIR/run/\$name.pid
log_file = $DIR/log/\$name.log
mon_cluster_log_file = $DIR/log/cluster.log
chdir = ""
# single replica, no pg autoscaler, few PGs
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_pool_default_pg_autoscale_mode = off
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
mon_max_pg_per_osd = 1000
osd_crush_chooseleaf_type = 0
mon_data_avail_warn = 1
auth_allow_insecure_global_id_reclaim = false
mon_data_avail_crit = 0
osd_objectstore = $OBJECTSTORE
memstore_device_bytes = $STORE_BYTES
bluestore_block_path = $DIR/osd.\$id.block
bluestore_block_size = $STORE_BYTES
bluestore_block_create = true
bluestore_fsck_on_mkfs = false
bluestore_cache_size = 67108864
# speed: every osdmap change (pool create, app enable, osd boot) otherwise waits ~1 s
paxos_propose_interval = 0.01
paxos_min_wait = 0.001
ms_bind_port_min = $((MON_PORT+10))
ms_bind_port_max = $((MON_PORT+99))
[mon]
mon_data = $DIR/mon.\$id
mon_allow_pool_delete = true
[osd]
osd_data = $DIR/osd.\$id
[mgr]
mgr_data = $DIR/mgr.\$id
[client]
admin_socket = $DIR/run/\$name.\$pid.asok
log_file = $DIR/log/\$name.log
[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw_data = $DIR/rgw.a
rgw_enable_usage_log = false
rgw_thread_pool_size = 16
rgw_dns_name = $RGW_DNS_NAME
EOC

# All keys generated up front and imported into the mon at mkfs time, so no runtime "auth add".
ceph-authtool --create-keyring "$KR" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$KR" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
ceph-authtool "$KR" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap mgr 'allow profile osd' --cap osd 'allow *' >/dev/null
ceph-authtool "$KR" --gen-key -n client.rgw.a --cap mon 'allow rw' --cap osd 'allow rwx' --cap mgr 'allow rw' >/dev/null
ceph-authtool "$KR" --gen-key -n mgr.x --cap mon 'allow profile mgr' --cap osd 'allow *' --cap mds 'allow *' >/dev/null

monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$MON_PORT1]" "$DIR/monmap" >/dev/null
ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$KR" || fail "mon mkfs"
ceph-mon -c "$CONF" -i a || fail "mon start"
log "mon started"

C="ceph -c $CONF --connect-timeout 20"
$C osd new "$OSD_UUID" 0 >/dev/null 2>&1 || fail "osd new"
log "osd.0 allocated"
# no 'osd crush add': osd_crush_update_on_start (default true) puts osd.0 under host=$(hostname) root=default on boot
ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$OSD_UUID" >/dev/null 2>&1 || fail "osd mkfs"
log "osd mkfs done"
ceph-osd -c "$CONF" -i 0 2>/dev/null || fail "osd start"
log "osd started"
if [ "$WITH_MGR" = 1 ]; then ceph-mgr -c "$CONF" -i x || fail "mgr start"; log "mgr started"; fi
# no wait for osd up here: radosgw blocks on its rados ops until the OSD is up and PGs are active
radosgw -c "$CONF" -n client.rgw.a || fail "radosgw start"
log "radosgw started"
for i in $(seq 1 600); do
  curl -s -o /dev/null "http://127.0.0.1:$RGW_PORT/" && break
  p=$(cat "$DIR/run/client.rgw.a.pid" 2>/dev/null || true)
  [ -n "$p" ] && ! [ -d /proc/$p ] && fail "radosgw exited"
  sleep 0.1
done
curl -s -o /dev/null "http://127.0.0.1:$RGW_PORT/" || fail "rgw not answering"
log "rgw answers HTTP"

radosgw-admin -c "$CONF" -n client.admin user create --uid "$UID_" --display-name "$UID_" \
   --access-key "$ACCESS" --secret-key "$SECRET" >"$DIR/user.json" 2>"$DIR/log/radosgw-admin.err" || fail "user create"
log "user created; READY"

cat > "$DIR/env.sh" <<EOE
export CEPH_RGW_DIR=$DIR
export S3_ENDPOINT=http://127.0.0.1:$RGW_PORT
export AWS_ACCESS_KEY_ID=$ACCESS
export AWS_SECRET_ACCESS_KEY=$SECRET
export AWS_DEFAULT_REGION=us-east-1
export CEPH_CONF=$CONF
EOE
cat "$DIR/env.sh"
