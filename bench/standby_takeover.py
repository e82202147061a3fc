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
from bench_jobs import journal, lease_trial, named, wait  # noqa: E402
from bench_net import free_port  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
KILL_AT_STEP = 15
CHECKPOINT_EVERY = 20
SETS = ["train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000",
        "checkpoint.every_steps=%d" % CHECKPOINT_EVERY, "train.max_steps=1000000", "cluster.min_nodes=2"]


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
        # Led: 21 step lines after it took the lease, and a checkpoint it
        # committed (a resume point).
        ev = wait(lambda: (lambda e: e if len([x for x in named(e, "step") if x["t"] > lease_t]) >= 21
                           and [c for c in named(e, "checkpoint_saved") if c["t"] > lease_t] else None)(journal(t.run)), 300,
                  "21 steps and a checkpoint after the takeover")
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
        t.kill_all()
        ev_out = subprocess.run([DTACTOR, "eval", ckpt["path"], "--set", "eval.max_samples=1000"], capture_output=True, text=True, timeout=300)
        return {
            "kill_step": kill_step,
            "lease_s": lease_t - t_kill,
            "listening_s": started[-1]["t"] - t_kill if len(started) == 2 else None,
            "registered_s": max(joined) - t_kill if joined else None,
            "adopted_s": led_t - t_kill,
            "how": "adopted the running generation" if named(ev, "generation_adopted") else "planned a new generation",
            "coordinators_started": len(started),
            "steps_repeated": repeated,
            "steps_lost": repeated + lost,
            "steps_taken_while_no_coordinator_listened": first_after[0] - last_before[0] - 1,
            "step_s_before": normal,
            "step_s_after": after_s,
            "step_s_across_takeover": across,
            "across_over_after": across / after_s,
            "journal_silence_s": first_after[1] - last_before[1],
            "checkpoint_after_takeover": {"step": ckpt["step"], "committed_after_lease_s": ckpt["t"] - lease_t,
                                          "eval_exit": ev_out.returncode, "eval_line": (ev_out.stdout.strip().splitlines() or [""])[-1][:200]},
            "lost_nodes": len(named(ev, "node_lost")),
        }
    finally:
        t.kill_all()


def summary(trials, key):
    vals = [x[key] for x in trials if x.get(key) is not None]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--lease-ttl-ms", type=int, default=1500)
    ap.add_argument("--out", default=os.path.join(HERE, "standby_takeover_results.json"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--one-address", action="store_true",
                    help="both coordinators on one address, the nodes given it alone (as behind a floating address or a Service)")
    a = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
