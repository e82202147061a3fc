#!/usr/bin/python3
"""A warm spare rank process taking a killed rank's place (docs/fault_handling.md,
"Warm spare rank processes"): kill -9 of a rank process on a node of a
2-node job of the default config (the ViT on Fashion-MNIST), with a spare
on that node (--spares 1) and without, alternating in one run. Each trial,
on loopback:

  a coordinator, nodes x and y (one rank each); y with --spares 1 or none

Once the job trains at world 2 past step 15 (and y's spare is warmed up,
read from y's /metrics: dtactor_spare_ranks 1), y's rank process is killed
(SIGKILL). Measured:
  full_world_s   from the kill to the first step journaled at world size 2
                 in a generation after the one the kill hit (the journal's
                 step lines, train.log_every_steps = 1)
  shrank         whether a generation at world size 1 came in between
  lost_steps     recovery_done lost_steps after the kill (sum)
and, with a spare, before the kill:
  spare_rss_bytes  the waiting spare's resident memory (VmRSS)
  rank_rss_bytes   y's rank process's, training, for comparison

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/spare_takeover.py [--trials 5] [--out FILE]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
from bench_jobs import journal, kill_groups, named, summary, wait  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
KILL_AT_STEP = 15
SETS = ["train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000", "checkpoint.every_steps=100000",
        "train.max_steps=1000000", "cluster.min_nodes=2"]


def metric(port, name):
    try:
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2).read().decode()
    except OSError:
        return None
    m = re.search(r"\n%s(\{[^}]*\})? ([-0-9.e+]+)" % re.escape(name), text)
    return float(m.group(2)) if m else None


def children(pid):
    out = []
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def is_spare(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"--spare\0" in f.read()
    except OSError:
        return False


def rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def one_trial(work, spares):
    run = os.path.join(work, "run")
    procs = {}

    def start(name, args):
        log = open(os.path.join(work, name + ".log"), "w")
        procs[name] = subprocess.Popen([DTACTOR] + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    port, metrics_port = free_port(), free_port()
    try:
        start("coordinator", ["--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % port, "--advertise-addr", "127.0.0.1",
                              "--run-dir", run] + [x for s in SETS for x in ("--set", s)])
        for n in ("x", "y"):
            extra = ["--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1"] if n == "y" else []
            if n == "y" and spares:
                extra += ["--spares", str(spares)]
            start(n, ["--role", "node", "--coordinator", "tcp://127.0.0.1:%d" % port, "--node-id", n, "--advertise-addr", "127.0.0.1",
                      "--threads-per-rank", "1"] + extra)
        wait(lambda: [e for e in named(journal(run), "step") if e["step"] >= KILL_AT_STEP and e["world_size"] == 2], 300,
             "step %d at world 2" % KILL_AT_STEP, 0.05)
        if spares:
            wait(lambda: metric(metrics_port, "dtactor_spare_ranks") == spares, 120, "y's spare to warm up", 0.05)
        kids = children(procs["y"].pid)
        ranks = [p for p in kids if not is_spare(p)]
        waiting = [p for p in kids if is_spare(p)]
        assert len(ranks) == 1, kids
        out = {"spares": spares}
        if spares:
            out["spare_rss_bytes"] = rss(waiting[0])
            out["rank_rss_bytes"] = rss(ranks[0])
        gen_at_kill = max(e["generation"] for e in named(journal(run), "generation_started"))
        t_kill = time.time()
        os.kill(ranks[0], signal.SIGKILL)
        first = wait(lambda: [e for e in named(journal(run), "step") if e.get("generation", 0) > gen_at_kill and e["world_size"] == 2], 120,
                     "a step at world 2 after the kill", 0.005)[0]
        ev = journal(run)
        gens = [g for g in named(ev, "generation_started") if g["generation"] > gen_at_kill and g["t"] <= first["t"]]
        out.update({
            "full_world_s": first["t"] - t_kill,
            "shrank": any(g["world_size"] < 2 for g in gens),
            "generations": len(gens),
            "causes": [g["cause"] for g in gens],
            "lost_steps": sum(r.get("lost_steps", 0) for r in named(ev, "recovery_done") if r["t"] > t_kill),
            "spare_ranks": sum(r.get("spare_ranks", 0) for r in named(ev, "recovery_done") if r["t"] > t_kill),
        })
        return out
    finally:
        kill_groups(procs.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "spare_takeover_results.json"))
    a = ap.parse_args()
    runs = {"spare": [], "cold": []}
    for i in range(a.trials):
        for kind, spares in (("spare", 1), ("cold", 0)):
            work = tempfile.mkdtemp(prefix="dtactor-spare-bench-")
            r = one_trial(work, spares)
            print("trial %d %s: %s" % (i + 1, kind, json.dumps(r)), file=sys.stderr)
            runs[kind].append(r)
            subprocess.run(["rm", "-rf", work])
    result = {"trials": runs, "with_spare": {k: summary(runs["spare"], k) for k in ("full_world_s", "spare_rss_bytes", "rank_rss_bytes")},
              "without_spare": {"full_world_s": summary(runs["cold"], "full_world_s")}}
    result["with_spare"]["shrank_trials"] = sum(1 for x in runs["spare"] if x["shrank"])
    result["without_spare"]["shrank_trials"] = sum(1 for x in runs["cold"] if x["shrank"])
    result["lost_steps_worst"] = max(x["lost_steps"] for x in runs["spare"] + runs["cold"])
    F = bench_meta.figure
    out = bench_meta.write(a.out, result, "A warm spare takes a killed rank's place: kill -9 of a rank process on a node of a 2-node "
                           "default-config job, with a spare on that node (--spares 1) and without, %d trials each, alternating (medians)" % a.trials,
                           "Recovery from faults", [
                               F("the kill to the first step at full world size, with a spare", ["with_spare", "full_world_s", "median"], "s",
                                 "without (the node starts a rank process)", ["without_spare", "full_world_s", "median"]),
                               F("resident memory of a waiting spare", ["with_spare", "spare_rss_bytes", "median"], "bytes",
                                 "a training rank's", ["with_spare", "rank_rss_bytes", "median"]),
                               F("steps lost (worst trial)", ["lost_steps_worst"], "steps"),
                           ], notes="Loopback, the coordinator and both nodes on the project's 2-core build machine (one compute thread "
                                    "a rank). The times are the coordinator's journal's (a step line is written once every rank "
                                    "reported that step). Without a spare the job trains at world 1 until the restarted process "
                                    "has started and warmed up, then grows back after cluster.settle_ms.")
    print(json.dumps({k: out[k] for k in ("with_spare", "without_spare", "lost_steps_worst")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
