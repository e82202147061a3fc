#!/usr/bin/env bash
# A real one-machine Slurm cluster for the tests: munged, slurmctld and two
# slurmd (NodeName n1 and n2, distinct ports, %n in their spool, pid and log
# paths), all under one state directory, nothing system-wide touched. Debian
# bookworm's slurm-wlm 22.05 (slurmctld, slurmd, slurm-client) and munge.
#
#   scripts/slurm/start-slurm.sh [STATE_DIR]    (default /tmp/dtactor-slurm)
#   export SLURM_CONF=STATE_DIR/slurm.conf      (what it prints last)
#
# Exit 0 with both nodes idle; exit 77 with one line saying why where Slurm
# cannot start here (packages missing, not root); 1 on a real failure.
set -euo pipefail
DIR=${1:-/tmp/dtactor-slurm}
skip() { echo "slurm: skipped: $*" >&2; exit 77; }
for b in munged slurmctld slurmd sbatch scontrol; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || skip "no $b (apt-get install slurmctld slurmd slurm-client munge)"
done
[ "$(id -u)" = 0 ] || skip "slurmd runs jobs as their users and needs root"
PATH=/usr/sbin:$PATH

if [ -f "$DIR/slurm.conf" ] && SLURM_CONF=$DIR/slurm.conf timeout 5 scontrol ping >/dev/null 2>&1; then
  echo "slurm: already running; export SLURM_CONF=$DIR/slurm.conf"
  exit 0
fi
"$(dirname "$0")/stop-slurm.sh" "$DIR" >/dev/null 2>&1 || true
mkdir -p "$DIR/munge" "$DIR/ctld"
chmod 700 "$DIR/munge"

# Three consecutive free ports below the ephemeral range (a port the kernel
# picks as free can be given to another process's connection before the
# daemon binds it).
BASE_PORT=$(/usr/bin/python3 "$(dirname "$0")/../../tests/free_port.py" --block 3)
CTLD_PORT=$BASE_PORT; N1_PORT=$((BASE_PORT + 1)); N2_PORT=$((BASE_PORT + 2))

# munge: a key of our own, a socket of our own.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge/munge.key"
munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
  --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
  || { echo "slurm: munged did not start: $(tail -1 "$DIR/munge/munged.log" 2>/dev/null)" >&2; exit 1; }

CPUS=$(nproc)
cat >"$DIR/slurm.conf" <<CONF
ClusterName=dtactor
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# No cgroups in a container: track processes by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
# Short for tests: SIGKILL 10 s after SIGTERM; a requeued job may start again at once.
KillWait=10
MinJobAge=300
SchedulerParameters=nohold_on_prolog_fail
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$N1_PORT CPUs=$CPUS RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$N2_PORT CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$DIR/slurm.conf

slurmctld -f "$SLURM_CONF" -i || { echo "slurm: slurmctld did not start: $(tail -1 "$DIR/slurmctld.log" 2>/dev/null)" >&2; exit 1; }
for n in n1 n2; do
  slurmd -f "$SLURM_CONF" -N "$n" || { echo "slurm: slurmd $n did not start: $(tail -1 "$DIR/slurmd-$n.log" 2>/dev/null)" >&2; exit 1; }
done

# Both nodes idle (bounded: 60 s).
for _ in $(seq 600); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^idle/ {n++} END {print n+0}')
  [ "$idle" = 2 ] && { echo "slurm: running (n1, n2); export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.1
done
echo "slurm: nodes not idle after 60 s: $(sinfo -h -N -o '%N %t %E' 2>&1 | tr '\n' ';') (logs in $DIR)" >&2
exit 1
