#!/usr/bin/python3.11
"""Recovery on separate hosts (network namespaces, scripts/netns/hosts.sh):
coordinator + 2 node hosts (1 rank each, 1 thread), the ViT default model
with the default heartbeats. Per trial:
  - host cut: node n2's host cut off mid-training (nothing arrives, no
    reset); detected_after_s (journal node_lost) and first step at world 1
    after the cut;
  - heal after 6 s: time from the heal to the first step at world 2;
  - coordinator's host cut off for 4 s: the journal's step when cut and the
    first step it journals after the heal (steps the nodes completed
    meanwhile).
Prints JSON with medians; writes bench/hosts_faults_results.json.
Usage (root): bench/bench_hosts_faults.py [--trials 3] [--dtactor build/dtactor]"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import bench_meta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOSTS = os.path.join(ROOT, "scripts", "netns", "hosts.sh")
TAG = "dtbf"


def hosts(*args):
    subprocess.run([HOSTS, *args], check=True, stdout=subprocess.DEVNULL)


def journal(rd):
    out = []
    try:
        for line in open(os.path.join(rd, "journal.jsonl")):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except FileNotFoundError:
        pass
    return out


def wait_for(rd, pred, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        j = journal(rd)
        r = pred(j)
        if r is not None:
            return r, j
        time.sleep(0.02)
    raise SystemExit("timed out waiting; journal in " + rd)


def steps(j):
    return [e for e in j if e.get("event") == "step"]


def trial(binary):
    rd = tempfile.mkdtemp(prefix="bench-hosts-faults-")
    sets = []
    for s in ("train.max_steps=100000000", "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=1", "cluster.min_nodes=2"):
        sets += ["--set", s]
    logs = [open(os.path.join(rd, n), "w") for n in ("coordinator.log", "node1.log", "node2.log")]
    procs = [subprocess.Popen([HOSTS, "run", TAG, "0", binary, "--role", "coordinator", "--listen", "tcp://198.18.0.1:29400", "--run-dir", rd,
                               "--no-resume", *sets], stdout=logs[0], stderr=subprocess.STDOUT)]
    for h in (1, 2):
        procs.append(subprocess.Popen([HOSTS, "run", TAG, str(h), binary, "--role", "node", "--coordinator", "tcp://198.18.0.1:29400",
                                       "--node-id", "n%d" % h, "--threads-per-rank", "1"], stdout=logs[h], stderr=subprocess.STDOUT))
    r = {}
    try:
        wait_for(rd, lambda j: True if any(e["step"] >= 50 and e["world_size"] == 2 for e in steps(j)) else None)
        # A node's host cut off.
        hosts("cut", TAG, "2")
        cut = time.time()
        lost, _ = wait_for(rd, lambda j: next((e for e in j if e.get("event") == "node_lost"), None))
        first1, _ = wait_for(rd, lambda j: next((e for e in steps(j) if e["t"] > cut and e["world_size"] == 1), None))
        r["cut_detected_s"] = lost["detected_after_s"]
        r["cut_first_step_world1_s"] = first1["t"] - cut
        time.sleep(max(0.0, cut + 6 - time.time()))
        hosts("heal", TAG, "2")
        heal = time.time()
        first2, _ = wait_for(rd, lambda j: next((e for e in steps(j) if e["t"] > heal and e["world_size"] == 2), None))
        r["heal_first_step_world2_s"] = first2["t"] - heal
        lost_steps = [e["lost_steps"] for e in journal(rd) if e.get("event") == "recovery_done"]
        r["lost_steps"] = max(lost_steps) if lost_steps else 0
        # The coordinator's host cut off for 4 s.
        time.sleep(2)
        before = steps(journal(rd))[-1]["step"]
        hosts("cut", TAG, "0")
        ccut = time.time()
        time.sleep(4)
        hosts("heal", TAG, "0")
        after, _ = wait_for(rd, lambda j: next((e for e in steps(j) if e["t"] > ccut + 4), None))
        r["coordinator_cut_steps_journaled_before"] = before
        r["coordinator_cut_first_step_after_heal"] = after["step"]
        r["coordinator_cut_steps_during_4s"] = after["step"] - before
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "hosts_faults_results.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts_faults.py: needs root (network namespaces)")
    subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hosts("up", TAG, "3")
    try:
        trials = [trial(a.dtactor) for _ in range(a.trials)]
    finally:
        subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = {"trials": trials, "medians": {k: statistics.median(t[k] for t in trials) for k in trials[0]}}
    F = bench_meta.figure
    bench_meta.write(a.out, res, "Faults on separate hosts (network namespaces): a node's link cut and healed, the coordinator's link "
                     "cut, %d trials" % a.trials, "Recovery from faults", [
                         F("a node's link cut: detected (median)", ["medians", "cut_detected_s"], "s"),
                         F("a node's link cut: the first step at world 1 (median)", ["medians", "cut_first_step_world1_s"], "s"),
                         F("the link healed: the first step at world 2 again (median)", ["medians", "heal_first_step_world2_s"], "s"),
                         F("completed steps lost", ["medians", "lost_steps"], "steps"),
                         F("the coordinator's link cut for 4 s: steps trained meanwhile (median)",
                           ["medians", "coordinator_cut_steps_during_4s"], "steps")])
    print(json.dumps(res["medians"]))


if __name__ == "__main__":
    main()
