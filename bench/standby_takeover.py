#!/usr/bin/python3
"""A standby coordinator taking over: kill -9 of the leading coordinator
while two nodes train the default-config ViT job, the job's lease in a
directory both coordinators share (docs/fault_handling.md, "A standby
coordinator"). Each trial, on loopback:

  coordinator A  --lease DIR --standby, on its own port (it leads)
  coordinator B  --lease DIR --standby, on another port (it stands by)
  nodes x, y     --coordinator A,B

After 15 steps at world 2, A is killed (SIGKILL). Measured from the kill:
  lease_s      B says it holds the job's lease (its stderr, polled every 10 ms)
  listening_s  B's coordinator_started (it binds its port: nodes can reach it)
  registered_s the last of the nodes' registrations with B before it led
               (node_joined): the nodes found it listening and registered
  adopted_s    B's generation_adopted (it leads the running generation), or
               its first generation_started where a node registered too late
and over the takeover:
  steps_lost         steps journaled twice (trained again after a rollback)
                     plus recovery_done lost_steps after the kill
  steps_taken_while_no_coordinator_listened
                     the steps between the last step line before the kill
                     and the first after the takeover: the ranks trained
                     them with no coordinator (their reports had nowhere to
                     go, so the journal has no line for them)
  step_s_across_takeover
                     (t of the first step line after - t of the last before)
                     / the steps between them: the ranks' pace over the
                     takeover, against step_s_after (the median gap of the
                     20 step lines after) and step_s_before: training paused
                     if it is much slower
Then a checkpoint committed by B (after the takeover) is evaluated with
`dtactor eval` (it loads as a resume point: the manifest, every rank's part,
the checksums).

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/standby_takeover.py [--trials 5] [--out FILE]

With --hosts (root), each coordinator and node on a network namespace host
of its own (scripts/netns/hosts.sh: A 198.18.0.1, B .2, x .3, y .4, etcd
.5), the run directory on the file system they share, per --faults
FAULT:LEASE (default kill:dir,cut:etcd,kill:etcd):
  kill  A's link cut (no FIN or reset reaches anyone), then kill -9 of every
        process on A's host, as a lost machine looks
  cut   A's link cut, its process left running; healed once B leads with a
        checkpoint committed. Also measured: the cut to A's exit (3: it
        stops deciding), what A journaled while cut off, and generations
        started and nodes lost over the 20 steps after the heal. A
        directory lease cannot be cut here (A still reaches it through the
        shared file system and keeps it), hence etcd on a host of its own.
Writes bench/standby_takeover_hosts_results.json.

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/standby_takeover.py --hosts [--trials 5] [--faults ...]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_jobs import journal, lease_trial, named, netns_hosts, summary, wait  # noqa: E402
from bench_net import free_port  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
KILL_AT_STEP = 15
CHECKPOINT_EVERY = 20
SETS = ["train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000",
        "checkpoint.every_steps=%d" % CHECKPOINT_EVERY, "train.max_steps=1000000", "cluster.min_nodes=2"]


def led_with_checkpoint(t, lease_t, more=lambda ev: True):
    """The journal once it has 21 step lines after lease_t and a checkpoint
    committed after it (a resume point), and more(journal) holds."""
    return wait(lambda: (lambda e: e if len([x for x in named(e, "step") if x["t"] > lease_t]) >= 21
                         and [c for c in named(e, "checkpoint_saved") if c["t"] > lease_t] and more(e) else None)(journal(t.run)), 300,
                "21 steps and a checkpoint after the takeover")


def measure(ev, t_kill, lease_t, kill_step):
    """The takeover's figures from the journal ev, t_kill the fault's time."""
    started = named(ev, "coordinator_started")
    led = [e for e in named(ev, "generation_adopted") + named(ev, "generation_started") if e["t"] > lease_t]
    led_t = min(e["t"] for e in led)
    joined = [e["t"] for e in named(ev, "node_joined") if lease_t < e["t"] <= led_t]
    ckpt = [c for c in named(ev, "checkpoint_saved") if c["t"] > lease_t][0]
    steps = [e["step"] for e in named(ev, "step")]
    repeated = len(steps) - len(set(steps))
    lost = sum(r.get("lost_steps", 0) for r in named(ev, "recovery_done") if r["t"] > t_kill)
    times = sorted((e["step"], e["t"]) for e in named(ev, "step"))
    first = [x for x in times if x[0] <= kill_step]
    after = [x for x in times if x[1] > lease_t]
    normal = statistics.median(b[1] - a[1] for a, b in zip(first[-10:], first[-9:]))
    after_s = statistics.median(b[1] - a[1] for a, b in zip(after[:20], after[1:21]))
    last_before, first_after = first[-1], after[0]
    across = (first_after[1] - last_before[1]) / (first_after[0] - last_before[0])
    return {
        "kill_step": kill_step,
        "lease_s": lease_t - t_kill,
        "listening_s": started[-1]["t"] - t_kill if len(started) == 2 else None,
        "registered_s": max(joined) - t_kill if joined else None,
        "adopted_s": led_t - t_kill,
        "how": "adopted the running generation" if named(ev, "generation_adopted") else "planned a new generation",
        "led_generation": min(led, key=lambda e: e["t"])["generation"],
        "coordinators_started": len(started),
        "steps_repeated": repeated,
        "steps_lost": repeated + lost,
        "steps_taken_while_no_coordinator_listened": first_after[0] - last_before[0] - 1,
        "step_s_before": normal,
        "step_s_after": after_s,
        "step_s_across_takeover": across,
        "across_over_after": across / after_s,
        "journal_silence_s": first_after[1] - last_before[1],
        "checkpoint_after_takeover": {"step": ckpt["step"], "committed_after_lease_s": ckpt["t"] - lease_t, "path": ckpt["path"]},
        "lost_nodes": len(named(ev, "node_lost")),
    }


def evaluate(path):
    """dtactor eval of a checkpoint: it loads as a resume point (the manifest, every rank's part, the checksums)."""
    ev_out = subprocess.run([DTACTOR, "eval", path, "--set", "eval.max_samples=1000"], capture_output=True, text=True, timeout=300)
    return {"eval_exit": ev_out.returncode, "eval_line": (ev_out.stdout.strip().splitlines() or [""])[-1][:200]}


def one_trial(work, ttl_ms, one_address=False):
    t = lease_trial(work, ttl_ms, DTACTOR, SETS)
    pa = free_port()
    pb = pa if one_address else free_port()
    try:
        t.coordinator("a", pa)
        wait(lambda: "holds the job's lease" in t.log("a"), 60, "coordinator a to hold the lease")
        t.coordinator("b", pb)
        wait(lambda: "standing by" in t.log("b"), 60, "coordinator b to stand by")
        coords = "tcp://127.0.0.1:%d" % pa if one_address else "tcp://127.0.0.1:%d,tcp://127.0.0.1:%d" % (pa, pb)
        for n in ("x", "y"):
            t.start(n, ["--role", "node", "--coordinator", coords, "--node-id", n, "--advertise-addr", "127.0.0.1", "--threads-per-rank", "1"])
        wait(lambda: [e for e in named(journal(t.run), "step") if e["step"] >= KILL_AT_STEP and e["world_size"] == 2], 300, "step %d at world 2" % KILL_AT_STEP)
        before = named(journal(t.run), "step")
        kill_step = max(e["step"] for e in before)
        t_kill = time.time()
        os.killpg(t.procs["a"].pid, signal.SIGKILL)
        t.procs["a"].wait()
        lease_t = wait(lambda: "holds the job's lease" in t.log("b") and time.time(), 30, "coordinator b to take the lease", 0.01)
        ev = led_with_checkpoint(t, lease_t)
        out = measure(ev, t_kill, lease_t, kill_step)
        t.kill_all()
        out["checkpoint_after_takeover"].update(evaluate(out["checkpoint_after_takeover"].pop("path")))
        return out
    finally:
        t.kill_all()


HOSTS_SH = os.path.join(ROOT, "scripts", "netns", "hosts.sh")
TAG = "dtsbt"
PORT = 29400
A_HOST, B_HOST, NODE_HOSTS, ETCD_HOST = 0, 1, {"x": 2, "y": 3}, 4
STEPS_AFTER_HEAL = 20


def hosts_trial(work, ttl_ms, fault, lease_store):
    """One trial on namespace hosts: A on host 0, B on host 1, nodes x and y
    on hosts 2 and 3, etcd (lease_store "etcd") on host 4; the run
    directory (and a "dir" lease) on the file system they all share. fault
    "kill": A's link cut, then kill -9 of every process on its host; "cut":
    A's link cut, healed once B leads with a checkpoint committed."""
    with netns_hosts(HOSTS_SH, TAG, 5) as h:
        lease = None
        if lease_store == "etcd":
            lease = "etcd://%s:2379/dtactor-bench" % h.address(ETCD_HOST)
        t = lease_trial(work, ttl_ms, DTACTOR, SETS, lease)
        try:
            if lease_store == "etcd":
                url = "http://%s:2379" % h.address(ETCD_HOST)
                t.start("etcd", ["--data-dir", os.path.join(work, "etcd"), "--listen-client-urls", url, "--advertise-client-urls", url],
                        h.run(ETCD_HOST), "/usr/bin/etcd")
                wait(lambda: "ready to serve client requests" in t.log("etcd"), 30, "etcd to serve", 0.05)
            t.coordinator("a", PORT, h.address(A_HOST), h.run(A_HOST))
            wait(lambda: "holds the job's lease" in t.log("a"), 60, "coordinator a to hold the lease")
            t.coordinator("b", PORT, h.address(B_HOST), h.run(B_HOST))
            wait(lambda: "standing by" in t.log("b"), 60, "coordinator b to stand by")
            coords = "tcp://%s:%d,tcp://%s:%d" % (h.address(A_HOST), PORT, h.address(B_HOST), PORT)
            for n, host in NODE_HOSTS.items():
                t.start(n, ["--role", "node", "--coordinator", coords, "--node-id", n, "--advertise-addr", h.address(host),
                            "--threads-per-rank", "1"], h.run(host))
            wait(lambda: [e for e in named(journal(t.run), "step") if e["step"] >= KILL_AT_STEP and e["world_size"] == 2], 300,
                 "step %d at world 2" % KILL_AT_STEP)
            kill_step = max(e["step"] for e in named(journal(t.run), "step"))
            a_log_at_fault = len(t.log("a"))
            t_fault = time.time()
            h.cut(A_HOST)
            cut_took = time.time() - t_fault
            a_exit = {}

            def watch_a():
                if "t" not in a_exit and t.procs["a"].poll() is not None:
                    a_exit.update(t=time.time(), code=t.procs["a"].returncode)
                return True

            killed = 0
            if fault == "kill":
                killed = h.kill(A_HOST)
                t.procs["a"].wait()
            lease_t = wait(lambda: watch_a() and "holds the job's lease" in t.log("b") and time.time(), 30, "coordinator b to take the lease")
            ev = led_with_checkpoint(t, lease_t, lambda e: watch_a())
            out = measure(ev, t_fault, lease_t, kill_step)
            b_started = max(e["t"] for e in named(ev, "coordinator_started"))
            out.update({"fault": fault, "lease_store": lease_store, "processes_killed_on_a_host": killed, "cut_command_s": cut_took,
                        # What the journal (on the shared file system, which A still reaches
                        # while cut) got between the fault and B's start: A's decisions, if any.
                        "journal_events_between_fault_and_standby_start":
                            sorted({e.get("event") for e in ev if t_fault < e["t"] < b_started})})
            if fault == "cut":
                watch_a()
                exited_before_heal = "t" in a_exit
                t_heal = time.time()
                h.heal(A_HOST)
                try:
                    t.procs["a"].wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass  # it went on deciding: the figures say so
                watch_a()
                ev = wait(lambda: (lambda e: e if len([x for x in named(e, "step") if x["t"] > t_heal]) >= STEPS_AFTER_HEAL else None)(
                    journal(t.run)), 300, "%d steps after the heal" % STEPS_AFTER_HEAL)
                steps = [e["step"] for e in named(ev, "step")]
                started = [g["generation"] for g in named(ev, "generation_started") if g["t"] > t_heal]
                other = sorted({x["generation"] for x in named(ev, "step") if x["t"] > t_heal} - {out["led_generation"]} - set(started))
                said = t.log("a")[a_log_at_fault:].splitlines()
                out.update({
                    "old_exit_code": a_exit.get("code"),
                    "fault_to_old_exit_s": a_exit["t"] - t_fault if "t" in a_exit else None,
                    "old_exited_before_heal": exited_before_heal,
                    "heal_after_fault_s": t_heal - t_fault,
                    "old_stops_deciding_lines": len([x for x in said if "stops deciding" in x]),
                    "old_lines_after_fault": [x[:300] for x in said[:10]],
                    "steps_repeated_by_end": len(steps) - len(set(steps)),
                    "generations_started_after_heal": len(started) + len(other),
                    "nodes_lost_after_heal": len([n for n in named(ev, "node_lost") + named(ev, "node_left") if n["t"] > t_heal]),
                })
                out["steps_lost"] = max(out["steps_lost"], out["steps_repeated_by_end"])
        finally:
            t.kill_all()
    out["checkpoint_after_takeover"].update(evaluate(out["checkpoint_after_takeover"].pop("path")))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--lease-ttl-ms", type=int, default=1500)
    ap.add_argument("--out", help="bench/standby_takeover_results.json, or with --hosts bench/standby_takeover_hosts_results.json")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--one-address", action="store_true",
                    help="both coordinators on one address, the nodes given it alone (as behind a floating address or a Service)")
    ap.add_argument("--hosts", action="store_true",
                    help="each coordinator and node on a network namespace host of its own (scripts/netns/hosts.sh; root)")
    ap.add_argument("--faults", default="kill:dir,cut:etcd,kill:etcd",
                    help="with --hosts: FAULT:LEASE,... FAULT kill (link cut, then kill -9 of the leader's host) or cut (link cut, "
                         "healed once the standby leads); LEASE dir (a directory on the shared file system) or etcd (on a host of its own)")
    a = ap.parse_args()
    a.out = a.out or os.path.join(HERE, "standby_takeover_hosts_results.json" if a.hosts else "standby_takeover_results.json")
    if a.hosts:
        return main_hosts(a)
    trials = []
    for i in range(a.trials):
        work = tempfile.mkdtemp(prefix="dtactor-standby-bench-")
        r = one_trial(work, a.lease_ttl_ms, a.one_address)
        print("trial %d: %s" % (i + 1, json.dumps(r)), file=sys.stderr)
        trials.append(r)
        if not a.keep:
            subprocess.run(["rm", "-rf", work])
    result = {"lease_ttl_ms": a.lease_ttl_ms, "trials": trials, "takeover": {
        k: summary(trials, k) for k in ("lease_s", "listening_s", "registered_s", "adopted_s", "step_s_before", "step_s_after", "step_s_across_takeover",
                                        "across_over_after", "journal_silence_s", "steps_taken_while_no_coordinator_listened")}}
    result["takeover"]["steps_lost_worst"] = max(x["steps_lost"] for x in trials)
    result["takeover"]["nodes_lost_worst"] = max(x["lost_nodes"] for x in trials)
    result["takeover"]["trials_count"] = len(trials)
    result["takeover"]["checkpoints_after_takeover_that_evaluate"] = sum(1 for x in trials if x["checkpoint_after_takeover"]["eval_exit"] == 0)
    F = bench_meta.figure
    out = bench_meta.write(a.out, result, "A standby coordinator takes over: kill -9 of the leading coordinator while 2 nodes train the "
                           "default-config ViT job, the lease in a shared directory (TTL %d ms)%s, %d trials (medians)"
                           % (a.lease_ttl_ms, ", both coordinators on one address" if a.one_address else "", a.trials),
                           "Recovery from faults", [
                               F("the kill to the standby holding the lease", ["takeover", "lease_s", "median"], "s"),
                               F("the kill to the standby listening (nodes can reach it)", ["takeover", "listening_s", "median"], "s"),
                               F("the kill to the last node registered with the standby", ["takeover", "registered_s", "median"], "s"),
                               F("the kill to the standby leading the running generation (generation_adopted)", ["takeover", "adopted_s", "median"], "s"),
                               F("steps lost or trained twice (worst trial)", ["takeover", "steps_lost_worst"], "steps"),
                               F("steps the ranks trained while no coordinator listened (kept, reported later)",
                                 ["takeover", "steps_taken_while_no_coordinator_listened", "median"], "steps"),
                               F("the ranks' mean step time across the takeover (last step line before the kill to the first after)",
                                 ["takeover", "step_s_across_takeover", "median"], "s", "the step time after it", ["takeover", "step_s_after", "median"]),
                               F("the journal's silence over the takeover (no step lines: no coordinator to report to)",
                                 ["takeover", "journal_silence_s", "median"], "s"),
                               F("trials whose first checkpoint committed after the takeover evaluates (dtactor eval)",
                                 ["takeover", "checkpoints_after_takeover_that_evaluate"], "count", "trials", ["takeover", "trials_count"]),
                           ], notes="Loopback, both coordinators and both nodes on the project's 2-core build machine, shared with other "
                                    "builds and tests while it ran (timings are loaded-machine figures). The directory lease is taken "
                                    "over once the holder's heartbeat has not changed for the TTL on the standby's clock (the holder "
                                    "renews every TTL/6, the standby looks every 100 ms at most), so the lease figure is the TTL less "
                                    "the age of the last renewal at the kill, plus up to a look. The nodes dial the standby's address "
                                    "every 100-200 ms (no backoff) and register the moment their connection comes up; the standby "
                                    "adopts the running generation at the registration that completes its members. The ranks train "
                                    "on meanwhile: no step line is journaled while no coordinator listens, so the journal's "
                                    "silence is not a pause; the pace across the takeover is.")
    print(json.dumps(out["takeover"], indent=1))
    return 0


