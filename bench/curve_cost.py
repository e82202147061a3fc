#!/usr/bin/python3.11
"""What the job key costs (issue 27): the same job with and without
`--key` (CURVE on every ZeroMQ link and on the rendezvous store, signed
manifests), the two modes interleaved in every repeat so both see the same
machine load. A coordinator and two nodes (one rank each, one compute
thread each, the ViT default config) started by hand:
  - `local`: all three on this machine (127.0.0.1);
  - `hosts`: on three network-namespace hosts (scripts/netns/hosts.sh,
    needs root), links uncapped unless --cap.
Per run:
  - registration_s: a node process started -> the coordinator journals its
    node_joined (median of the two nodes);
  - samples_per_s: the journal's figure, median over the steps after the
    first fifth of --steps, at world 2;
  - kill -9 of node n2 and its rank at step --kill-at:
    first_step_after_kill_s (first step journaled at world 1 after the
    kill) and lost_steps (recovery_done).
Prints a JSON line per run and the medians and keyed/open ratios at the end;
writes bench/curve_cost_results.json.
Usage: bench/curve_cost.py [--modes local,hosts] [--repeats 3] [--steps 250]
  [--kill-at 150] [--cap 1gbit] [--dtactor build/dtactor] [--out FILE]"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time

import bench_meta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOSTS = os.path.join(ROOT, "scripts", "netns", "hosts.sh")
TAG = "dtck"


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


def wait_for(rd, pred, procs, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        j = journal(rd)
        r = pred(j)
        if r is not None:
            return r
        if procs[0].poll() is not None:
            raise SystemExit("the coordinator ended (exit %s); logs in %s" % (procs[0].returncode, rd))
        time.sleep(0.01)
    raise SystemExit("timed out waiting; journal in " + rd)


def run(binary, where, keyed, key, steps, kill_at):
    rd = tempfile.mkdtemp(prefix="bench-curve-")
    host = "198.18.0.1" if where == "hosts" else "127.0.0.1"
    port = 29400 if where == "hosts" else 29000 + (os.getpid() % 500)
    ep = "tcp://%s:%d" % (host, port)
    wrap = (lambda h: [HOSTS, "run", TAG, str(h)]) if where == "hosts" else (lambda h: [])
    sets = []
    for s in ("train.max_steps=%d" % steps, "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=1",
              "cluster.min_nodes=2"):
        sets += ["--set", s]
    key_args = ["--key", key] if keyed else []
    env = dict(os.environ)
    env.pop("DTACTOR_KEY_FILE", None)
    logs = [open(os.path.join(rd, n), "w") for n in ("coordinator.log", "node1.log", "node2.log")]
    procs = [subprocess.Popen(wrap(0) + [binary, "--role", "coordinator", "--listen", ep, "--run-dir", rd, "--no-resume", *key_args, *sets],
                              stdout=logs[0], stderr=subprocess.STDOUT, env=env, start_new_session=True)]
    r = {"where": where, "keyed": keyed}
    try:
        wait_for(rd, lambda j: True if any(e.get("event") == "coordinator_started" for e in j) else None, procs)
        started = {}
        for h in (1, 2):
            advertise = ["--advertise-addr", "198.18.0.%d" % (h + 1)] if where == "hosts" else ["--advertise-addr", "127.0.0.1"]
            started["n%d" % h] = time.time()
            procs.append(subprocess.Popen(wrap(h) + [binary, "--role", "node", "--coordinator", ep, "--node-id", "n%d" % h, "--threads-per-rank",
                                                     "1", *advertise, *key_args],
                                          stdout=logs[h], stderr=subprocess.STDOUT, env=env, start_new_session=True))
        joined = wait_for(rd, lambda j: (lambda js: js if len(js) == 2 else None)([e for e in j if e.get("event") == "node_joined"]), procs)
        r["registration_s"] = statistics.median(e["t"] - started[e["node"]] for e in joined)
        wait_for(rd, lambda j: True if any(e.get("event") == "step" and e["step"] >= kill_at for e in j) else None, procs)
        os.killpg(procs[2].pid, signal.SIGKILL)
        killed = time.time()
        first = wait_for(rd, lambda j: next((e for e in j if e.get("event") == "step" and e["t"] > killed and e["world_size"] == 1), None),
                         procs)
        r["first_step_after_kill_s"] = first["t"] - killed
        done = wait_for(rd, lambda j: next((e for e in j if e.get("event") == "recovery_done"), None), procs)
        r["lost_steps"] = done.get("lost_steps", 0)
        j = journal(rd)
        steady = [e for e in j if e.get("event") == "step" and steps // 5 < e["step"] < kill_at and e["world_size"] == 2]
        r["samples_per_s"] = statistics.median(e["samples_per_s"] for e in steady)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    subprocess.run(["rm", "-rf", rd])
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="local,hosts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--kill-at", type=int, default=150)
    ap.add_argument("--cap", default="")
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "curve_cost_results.json"))
    a = ap.parse_args()
    modes = a.modes.split(",")
    keydir = tempfile.mkdtemp(prefix="bench-curve-key-")
    key = os.path.join(keydir, "job.key")
    subprocess.run([a.dtactor, "keygen", "--out", key], check=True, stdout=subprocess.DEVNULL)
    if "hosts" in modes:
        subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([HOSTS, "up", TAG, "3"], check=True, stdout=subprocess.DEVNULL)
        if a.cap:
            for h in range(3):
                subprocess.run([HOSTS, "cap", TAG, str(h), a.cap], check=True, stdout=subprocess.DEVNULL)
    runs = []
    try:
        for rep in range(a.repeats):
            for where in modes:
                # Alternate which goes first, so neither always sees a warm cache.
                for keyed in ((False, True) if rep % 2 == 0 else (True, False)):
                    r = run(a.dtactor, where, keyed, key, a.steps, a.kill_at)
                    print(json.dumps(r), flush=True)
                    runs.append(r)
    finally:
        if "hosts" in modes:
            subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = {}
    for where in modes:
        s = {}
        for keyed in (False, True):
            rs = [r for r in runs if r["where"] == where and r["keyed"] == keyed]
            s["keyed" if keyed else "open"] = {k: statistics.median(r[k] for r in rs)
                                               for k in ("samples_per_s", "registration_s", "first_step_after_kill_s", "lost_steps")}
        # Paired ratios: keyed / open within each repeat.
        pairs = [(o, k) for o, k in zip([r for r in runs if r["where"] == where and not r["keyed"]],
                                        [r for r in runs if r["where"] == where and r["keyed"]])]
        s["keyed_over_open_samples_per_s_paired_median"] = statistics.median(k["samples_per_s"] / o["samples_per_s"] for o, k in pairs)
        s["keyed_over_open_first_step_after_kill_paired_median"] = statistics.median(
            k["first_step_after_kill_s"] / o["first_step_after_kill_s"] for o, k in pairs)
        summary[where] = s
    out = {"summary": summary, "runs": runs}
    F = bench_meta.figure
    names = {"local": "local", "hosts": "separate hosts"}
    figures = []
    for where in modes:
        s = ["summary", where]
        figures += [F("%s: samples/s with a key" % names[where], s + ["keyed", "samples_per_s"], "samples/s", "open job", s + ["open", "samples_per_s"]),
                    F("%s: keyed over open samples/s (median of the pairs)" % names[where],
                      s + ["keyed_over_open_samples_per_s_paired_median"], "x"),
                    F("%s: kill -9 of a node to the first step, with a key" % names[where], s + ["keyed", "first_step_after_kill_s"], "s",
                      "open job", s + ["open", "first_step_after_kill_s"]),
                    F("%s: a node's registration with a key" % names[where], s + ["keyed", "registration_s"], "s", "open job",
                      s + ["open", "registration_s"])]
    bench_meta.write(a.out, out, "A job key (CURVE on every control-plane link) against an open job, %d interleaved pairs" % a.repeats,
                     "Control plane and security", figures)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
