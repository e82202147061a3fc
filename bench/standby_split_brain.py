#!/usr/bin/python3
"""Split brain healed: the leading coordinator is cut off (stopped, not
killed) while two nodes train the default-config ViT job, the job's lease
in a directory both coordinators share (docs/fault_handling.md, "A standby
coordinator"); the standby takes over, then the old leader runs again and
must change nothing. Each trial, on loopback:

  coordinator A  --lease DIR --standby, on its own port (it leads)
  coordinator B  --lease DIR --standby, on another port (it stands by)
  nodes x, y     --coordinator A,B

After 15 steps at world 2, A's process group is stopped (SIGSTOP: it neither
renews nor speaks, its connections stay open, as under a partition). B
takes the lease and leads; after 20 steps under B, A is let go (SIGCONT:
the heal). Measured from the stop:
  lease_s         B says it holds the job's lease (its stderr, polled every 10 ms)
  adopted_s       B's generation_adopted (it leads the running generation), or
                  its first generation_started where a node registered too late
from the heal:
  heal_to_exit_s  A exits (its exit code: 3 is "stops deciding"; its lines
                  after the heal, which should be one 'stops deciding' line)
and over the 20 steps after the heal:
  steps_lost      steps journaled twice (trained again after a rollback)
                  plus recovery_done lost_steps after the stop
  generations_started_after_heal
                  generation_started lines after the heal, and step lines of
                  a generation other than the one B led
  nodes_lost_after_heal
                  node_lost and node_left lines after the heal

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/standby_split_brain.py [--trials 5] [--out FILE]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
from bench_jobs import journal, lease_trial, named, summary, wait  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
STOP_AT_STEP = 15
STEPS_UNDER_EACH = 20
SETS = ["train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000", "checkpoint.every_steps=100000",
        "train.max_steps=1000000", "cluster.min_nodes=2"]


def start_job(t):
    """A leading, B standing by, nodes x and y trained to STOP_AT_STEP at world 2."""
    pa, pb = free_port(), free_port()
    t.coordinator("a", pa)
    wait(lambda: "holds the job's lease" in t.log("a"), 60, "coordinator a to hold the lease", 0.05)
    t.coordinator("b", pb)
    wait(lambda: "standing by" in t.log("b"), 60, "coordinator b to stand by", 0.05)
    coords = "tcp://127.0.0.1:%d,tcp://127.0.0.1:%d" % (pa, pb)
    for n in ("x", "y"):
        t.start(n, ["--role", "node", "--coordinator", coords, "--node-id", n, "--advertise-addr", "127.0.0.1", "--threads-per-rank", "1"])
    wait(lambda: [e for e in named(journal(t.run), "step") if e["step"] >= STOP_AT_STEP and e["world_size"] == 2], 300,
         "step %d at world 2" % STOP_AT_STEP, 0.05)


def steps_after(ev, t0):
    return [x for x in named(ev, "step") if x["t"] > t0]


def led_by_b(ev, lease_t):
    return [x for x in named(ev, "generation_adopted") + named(ev, "generation_started") if x["t"] > lease_t]


def one_trial(work, ttl_ms):
    t = lease_trial(work, ttl_ms, DTACTOR, SETS)
    try:
        start_job(t)
        t_stop = time.time()
        os.killpg(t.procs["a"].pid, signal.SIGSTOP)
        lease_t = wait(lambda: "holds the job's lease" in t.log("b") and time.time(), 30, "coordinator b to take the lease")
        ev = wait(lambda: (lambda e: e if led_by_b(e, lease_t) and len(steps_after(e, min(x["t"] for x in led_by_b(e, lease_t))))
                           >= STEPS_UNDER_EACH else None)(journal(t.run)), 300, "b to lead %d steps" % STEPS_UNDER_EACH, 0.05)
        led = min(led_by_b(ev, lease_t), key=lambda x: x["t"])
        a_log_at_heal = len(t.log("a"))
        t_heal = time.time()
        os.killpg(t.procs["a"].pid, signal.SIGCONT)
        try:
            code = t.procs["a"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None  # it went on deciding: the figures say so
        exit_s = time.time() - t_heal
        ev = wait(lambda: (lambda e: e if len(steps_after(e, t_heal)) >= STEPS_UNDER_EACH else None)(journal(t.run)), 300,
                  "%d steps after the heal" % STEPS_UNDER_EACH, 0.05)
        out = figures_of(ev, t_stop, lease_t, led, t_heal)
        said = t.log("a")[a_log_at_heal:].splitlines()
        out.update({"heal_to_exit_s": exit_s if code is not None else None, "old_exit_code": code,
                    "old_stops_deciding_lines": len([x for x in said if "stops deciding" in x]),
                    "old_lines_after_heal": [x[:300] for x in said[:10]],
                    "nodes_alive_at_end": sum(1 for n in ("x", "y") if t.procs[n].poll() is None)})
        return out
    finally:
        t.kill_all()


def figures_of(ev, t_stop, lease_t, led, t_heal):
    steps = [e["step"] for e in named(ev, "step")]
    repeated = len(steps) - len(set(steps))
    lost = sum(r.get("lost_steps", 0) for r in named(ev, "recovery_done") if r["t"] > t_stop)
    started = [g["generation"] for g in named(ev, "generation_started") if g["t"] > t_heal]
    other = sorted({x["generation"] for x in steps_after(ev, t_heal)} - {led["generation"]} - set(started))
    return {
        "lease_s": lease_t - t_stop,
        "adopted_s": led["t"] - t_stop,
        "how": led["event"],
        "led_generation": led["generation"],
        "steps_repeated": repeated,
        "steps_lost": repeated + lost,
        "generations_after_heal": started + other,
        "generations_started_after_heal": len(started) + len(other),
        "nodes_lost_after_heal": len([n for n in named(ev, "node_lost") + named(ev, "node_left") if n["t"] > t_heal]),
    }


def summarize(trials):
    heal = {k: summary(trials, k) for k in ("lease_s", "adopted_s", "heal_to_exit_s")}
    heal.update({
        "trials_count": len(trials),
        "old_stopped_deciding_exit_3_one_line": sum(1 for x in trials if x["old_exit_code"] == 3 and x["old_stops_deciding_lines"] == 1),
        "steps_lost_worst": max(x["steps_lost"] for x in trials),
        "generations_started_after_heal_worst": max(x["generations_started_after_heal"] for x in trials),
        "nodes_lost_after_heal_worst": max(x["nodes_lost_after_heal"] for x in trials)})
    return heal


NOTES = ("Loopback, both coordinators and both nodes on the project's 2-core build machine, shared with other builds and "
         "tests while it ran (timings are loaded-machine figures). SIGSTOP stands for a partition of the leader: it neither "
         "renews nor speaks, and its connections stay open. The lease directory stays reachable to it, so when it runs "
         "again it finds its last renewal older than the TTL, tries to take the lease back, finds the standby's newer epoch and "
         "stops deciding. Over the 20 steps after the heal, a "
         "generation counts as started if the journal has its generation_started line or a step line of a generation other "
         "than the one the standby led; what the old coordinator printed after the heal is in trials[].old_lines_after_heal.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--lease-ttl-ms", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(HERE, "standby_split_brain_results.json"))
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    trials = []
    for i in range(a.trials):
        work = tempfile.mkdtemp(prefix="dtactor-split-brain-bench-")
        r = one_trial(work, a.lease_ttl_ms)
        print("trial %d: %s" % (i + 1, json.dumps(r)), file=sys.stderr)
        trials.append(r)
        if not a.keep:
            subprocess.run(["rm", "-rf", work])
    F = bench_meta.figure
    out = bench_meta.write(a.out, {"lease_ttl_ms": a.lease_ttl_ms, "trials": trials, "heal": summarize(trials)},
                           "Split brain healed: the leading coordinator stopped (SIGSTOP, silent as under a partition) while 2 "
                           "nodes train the default-config ViT job, the standby takes over and leads 20 steps, then the old one "
                           "runs again (SIGCONT), the lease in a shared directory (TTL %d ms), %d trials (medians)"
                           % (a.lease_ttl_ms, a.trials), "Recovery from faults", [
                               F("the stop to the standby holding the lease", ["heal", "lease_s", "median"], "s"),
                               F("the stop to the standby leading the running generation", ["heal", "adopted_s", "median"], "s"),
                               F("the heal to the old coordinator's exit", ["heal", "heal_to_exit_s", "median"], "s"),
                               F("healed old coordinators that stopped deciding (exit 3, one 'stops deciding' line)",
                                 ["heal", "old_stopped_deciding_exit_3_one_line"], "count", "trials", ["heal", "trials_count"]),
                               F("steps lost or trained twice (worst trial)", ["heal", "steps_lost_worst"], "steps"),
                               F("generations started after the heal (worst trial)", ["heal", "generations_started_after_heal_worst"], "count"),
                               F("nodes lost or left after the heal (worst trial)", ["heal", "nodes_lost_after_heal_worst"], "count"),
                           ], notes=NOTES)
    print(json.dumps(out["heal"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
