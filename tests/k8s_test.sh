#!/usr/bin/env bash
# deploy/kubernetes checked without a cluster (docs/kubernetes.md). One case per run:
#   validate  every manifest and every kustomization rendered, against the
#             Kubernetes API schemas (tests/k8s/validate.mjs: npm
#             kubernetes-models, @kubernetes-models/prometheus-operator); then
#             copies broken on purpose (a wrong field type, a wrong type in the
#             PodMonitor, an undefined $(VAR), a node given a coordinator pod
#             the StatefulSet does not have) must be refused, naming the field
#   pods      the shared-volume variant's pods as local processes with the exact
#             command, args and env of the manifests (tests/k8s/pods.mjs: pod
#             names, the pod IP, the coordinator Service -> 127.0.0.1, ports,
#             volumes as directories): a coordinator and two nodes train; SIGTERM
#             to one node's process (what deleting its pod does) -> it leaves at
#             a step boundary within its terminationGracePeriodSeconds, exit 143,
#             0 steps lost, the job goes on; a replacement pod joins; kill -9 of
#             the leading coordinator pod's process -> its standby (the
#             StatefulSet's second pod, the lease on the claim) leads, no
#             step lost or trained twice, world 2 again; the pod made again stands
#             by; SIGTERM to the leader -> a final checkpoint on the shared
#             volume, job_stopped
# Usage: k8s_test.sh BUILD_DIR SOURCE_DIR CASE. Exit 77 (skipped, one line)
# without node or tests/k8s/node_modules (scripts/install-deps.sh runs npm ci).
set -euo pipefail
BUILD=$(cd "$1" && pwd); SRC=$(cd "$2" && pwd); CASE=$3
K8S=$SRC/tests/k8s
if ! command -v node >/dev/null; then echo "node (Node.js) missing: k8s tests skipped (scripts/install-deps.sh installs it)"; exit 77; fi
for m in kubernetes-models @kubernetes-models/prometheus-operator js-yaml; do
  if [ ! -d "$K8S/node_modules/$m" ]; then echo "tests/k8s/node_modules/$m missing: k8s tests skipped (run: cd tests/k8s && npm ci; scripts/install-deps.sh does)"; exit 77; fi
