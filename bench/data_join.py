#!/usr/bin/python3.11
"""A node joining a running job with an empty disk (issue 29, docs/data.md):
the built-in ViT (its defaults) trains on Fashion-MNIST as 30 PNG tar shards
(examples/shards/make_tar_shards.py), a coordinator and node `a` started by
hand on this machine; after --join-at steps node `b` starts and joins. Two
modes, interleaved in every repeat:
  - local: the shards in a directory both nodes read (the data already on
           every disk: what dtactor needed before shards);
  - s3:    the shards in S3 (Ceph's radosgw on loopback, as the tests start
           it), and `b` starts with an empty TMPDIR: no cache, no data.
Per run, from the journal: contributing_after_register_s (b's node_joined ->
the first step at world 2), started_to_register_s (b's process start -> its
node_joined), the pause of the job (the last step at world 1 -> the first at
world 2, minus a median step), and b's data counters (bytes fetched, shards
verified, cache misses) from the last resources row. Prints a JSON line per
run and the medians; writes bench/data_join_results.json.

Usage: bench/data_join.py [--repeats 3] [--join-at 30] [--steps 80] [--dtactor build/dtactor] [--out FILE]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from data_shards import ACCESS, SECRET, free_port, journal, make_vit_shards, shards_to_s3  # noqa: E402


def wait_for(rd, pred, procs, timeout=600):
    end = time.time() + timeout
    while time.time() < end:
        r = pred(journal(rd))
        if r is not None:
            return r
        if procs[0].poll() is not None:
            raise SystemExit("the coordinator ended (exit %s); logs in %s" % (procs[0].returncode, rd))
        time.sleep(0.01)
    raise SystemExit("timed out waiting; journal in " + rd)


def one_run(args, mode, spec, endpoint, work):
    rd = tempfile.mkdtemp(prefix="run-%s-" % mode, dir=work)
    ep = "tcp://127.0.0.1:%d" % free_port()
    sets = []
    for s in ("model.name=vit", "data.train_shards=" + spec, "train.max_steps=%d" % args.steps, "eval.every_steps=0",
              "checkpoint.every_steps=0", "train.log_every_steps=1", "cluster.min_nodes=1", "data.s3_endpoint=" + (endpoint or "")):
        sets += ["--set", s]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    env.pop("DTACTOR_KEY_FILE", None)
    tmps = {n: os.path.join(rd, "tmp-" + n) for n in ("a", "b")}
    for t in tmps.values():
        os.makedirs(t)
    logs = {n: open(os.path.join(rd, n + ".log"), "w") for n in ("coordinator", "a", "b")}
    procs = [subprocess.Popen([args.dtactor, "--role", "coordinator", "--listen", ep, "--run-dir", rd, "--no-resume", *sets],
                              stdout=logs["coordinator"], stderr=subprocess.STDOUT, env=env, start_new_session=True)]

    def node(n):
        return subprocess.Popen([args.dtactor, "--role", "node", "--coordinator", ep, "--node-id", n, "--threads-per-rank", "1",
                                 "--advertise-addr", "127.0.0.1"],
                                stdout=logs[n], stderr=subprocess.STDOUT, env=dict(env, TMPDIR=tmps[n]), start_new_session=True)

    r = {"mode": mode}
    try:
        wait_for(rd, lambda j: True if any(e.get("event") == "coordinator_started" for e in j) else None, procs)
        procs.append(node("a"))
        wait_for(rd, lambda j: True if any(e.get("event") == "step" and e["step"] >= args.join_at for e in j) else None, procs)
        started = time.time()
        procs.append(node("b"))
        joined = wait_for(rd, lambda j: next((e for e in j if e.get("event") == "node_joined" and e.get("node") == "b"), None), procs)
        first = wait_for(rd, lambda j: next((e for e in j if e.get("event") == "step" and e["t"] > joined["t"] and e["world_size"] == 2), None),
                         procs)
        wait_for(rd, lambda j: True if any(e.get("event") == "job_finished" for e in j) else None, procs)
        j = journal(rd)
        steps1 = [e for e in j if e.get("event") == "step" and e["world_size"] == 1]
        gaps = [b["t"] - a["t"] for a, b in zip(steps1, steps1[1:])]
        last1 = max(e["t"] for e in steps1 if e["t"] < first["t"])
        r["started_to_register_s"] = joined["t"] - started
        r["contributing_after_register_s"] = first["t"] - joined["t"]
        r["job_paused_beyond_one_step_s"] = first["t"] - last1 - statistics.median(gaps)
        rows = [row for e in j if e.get("event") == "resources" for row in e.get("ranks", []) if row.get("node") == "b"]
        last = rows[-1] if rows else {}
        for k in ("data_bytes_s3", "data_bytes_local", "data_shards_verified", "data_cache_misses", "data_cache_peak_bytes"):
            r["b_" + k] = last.get(k, 0)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for f in logs.values():
            f.close()
    shutil.rmtree(rd, ignore_errors=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--join-at", type=int, default=30)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--modes", default="local,s3")
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "data_join_results.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    work = tempfile.mkdtemp(prefix="dtactor-bench-join-")
    endpoint = None
    rgw_dir = None
    try:
        names, specs = make_vit_shards(work)
        subprocess.run([args.dtactor, "data", "index", specs["dir"]], check=True, stdout=subprocess.DEVNULL)
        specs["local"] = specs.pop("dir")
        if "s3" in modes:
            specs["s3"] = "s3://bench/imgs/train-*.tar"
            rgw_dir, endpoint = shards_to_s3(args.dtactor, work, names, "/bench/imgs/", specs["s3"])
        runs = []
        for rep in range(args.repeats):
            for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                x = one_run(args, m, specs[m], endpoint, work)
                x["repeat"] = rep
                print(json.dumps(x), flush=True)
                runs.append(x)
        summary = {}
        for m in modes:
            mine = [x for x in runs if x["mode"] == m]
            summary[m] = {k: statistics.median(x[k] for x in mine) for k in mine[0] if k not in ("mode", "repeat")}
        if "local" in summary and "s3" in summary:
            summary["s3_minus_local_contributing_after_register_s"] = (summary["s3"]["contributing_after_register_s"] -
                                                                        summary["local"]["contributing_after_register_s"])
        result = {"setup": {"model": "built-in ViT, its defaults, Fashion-MNIST as 30 PNG tar shards of 2,000 samples (4.6 MB each)",
                            "nodes": "coordinator and 2 nodes by hand on 127.0.0.1, 1 thread per rank; b joins at step %d" % args.join_at,
                            "defaults": "data.shuffle_block_shards 4, data.read_ahead_blocks 1, data.cache_bytes 4 GiB"},
                  "summary": summary, "runs": runs}
        print(json.dumps(summary))
        F = bench_meta.figure
        figures = []
        if "local" in summary and "s3" in summary:
            figures = [F("shards from S3 to an empty disk: the joiner's registration to its first contribution",
                         ["summary", "s3", "contributing_after_register_s"], "s", "shards on its local disk",
                         ["summary", "local", "contributing_after_register_s"]),
                       F("the job's pause beyond one step while it joins, shards from S3", ["summary", "s3", "job_paused_beyond_one_step_s"],
                         "s", "shards on its local disk", ["summary", "local", "job_paused_beyond_one_step_s"]),
                       F("bytes the joiner read from S3", ["summary", "s3", "b_data_bytes_s3"], "bytes")]
        else:
            figures = [F("%s: the joiner's registration to its first contribution" % m, ["summary", m, "contributing_after_register_s"], "s")
                       for m in modes]
        bench_meta.write(args.out, result, "A node joining mid-run: built-in ViT from 30 PNG tar shards, %d repeats" % args.repeats,
                         "Data", figures)
    finally:
        if rgw_dir:
            subprocess.run(["bash", os.path.join(ROOT, "scripts", "rgw", "stop-rgw.sh"), rgw_dir], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