HOSTS_NOTES = (
    "Network namespace hosts (scripts/netns/hosts.sh) on the project's 2-core build machine, shared with other builds and tests "
    "while it ran (timings are loaded-machine figures): coordinator A, coordinator B and nodes x and y (one rank each, one thread "
    "per rank) each on a host of its own, 198.18.0.1-4 on one bridge, links uncapped (veth). The run directory is on the file "
    "system all hosts share. Kill: A's link is cut at the switch and on its host (hosts.sh cut: nothing passes either way, so no "
    "FIN or reset reaches anyone), then every process on A's host gets SIGKILL, as a lost machine looks; the lease is a directory "
    "on the shared file system. Cut: A's link is cut and its process left running, healed once B leads with a checkpoint "
    "committed; the lease is in etcd on a fifth host, because a cut leaves the shared file system reachable to A on one machine "
    "(through a directory lease A would still renew it, and would let it go only once it had lost every node to silence, 2 heartbeat timeouts on: a measure of that rule, not of the lease), and etcd's lease TTL is whole seconds, at least "
    "2 (the coordinator rounds --lease-ttl-ms up), so the cut's takeover waits for a 2 s etcd lease; kill_etcd is the kill "
    "with that etcd lease, to tell the lease's share from the fault's. The old leader's decisions while cut off are the "
    "journal's events other than step lines between the cut and the standby's start (step lines there are reports that "
    "reached it before the cut took effect). Times are from the fault; "
    "the standby's lease is read from its output polled every 10 ms, the rest from the journal. The ranks train on while no "
    "coordinator listens: the journal's silence is not a pause; the pace across the takeover is.")