done
TMP=$(mktemp -d /tmp/dtactor-k8s-test-XXXXXX)
PGIDS=()
cleanup() {
  local g
  for g in "${PGIDS[@]}"; do kill -9 -- "-$g" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL ($CASE): $*"
  for f in "$TMP"/logs/*.log; do [ -f "$f" ] && { echo "---- $f"; tail -25 "$f"; }; done
  [ -n "${JOURNAL:-}" ] && [ -f "$JOURNAL" ] && { echo "---- journal (tail)"; tail -15 "$JOURNAL"; }
  exit 1
}

case "$CASE" in
validate)
  out=$(node "$K8S/validate.mjs" "$SRC/deploy/kubernetes" 2>&1) || fail "the manifests do not validate:"$'\n'"$out"
  echo "$out"
  # Broken copies must be refused, naming what is wrong (no kubectl comparison: faster).
  export DTACTOR_K8S_COMPARE_KUBECTL=0
  refused() {  # NAME FILE SED_EXPR EXPECTED_TEXT
    local d=$TMP/$1 out rc=0
    cp -r "$SRC/deploy/kubernetes" "$d"
    sed -i "$3" "$d/$2"
    cmp -s "$d/$2" "$SRC/deploy/kubernetes/$2" && fail "$1: the edit '$3' changed nothing in $2"
    out=$(node "$K8S/validate.mjs" "$d" 2>&1) || rc=$?
    [ $rc = 1 ] || fail "$1: a broken copy was not refused (exit $rc): $out"
    grep -qF -- "$4" <<<"$out" || fail "$1: the refusal does not say '$4':"$'\n'"$out"
    echo "refused as it should ($1): $(grep -F -- "$4" <<<"$out" | head -1)"
  }
  refused wrong_type base/nodes.yaml 's/terminationGracePeriodSeconds: 25$/terminationGracePeriodSeconds: "25s"/' \
    "Deployment/dtactor-nodes: data/spec/template/spec/terminationGracePeriodSeconds must be integer"
  refused podmonitor_type monitoring/podmonitor.yaml 's/honorLabels: true/honorLabels: "yes"/' \
    "PodMonitor/dtactor: data/spec/podMetricsEndpoints/0/honorLabels must be boolean"
  refused undefined_var base/nodes.yaml 's/- \$(POD_IP)$/- $(POD_ADDR)/' "refers to \$(POD_ADDR), which is not in its env"
  refused missing_standby shared-volume/kustomization.yaml 's/^        value: 2$/        value: 1/' \
    "names pod dtactor-coordinator-1, but StatefulSet dtactor-coordinator has 1 replica(s)"
  refused unknown_field base/coordinator.yaml 's/terminationGracePeriodSeconds: 120/terminationGracePeriodSecond: 120/' \
    "StatefulSet/dtactor-coordinator: unknown field spec.template.spec.terminationGracePeriodSecond"
  echo "PASS validate"
  ;;
pods)
  DTACTOR=$BUILD/dtactor
  [ -x "$DTACTOR" ] || fail "no $DTACTOR (build the dtactor target)"
  mkdir -p "$TMP/secret/dtactor-job-key" "$TMP/logs" "$TMP/home"
  "$DTACTOR" keygen --out "$TMP/secret/dtactor-job-key/job.key" >/dev/null
  # Three node pods planned: two from the Deployment's replicas, one as the
  # replacement it makes. The pods' CPU limit (4, given to dtactor as
  # --threads-per-rank through the downward API) is capped at 1 here: three
  # pods share this machine's cores.
  node "$K8S/pods.mjs" "$SRC/deploy/kubernetes/shared-volume" "$TMP/out" --pods dtactor-nodes=3 \
    --secret dtactor-job-key="$TMP/secret/dtactor-job-key" --cpu-cap 1 || fail "pods.mjs could not plan the pods"
  mapfile -t PODS < <(cut -f2 "$TMP/out/pods.tsv")
  grace() { awk -F'\t' -v p="$1" '$2 == p {print $3}' "$TMP/out/pods.tsv"; }
  COORD=${PODS[0]}; STANDBY=${PODS[1]}; N1=${PODS[2]}; N2=${PODS[3]}; N3=${PODS[4]}
  [ "$COORD" = dtactor-coordinator-0 ] || fail "the first pod is '$COORD', not dtactor-coordinator-0"
  [ "$STANDBY" = dtactor-coordinator-1 ] || fail "the second pod is '$STANDBY', not dtactor-coordinator-1"
  # Both coordinator pods share the run directory and the lease on the claim.
  JOURNAL=$TMP/out/pvc/dtactor-checkpoints/coordinator/run/journal.jsonl
  LEASE=$TMP/out/pvc/dtactor-checkpoints/coordinator/lease
  # A tiny job (as the Slurm test picks): the only change to the manifests' commands.
  SETS=(--set model.dim=16 --set model.layers=1 --set model.heads=2 --set model.mlp_ratio=2 --set train.global_batch_size=32
        --set train.warmup_steps=5 --set train.lr=0.003 --set eval.max_samples=500 --set eval.every_steps=0 --set train.log_every_steps=1
        --set checkpoint.every_steps=20 --set train.max_steps=1000000)
  declare -A PID
  # run_pod POD [EXTRA ARGS...]: its init containers in order, then its
  # container in the background, in a session of its own (a pod's processes),
  # with only the pod's environment (and PATH to the built dtactor).
  run_pod() {
    local pod=$1; shift
    local f argv envl
    for f in "$TMP/out/$pod"/init-*.argv; do
      [ -e "$f" ] || continue
      mapfile -d '' argv <"$f"; mapfile -d '' envl <"${f%.argv}.env"
      timeout 30 env -i PATH="$BUILD:/usr/bin:/bin" HOME="$TMP/home" "${envl[@]}" "${argv[@]}" >>"$TMP/logs/$pod.log" 2>&1 \
        || fail "$pod: init container ${f##*/} failed"
    done
    mapfile -d '' argv <"$TMP/out/$pod/main.argv"; mapfile -d '' envl <"$TMP/out/$pod/main.env"
    mkdir -p "$TMP/tmp-$pod"
    setsid env -i PATH="$BUILD:/usr/bin:/bin" HOME="$TMP/home" TMPDIR="$TMP/tmp-$pod" "${envl[@]}" "${argv[@]}" "$@" >>"$TMP/logs/$pod.log" 2>&1 &
    PID[$pod]=$!
    PGIDS+=($!)
  }
  # Whole lines only: the last may be half written while it is read.
  journal() { /usr/bin/python3.11 -c "
import json,os
ev=[json.loads(l) for l in open('$JOURNAL') if l.endswith('\n') and l.strip()] if os.path.exists('$JOURNAL') else []
named=lambda n:[e for e in ev if e.get('event')==n]
print($1)"; }
  wait_for() {  # SECONDS PYTHON_CONDITION: polls the journal every 0.2 s
    local i
    for ((i = 0; i < $1 * 5; i++)); do
      [ "$(journal "bool($2)")" = True ] && return 0
      sleep 0.2
    done
    fail "timed out after $1 s waiting for: $2"
  }
  wait_exit() {  # POD SECONDS: sets RC to its exit code; fails when it outlives SECONDS (the kubelet would SIGKILL it)
    local i
    for ((i = 0; i < $2 * 10; i++)); do
      if ! kill -0 "${PID[$1]}" 2>/dev/null; then RC=0; wait "${PID[$1]}" || RC=$?; return 0; fi
      sleep 0.1
    done
    fail "$1 still running $2 s after SIGTERM: past its terminationGracePeriodSeconds, the kubelet would SIGKILL it"
  }

  log_has() {  # POD TEXT SECONDS: waits for TEXT in the pod's log
    local i
    for ((i = 0; i < $3 * 10; i++)); do grep -qF -- "$2" "$TMP/logs/$1.log" 2>/dev/null && return 0; sleep 0.1; done
    fail "$1 did not say '$2' within $3 s"
  }
  # The coordinator first, then its standby (in a cluster both start at
  # once, podManagementPolicy Parallel; whichever takes the lease leads).
  run_pod "$COORD" "${SETS[@]}"
  log_has "$COORD" "holds the job's lease at $LEASE, epoch 1" 30
  run_pod "$STANDBY" "${SETS[@]}"
  log_has "$STANDBY" "standing by: the job's lease is held by" 30
  run_pod "$N1"
  run_pod "$N2"
  wait_for 120 "[e for e in named('step') if e['step'] >= 5 and e['world_size'] == 2]"
  [ "$(journal "sorted(set(e['node'] for e in named('node_joined')))")" = "$(/usr/bin/python3.11 -c "print(sorted(['$N1', '$N2']))")" ] \
    || fail "node ids are not the pod names $N1, $N2: $(journal "[e['node'] for e in named('node_joined')]")"

  # Deleting a node's pod: SIGTERM to its container's process.
  t0=$(date +%s.%N)
  kill -TERM "${PID[$N2]}"
  wait_exit "$N2" "$(grace "$N2")"
  t1=$(date +%s.%N)
  # dtactor's exit code for "stopped by signal N": 128 + N (docs/usage.md).
  [ "$RC" = 143 ] || fail "$N2 exited $RC after SIGTERM, not 143 (128 + SIGTERM)"
  wait_for 30 "[e for e in named('recovery_done') if e['cause'] == 'node_left']"
  [ "$(journal "[e['node'] for e in named('node_left')]")" = "['$N2']" ] || fail "node_left does not name $N2 alone"
  [ "$(journal "[e['lost_steps'] for e in named('recovery_done') if e['cause'] == 'node_left'][0]")" = 0 ] || fail "steps lost on the leave"
  # (On a loaded machine a node may be lost and register again before
  # this; what counts is how the SIGTERM ended it.)
  [ "$(journal "len([e for e in named('node_lost') if e['node'] == '$N2' and e['t'] >= $t0])")" = 0 ] || fail "$N2 was lost, not left"
  left_at=$(journal "max(e['step'] for e in named('step'))")
  left_t=$(journal "named('node_left')[0]['t']")
  wait_for 60 "[e for e in named('step') if e['step'] >= $left_at + 5 and e['world_size'] == 1]"

  # The Deployment's replacement pod (a new name) joins the running job.
  run_pod "$N3"
  wait_for 120 "[e for e in named('recovery_done') if e['cause'] in ('node_joined', 'rank_ready') and e['world_size'] == 2]"
  [ "$(journal "len([e for e in named('node_joined') if e['node'] == '$N3'])")" -ge 1 ] || fail "the replacement did not join as $N3"
  wait_for 60 "[e for e in named('checkpoint_saved') if e['path'].startswith('$TMP/out/pvc/dtactor-checkpoints/')]"

  # The leading coordinator's machine lost: its process killed (kill -9);
  # the standby takes the lease over and adopts the running generation.
  at=$(journal "max(e['step'] for e in named('step'))")
  t2=$(date +%s.%N)
  kill -0 "${PID[$COORD]}" 2>/dev/null || { RC=0; wait "${PID[$COORD]}" || RC=$?; fail "$COORD exited (code $RC) before it was killed"; }
  kill -9 "${PID[$COORD]}"
  wait "${PID[$COORD]}" 2>/dev/null || true
  log_has "$STANDBY" "holds the job's lease at $LEASE, epoch 2" 30
  wait_for 30 "len(named('coordinator_started')) == 2"
  t3=$(date +%s.%N)
  # It adopts the running generation, or (a node that did not register
  # again within its wait) plans a new one from the highest step a rank
  # holds: either way nothing is lost.
  wait_for 60 "[e for e in named('step') if e['step'] >= $at + 10 and e['world_size'] == 2 and e['t'] > named('coordinator_started')[1]['t']]"
  [ "$(journal "[e['lost_steps'] for e in named('recovery_done') if e['lost_steps']]")" = "[]" ] || fail "steps lost over the takeover"
  how=$(journal "'adopted the running generation' if named('generation_adopted') else 'planned a new generation'")
  # No step trained twice (a rollback); steps the ranks took while no
  # coordinator listened are not journaled (their reports had nowhere to go).
  [ "$(journal "len(named('step')) == len(set(e['step'] for e in named('step')))")" = True ] \
    || fail "steps journaled twice (trained again) around the takeover: $(journal "sorted(s for s in set(e['step'] for e in named('step')) if [e['step'] for e in named('step')].count(s) > 1)[:20]")"
  unreported=$(journal "len(set(range(1, max(e['step'] for e in named('step')) + 1)) - set(e['step'] for e in named('step')))")
  # The StatefulSet makes the pod again: it stands by for the new leader.
  run_pod "$COORD" "${SETS[@]}"
  log_has "$COORD" "standing by: the job's lease is held by" 30

  # Deleting the leading coordinator's pod: the job stops after a final checkpoint.
  COORD=$STANDBY
  kill -TERM "${PID[$COORD]}"
  wait_exit "$COORD" "$(grace "$COORD")"
  wait_for 10 "named('job_stopped')"
  stopped=$(journal "named('job_stopped')[0]['step']")
  newest=$(journal "max(e['step'] for e in named('checkpoint_saved'))")
  [ "$newest" = "$stopped" ] || fail "no final checkpoint: stopped at $stopped, newest checkpoint $newest (coordinator exit $RC)"
  ls "$TMP/out/pvc/dtactor-checkpoints/" | grep -q "ckpt-0*$stopped.manifest" || fail "no manifest of step $stopped on the shared volume"
  codes=()
  for p in "$N1" "$N3"; do wait_exit "$p" 60; codes+=("$RC"); done
  /usr/bin/python3.11 -c "print('PASS pods: coordinator + 2 node pods trained; SIGTERM to $N2: out of the membership (node_left) after %.2f s, process exit 143 after %.2f s (grace $(grace "$N2") s), 0 steps lost, world 1 went on; replacement $N3 joined (world 2); kill -9 of the leading coordinator at step $at: its standby led %.2f s later ($how), no step trained twice ($unreported taken while no coordinator listened, not journaled); leader SIGTERM: final checkpoint at step $stopped on the shared volume, job_stopped; the nodes exited ${codes[*]}' % ($left_t - $t0, $t1 - $t0, $t3 - $t2))"
  ;;
*) echo "unknown case '$CASE' (validate, pods)"; exit 2;;
esac
