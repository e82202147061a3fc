#!/usr/bin/env bash
# dtactor under a real Slurm (scripts/slurm/start-slurm.sh: slurmctld and two
# slurmd, n1 and n2, on this machine), with the batch scripts users copy
# (examples/slurm/). One case per run:
#   train            a 2-node sbatch job (train.sbatch) trains to the end
#   leave_rejoin     the elastic shape (a coordinator outside Slurm, nodes as a
#                    --requeue job array): `scontrol requeue` of one array
#                    task (SIGTERM to it, as a preemption with
#                    PreemptMode=REQUEUE) -> it leaves at a step boundary,
#                    0 steps lost, the other goes on; the requeued task rejoins
#   scancel_resume   scancel of a whole train.sbatch job -> a final checkpoint
#                    and job_stopped; a resubmission resumes from it
#   standby_takeover the coordinator and its standby (coordinator.sbatch, the
#                    lease in the run directory) and nodes given both
#                    addresses (nodes.sbatch): kill -9 of the leading
#                    coordinator's process (its step ends) -> the standby
#                    leads, no step lost or trained twice, the job
#                    finishes, both jobs COMPLETED
# Usage: slurm_test.sh BUILD_DIR SOURCE_DIR CASE. Exit 77 (skipped, one line)
# where Slurm cannot start. Waits poll the journal or Slurm, bounded.
set -euo pipefail
BUILD=$(cd "$1" && pwd); SRC=$(cd "$2" && pwd); CASE=$3
DTACTOR=$BUILD/dtactor
TMP=$(mktemp -d /tmp/dtactor-slurm-test-XXXXXX)
COORD_PID=""
cleanup() {
  [ -n "$COORD_PID" ] && kill -9 "$COORD_PID" 2>/dev/null || true
  if [ -n "${SLURM_CONF:-}" ]; then scancel -u "$(id -un)" 2>/dev/null || true; fi
  "$SRC/scripts/slurm/stop-slurm.sh" "$TMP/slurm" >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT
# A command that ends the script through set -e says where (else its exit is silent).
trap 'echo "FAIL ($CASE): line $LINENO: a command exited $?" >&2' ERR
rc=0; "$SRC/scripts/slurm/start-slurm.sh" "$TMP/slurm" >"$TMP/start.log" 2>&1 || rc=$?
if [ $rc = 77 ]; then cat "$TMP/start.log" >&2; exit 77; fi
if [ $rc != 0 ]; then echo "FAIL: Slurm did not start:"; cat "$TMP/start.log"; exit 1; fi
export SLURM_CONF=$TMP/slurm/slurm.conf
RUN=$TMP/run
mkdir -p "$RUN"
# On stderr: a fail inside $(...) (wait_job_end's) is seen, not captured.
fail() {
  {
    echo "FAIL ($CASE): $*"
    for f in "$TMP"/*.out "$RUN"/*.log; do [ -f "$f" ] && { echo "---- $f"; tail -30 "$f"; }; done
    [ -f "$RUN/journal.jsonl" ] && { echo "---- journal (tail)"; tail -15 "$RUN/journal.jsonl"; }
    echo "---- Slurm's jobs and steps"; squeue -h -a -o '%i %j %T %M' 2>&1 || true; squeue -h -s -o '%i %j %M' 2>&1 || true
    echo "---- processes"; ps -eo pid,ppid,stat,etime,wchan:24,args 2>&1 | grep -E 'dtactor|srun|slurmstepd' | grep -v grep || true
  } >&2
  exit 1
}
# A tiny job (as the chaos tests pick): a step takes milliseconds.
SETS=(--set model.dim=16 --set model.layers=1 --set model.heads=2 --set model.mlp_ratio=2 --set train.global_batch_size=32
      --set train.warmup_steps=5 --set train.lr=0.003 --set eval.max_samples=500 --set eval.every_steps=0 --set train.log_every_steps=1
      --set checkpoint.every_steps=20)
# journal QUERY: a Python expression over `ev` (the list of events) printed;
# whole lines only: the last may be half written while it is read.
journal() { /usr/bin/python3.11 -c "
import json,sys
ev=[json.loads(l) for l in open('$RUN/journal.jsonl') if l.endswith('\n') and l.strip()] if __import__('os').path.exists('$RUN/journal.jsonl') else []
named=lambda n:[e for e in ev if e.get('event')==n]
print($1)"; }
# wait_for SECONDS PYTHON_CONDITION: polls the journal every 0.2 s.
wait_for() {
  local limit=$1 cond=$2 i
  for ((i = 0; i < limit * 5; i++)); do
    [ "$(journal "bool($cond)")" = True ] && return 0
    sleep 0.2
  done
  fail "timed out after $limit s waiting for: $cond"
}
job_state() { scontrol show job "$1" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p' | head -1; }
wait_job_end() {
  local i s
  for ((i = 0; i < $2 * 5; i++)); do
    s=$(job_state "$1")
    case "$s" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|PREEMPTED|OUT_OF_MEMORY) echo "$s"; return 0;; esac
    sleep 0.2
  done
  fail "job $1 still ${s:-unknown} after $2 s"
}
last_step() { journal "max([e['step'] for e in named('step')] or [0])"; }

case "$CASE" in
train)
  j=$(cd "$TMP" && sbatch --parsable --nodes=2 -o "$TMP/train-%j.out" --export=ALL,DTACTOR="$DTACTOR",CONFIG=,RUN_DIR="$RUN" \
        "$SRC/examples/slurm/train.sbatch" "${SETS[@]}" --set train.max_steps=60)
  st=$(wait_job_end "$j" 240)
  [ "$st" = COMPLETED ] || fail "job $j ended $st"
  [ "$(journal "len(named('job_finished'))")" = 1 ] || fail "no job_finished"
  [ "$(journal "named('job_finished')[0]['step']")" = 60 ] || fail "did not train to step 60"
  [ "$(journal "named('job_finished')[0]['world_size']")" = 2 ] || fail "not 2 nodes to the end"
  [ "$(journal "sorted(e['node'] for e in named('node_joined'))")" = "['n1', 'n2']" ] || fail "node ids are not the Slurm node names"
  echo "PASS train: job $j, 2 nodes (n1, n2), 60 steps"
  ;;
leave_rejoin)
  PORT=$(/usr/bin/python3 "$SRC/tests/free_port.py")
  "$DTACTOR" --role coordinator --listen "tcp://127.0.0.1:$PORT" --run-dir "$RUN" "${SETS[@]}" --set train.max_steps=1000000 \
    --set cluster.min_nodes=2 --set cluster.floor_nodes=1 >"$RUN/coordinator.log" 2>&1 &
  COORD_PID=$!
  j=$(cd "$TMP" && sbatch --parsable --array=0-1 -o "$TMP/nodes-%A_%a.out" \
        --export=ALL,DTACTOR="$DTACTOR",COORDINATOR="tcp://127.0.0.1:$PORT" "$SRC/examples/slurm/nodes.sbatch" --advertise-addr 127.0.0.1 --threads-per-rank 1)
  wait_for 120 "[e for e in named('step') if e['step'] >= 5]"
  t0=$(date +%s.%N)
  host=$(squeue -h -j "${j}_1" -o %N)
  scontrol requeue "${j}_1"
  wait_for 60 "named('node_left')"
  wait_for 60 "[e for e in named('recovery_done') if e['cause'] == 'node_left']"
  left=$(journal "named('node_left')[0]['node']")
  [ "$left" = "${j}-1" ] || fail "node_left names '$left', not ${j}-1"
  [ "$(journal "[e['lost_steps'] for e in named('recovery_done') if e['cause']=='node_left'][0]")" = 0 ] || fail "steps lost on the leave"
  [ "$(journal "len(named('node_lost'))")" = 0 ] || fail "a node was lost, not left"
  t1=$(date +%s.%N)
  # Requeued: pending until its begin time; start it now rather than wait Slurm's delay,
  # on another node: the slurmd it ran on refuses a launch of the job it has just
  # killed ("Job N already killed, do not launch batch job"; the task then fails)
  # until its cleanup is through.
  for ((i = 0; i < 100; i++)); do [ "$(job_state "${j}_1")" = PENDING ] && break; sleep 0.2; done
  scontrol update JobId="${j}_1" ExcNodeList="$host" StartTime=now >/dev/null 2>&1 || true
  wait_for 120 "len([e for e in named('node_joined') if e['node'] == '${j}-1']) >= 2"
  wait_for 120 "[e for e in named('recovery_done') if e['cause'] in ('node_joined', 'rank_ready') and e['world_size'] == 2]"
  t2=$(date +%s.%N)
  rc_count=$(scontrol show job "${j}_1" -o | tr ' ' '\n' | sed -n 's/^Restarts=//p')
  [ "${rc_count:-0}" -ge 1 ] || fail "Slurm did not count the requeue (Restarts=$rc_count)"
  kill -TERM "$COORD_PID"
  wait "$COORD_PID" || true
  COORD_PID=""
  [ "$(journal "len(named('job_stopped'))")" = 1 ] || fail "the job did not stop cleanly"
  /usr/bin/python3.11 -c "print('PASS leave_rejoin: requeue -> world 1 in %.2f s, 0 steps lost; requeued task contributing again %.2f s later (incl. Slurm start)' % ($t1 - $t0, $t2 - $t1))"
  ;;
scancel_resume)
  j=$(cd "$TMP" && sbatch --parsable --nodes=2 -o "$TMP/train-%j.out" --export=ALL,DTACTOR="$DTACTOR",CONFIG=,RUN_DIR="$RUN" \
        "$SRC/examples/slurm/train.sbatch" "${SETS[@]}" --set train.max_steps=1000000)
  wait_for 120 "[e for e in named('checkpoint_saved') if e['step'] >= 20]"
  scancel "$j"
  st=$(wait_job_end "$j" 60)
  wait_for 10 "named('job_stopped')"
  stopped=$(journal "named('job_stopped')[0]['step']")
  newest=$(journal "max(e['step'] for e in named('checkpoint_saved'))")
  [ "$newest" = "$stopped" ] || fail "no final checkpoint: stopped at $stopped, newest checkpoint $newest"
  target=$((stopped + 20))
  j2=$(cd "$TMP" && sbatch --parsable --nodes=2 -o "$TMP/train-%j.out" --export=ALL,DTACTOR="$DTACTOR",CONFIG=,RUN_DIR="$RUN" \
        "$SRC/examples/slurm/train.sbatch" "${SETS[@]}" --set train.max_steps=$target)
  st2=$(wait_job_end "$j2" 240)
  [ "$st2" = COMPLETED ] || fail "resubmitted job $j2 ended $st2"
  [ "$(journal "named('checkpoint_found')[-1]['step'] if named('checkpoint_found') else -1")" = "$stopped" ] || fail "the resubmission did not resume from step $stopped"
  [ "$(journal "named('job_finished')[-1]['step']")" = "$target" ] || fail "the resubmission did not train to $target"
  echo "PASS scancel_resume: job $j ($st) stopped at step $stopped with its final checkpoint; job $j2 resumed there and finished at $target"
  ;;
standby_takeover)
  # coordinator.sbatch: a coordinator and its standby (two steps of one job,
  # the lease in the run directory), each on a port of its own (both Slurm
  # nodes are this machine); nodes.sbatch given both addresses. The lease's
  # TTL is 3 s: at 1 s, a stall of the machine under the suite's load once
  # made the standby, leading alone after the kill, miss its own renewal and
  # stop deciding, which ended the job.
  free_port() { /usr/bin/python3 "$SRC/tests/free_port.py"; }
  P0=$(free_port); P1=$(free_port)
  jc=$(cd "$TMP" && sbatch --parsable -o "$TMP/coordinator-%j.out" \
         --export=ALL,DTACTOR="$DTACTOR",CONFIG=,RUN_DIR="$RUN",PORT="$P0",STANDBY_PORT="$P1" "$SRC/examples/slurm/coordinator.sbatch" \
         "${SETS[@]}" --set train.max_steps=4000 --set cluster.min_nodes=2 --set cluster.floor_nodes=1 --lease-ttl-ms 3000)
  jn=$(cd "$TMP" && COORDINATOR="tcp://127.0.0.1:$P0,tcp://127.0.0.1:$P1" DTACTOR="$DTACTOR" \
         sbatch --parsable --array=0-1 -o "$TMP/nodes-%A_%a.out" "$SRC/examples/slurm/nodes.sbatch" --advertise-addr 127.0.0.1 --threads-per-rank 1)
  wait_for 120 "[e for e in named('step') if e['step'] >= 5 and e['world_size'] == 2]"
  # The leader: the coordinator that started the run; its step by name.
  lead_port=$(journal "named('coordinator_started')[0]['listen'].rsplit(':', 1)[1]")
  if [ "$lead_port" = "$P0" ]; then lead=coordinator-0; else lead=coordinator-1; fi
  [ "$lead_port" = "$P0" ] || [ "$lead_port" = "$P1" ] || fail "the first coordinator listens on $lead_port, neither $P0 nor $P1"
  step_id=$(squeue -h -s -j "$jc" -o '%i %j' | awk -v n="$lead" '$2 == n {print $1}')
  [ -n "$step_id" ] || fail "no step named $lead in job $jc: $(squeue -h -s -j "$jc" -o '%i %j' | tr '\n' ';')"
  # The leader's process: the coordinator listening on its port (both Slurm
  # nodes are this machine). kill -9 of it, as a crash: not through
  # scancel --signal=KILL, whose RPC slurmctld under the suite's load has
  # answered "Kill job error ... No error" (the signal then sent or not).
  # (srun's command line names it too: the process whose own name is dtactor.)
  lead_pid=""
  for p in $(pgrep -f -- "--role coordinator --listen tcp://0.0.0.0:$lead_port "); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = dtactor ] && lead_pid=$p
  done
  [ -n "$lead_pid" ] || fail "no coordinator process listens on port $lead_port"
  at=$(last_step)
  t0=$(date +%s.%N)
  kill -9 "$lead_pid"
  # Slurm sees its step end; the standby's step runs on.
  for ((i = 0; i < 150; i++)); do
    squeue -h -s -j "$jc" -o %i | grep -qx "$step_id" || break
    sleep 0.2
  done
  squeue -h -s -j "$jc" -o %i | grep -qx "$step_id" && fail "Slurm still lists step $step_id 30 s after kill -9 of its task $lead_pid"
  [ -n "$(squeue -h -s -j "$jc" -o '%i %j' | awk -v n="$lead" '$2 ~ /^coordinator-/ && $2 != n')" ] \
    || fail "the standby's step ended with the leader's: $(squeue -h -s -j "$jc" -o '%i %j' | tr '\n' ';')"
  wait_for 60 "len(named('coordinator_started')) == 2"
  t1=$(date +%s.%N)
  [ "$(journal "len(named('coordinator_started'))")" = 2 ] || fail "not one takeover: $(journal "[e['listen'] for e in named('coordinator_started')]")"
  [ "$(journal "named('coordinator_started')[1]['listen'].rsplit(':', 1)[1]")" != "$lead_port" ] || fail "the same coordinator started twice"
  wait_for 300 "named('job_finished')"
  [ "$(journal "named('job_finished')[0]['step']")" = 4000 ] || fail "did not train to step 4000"
  [ "$(journal "len(named('node_left'))")" = 0 ] || fail "a node left over the takeover"
  # No step trained twice (a rollback) and none lost; steps the ranks took
  # while no coordinator listened are not journaled (their reports had
  # nowhere to go).
  [ "$(journal "len(named('step')) == len(set(e['step'] for e in named('step')))")" = True ] || fail "steps journaled twice (trained again)"
  [ "$(journal "[e['lost_steps'] for e in named('recovery_done') if e['lost_steps']]")" = "[]" ] || fail "steps lost"
  how=$(journal "'adopted the running generation' if named('generation_adopted') else 'planned a new generation (a node registered late)'")
  st=$(wait_job_end "$jc" 60)
  [ "$st" = COMPLETED ] || fail "coordinator job $jc ended $st (its batch script exits 0 when the coordinator that led to the end did)"
  for t in 0 1; do
    s=$(wait_job_end "${jn}_$t" 60)
    [ "$s" = COMPLETED ] || fail "node task ${jn}_$t ended $s"
  done
  grep -q "holds the job's lease at $RUN/lease, epoch 2" "$TMP"/coordinator-"$jc".out || fail "the standby did not say it holds the lease at epoch 2"
  /usr/bin/python3.11 -c "print('PASS standby_takeover: kill -9 of $lead (step $step_id) at step $at; the standby led %.2f s later ($how); no step trained twice or lost, step 4000 reached; both Slurm jobs COMPLETED' % ($t1 - $t0))"
  ;;
*) echo "unknown case '$CASE' (train, leave_rejoin, scancel_resume, standby_takeover)"; exit 2;;
esac