def main_hosts(a):
    if os.geteuid() != 0:
        raise SystemExit("standby_takeover.py --hosts: needs root (network namespaces)")
    result = {"lease_ttl_ms": a.lease_ttl_ms, "faults": a.faults}
    F = bench_meta.figure
    figures = []
    for spec in a.faults.split(","):
        fault, store = spec.split(":")
        trials = []
        for i in range(a.trials):
            work = tempfile.mkdtemp(prefix="dtactor-standby-hosts-bench-")
            r = hosts_trial(work, a.lease_ttl_ms, fault, store)
            print("%s trial %d: %s" % (fault, i + 1, json.dumps(r)), file=sys.stderr)
            trials.append(r)
            if not a.keep:
                subprocess.run(["rm", "-rf", work])
        s = {k: summary(trials, k) for k in ("lease_s", "listening_s", "registered_s", "adopted_s", "step_s_before", "step_s_after",
                                             "step_s_across_takeover", "across_over_after", "journal_silence_s",
                                             "steps_taken_while_no_coordinator_listened", "fault_to_old_exit_s")}
        s.update({"trials_count": len(trials), "steps_lost_worst": max(x["steps_lost"] for x in trials),
                  "nodes_lost_worst": max(x["lost_nodes"] for x in trials),
                  "adopted_within_2_s": sum(1 for x in trials if x["adopted_s"] <= 2.0),
                  "checkpoints_after_takeover_that_evaluate": sum(1 for x in trials if x["checkpoint_after_takeover"]["eval_exit"] == 0),
                  # step lines are reports that reached A before the cut took effect, not decisions
                  "journal_decisions_by_old_leader_worst": max(len(set(x["journal_events_between_fault_and_standby_start"]) - {"step"})
                                                               for x in trials)})
        if fault == "cut":
            s.update({"old_stopped_deciding_exit_3": sum(1 for x in trials if x["old_exit_code"] == 3 and x["old_stops_deciding_lines"] >= 1),
                      "generations_started_after_heal_worst": max(x["generations_started_after_heal"] for x in trials),
                      "nodes_lost_after_heal_worst": max(x["nodes_lost_after_heal"] for x in trials)})
        key = fault if (fault, store) in (("kill", "dir"), ("cut", "etcd")) else "%s_%s" % (fault, store)
        result[key] = {"fault": fault, "lease": store, "trials": trials, "takeover": s}
        what = {"kill": "A's host killed (link cut, then kill -9 of its processes), directory lease",
                "cut": "A's host cut off (processes running), healed after B leads, etcd lease",
                "kill_etcd": "A's host killed, etcd lease"}.get(key, "%s, %s lease" % (fault, store))
        if key not in ("kill", "cut"):
            figures.append(F("%s: the fault to the standby leading the running generation" % what, [key, "takeover", "adopted_s", "median"], "s"))
            continue
        figures += [
            F("%s: the fault to the standby holding the lease" % what, [key, "takeover", "lease_s", "median"], "s"),
            F("%s: the fault to the standby listening" % what, [key, "takeover", "listening_s", "median"], "s"),
            F("%s: the fault to the last node registered with the standby" % what, [key, "takeover", "registered_s", "median"], "s"),
            F("%s: the fault to the standby leading the running generation" % what, [key, "takeover", "adopted_s", "median"], "s"),
            F("%s: steps lost or trained twice (worst trial)" % what, [key, "takeover", "steps_lost_worst"], "steps"),
            F("%s: the ranks' mean step time across the takeover" % what, [key, "takeover", "step_s_across_takeover", "median"], "s",
              "the step time after it", [key, "takeover", "step_s_after", "median"]),
            F("%s: trials whose first checkpoint committed after the takeover evaluates" % what,
              [key, "takeover", "checkpoints_after_takeover_that_evaluate"], "count", "trials", [key, "takeover", "trials_count"]),
        ]
        if key == "cut":
            figures += [
                F("%s: the cut to the old leader's exit" % what, [key, "takeover", "fault_to_old_exit_s", "median"], "s"),
                F("%s: old leaders that stopped deciding (exit 3)" % what, [key, "takeover", "old_stopped_deciding_exit_3"], "count",
                  "trials", [key, "takeover", "trials_count"]),
                F("%s: generations started after the heal (worst trial)" % what, [key, "takeover", "generations_started_after_heal_worst"],
                  "count"),
                F("%s: decisions the old leader journaled while cut off (worst trial)" % what,
                  [key, "takeover", "journal_decisions_by_old_leader_worst"], "count"),
            ]
    out = bench_meta.write(a.out, result, "A standby coordinator takes over across namespace hosts: the leading coordinator's host "
                           "killed or cut off while 2 nodes on hosts of their own train the default-config ViT job (TTL %d ms), "
                           "%d trials each (medians)" % (a.lease_ttl_ms, a.trials), "Recovery from faults", figures, notes=HOSTS_NOTES)
    print(json.dumps({f: out[f]["takeover"] for f in out if isinstance(out[f], dict) and "takeover" in out[f]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
