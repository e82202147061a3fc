#!/usr/bin/python3.11
"""Training on separate hosts over capped links: two node hosts (one rank
each, one compute thread each) and a coordinator host, network namespaces on
a test switch (scripts/netns/hosts.sh), every link capped by tbf at each
rate. For each cap: dtactor (ViT default config: model and global batch 128,
gradients over Gloo since the ranks are on different hosts), and PyTorch DDP
under torchrun (bench/ddp_vit.py) with and without DDP's fp16 compression
hook. Prints JSON and writes bench/hosts_results.json.

Usage (root): bench/bench_hosts.py [--caps 10gbit,1gbit,100mbit] [--steps 300]
  [--repeats 1] [--dtactor build/dtactor] [--wire fp32[,bf16]] [--no-ddp]
  [--set KEY=VALUE ...] [--out FILE]
samples/s: dtactor's journaled figure (median over the steps after the
first fifth); DDP's: global batch / median step time on rank 0."""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import bench_meta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOSTS = os.path.join(ROOT, "scripts", "netns", "hosts.sh")
TAG = "dtbh"


def hosts(*args, check=True):
    return subprocess.run([HOSTS, *args], check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def each_cap(tag, caps, n_hosts=3):
    """Makes n_hosts hosts, yields each cap once every host's link carries it,
    and removes the hosts afterwards (also on errors)."""
    hosts("down", tag, check=False)
    hosts("up", tag, str(n_hosts))
    try:
        for cap in caps:
            for h in range(n_hosts):
                hosts("cap", tag, str(h), cap)
            yield cap
    finally:
        hosts("down", tag, check=False)


def run_dtactor(binary, steps, wire, log_dir, extra_sets=(), per_host=(1, 1), tag=TAG, name=""):
    """One dtactor job: the coordinator on host 0, a node with per_host[i]
    ranks (1 thread each) on host i+1. Returns the journal's medians over
    the steps after the first fifth at the full world size."""
    world = sum(per_host)
    with tempfile.TemporaryDirectory() as rd:
        sets = ["train.max_steps=%d" % steps, "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=10",
                "cluster.min_nodes=%d" % len(per_host), *extra_sets]
        if wire != "fp32":
            sets.append("cluster.wire_dtype=" + wire)
        args = [x for s in sets for x in ("--set", s)]
        logs = [open(os.path.join(log_dir, name + n), "w") for n in ["coordinator.log"] + ["node%d.log" % h for h in range(1, len(per_host) + 1)]]
        coord = subprocess.Popen([HOSTS, "run", tag, "0", binary, "--role", "coordinator", "--listen", "tcp://198.18.0.1:29400", "--run-dir", rd,
                                  "--no-resume", *args], stdout=logs[0], stderr=subprocess.STDOUT)
        nodes = [subprocess.Popen([HOSTS, "run", tag, str(h), binary, "--role", "node", "--coordinator", "tcp://198.18.0.1:29400",
                                   "--node-id", "n%d" % h, "--nproc-per-node", str(n), "--threads-per-rank", "1"],
                                  stdout=logs[h], stderr=subprocess.STDOUT) for h, n in enumerate(per_host, start=1)]
        rc = coord.wait(timeout=1800)
        for n in nodes:
            n.wait(timeout=120)
        if rc != 0:
            raise SystemExit("dtactor run %sfailed (exit %d); logs in %s" % (name, rc, log_dir))
        steps_ev = [json.loads(l) for l in open(os.path.join(rd, "journal.jsonl")) if '"event":"step"' in l]
        steady = [e for e in steps_ev if e["step"] > steps // 5 and e["world_size"] == world]
        return {"samples_per_s": statistics.median(e["samples_per_s"] for e in steady),
                "allreduce_s": statistics.median(e["allreduce_s"] for e in steady),
                "allreduce_exposed_s": statistics.median(e["allreduce_exposed_s"] for e in steady)}


def report_cap(results, cap, summary):
    """Stores one cap's summary and prints its samples/s figures as a JSON line."""
    results["caps"][cap] = summary
    print(json.dumps({cap: {k: (v["samples_per_s"] if isinstance(v, dict) else v) for k, v in summary.items()}}), flush=True)


def write_results(results, out, title, figures):
    """Writes results with bench_meta's header (command, machine, date) and
    the figures the page shows, those whose values the run produced."""
    present = []
    for f in figures:
        try:
            bench_meta.lookup(results, f["at"])
            if "anchor_at" in f:
                bench_meta.lookup(results, f["anchor_at"])
            present.append(f)
        except (KeyError, IndexError):
            pass
    out_json = bench_meta.write(out, results, title, "Throughput", present)
    print(json.dumps(out_json))


def run_ddp(steps, fp16):
    base = ["/usr/bin/python3.11", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "198.18.0.2",
            "--master_port", "29500",
            # torchrun 1.13 under Python 3.11 cannot parse its default "0" for these
            # (Std.NONE is not iterated by 3.11's enum): tee rank stdout (1) instead.
            "--redirects", "1", "--tee", "1", "--log_dir", tempfile.mkdtemp(prefix="torchrun-")]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    procs = []
    for i, h in enumerate((1, 2)):
        cmd = [HOSTS, "run", TAG, str(h), *base, "--node_rank", str(i), os.path.join(HERE, "ddp_vit.py"), "--steps", str(steps)]
        if fp16:
            cmd.append("--fp16-hook")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit("DDP run failed: " + e[-2000:])
    line = [l for l in outs[0][0].splitlines() if "{" in l][-1]
    return json.loads(line[line.index("{"):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="10gbit,1gbit,100mbit")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--wire", default="fp32")
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--no-ddp", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="extra dtactor config KEY=VALUE (repeatable)")
    ap.add_argument("--out", default=os.path.join(HERE, "hosts_results.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts.py: needs root (network namespaces)")
    log_dir = tempfile.mkdtemp(prefix="bench-hosts-")
    results = {"config": "ViT default (examples/vit_fashion_mnist.toml model), global batch 128, 2 hosts x 1 rank, 1 thread per rank",
               "steps": a.steps, "repeats": a.repeats, "dtactor_sets": a.set, "caps": {}}
    for cap in each_cap(TAG, a.caps.split(",")):
        r = {}
        for rep in range(a.repeats):
            for wire in a.wire.split(","):
                r.setdefault("dtactor_" + wire, []).append(run_dtactor(a.dtactor, a.steps, wire, log_dir, a.set))
            if not a.no_ddp:
                r.setdefault("ddp", []).append(run_ddp(a.steps, False))
                r.setdefault("ddp_fp16_hook", []).append(run_ddp(a.steps, True))
        summary = {}
        for k, runs in r.items():
            summary[k] = {"samples_per_s": statistics.median(x["samples_per_s"] for x in runs), "runs": runs}
            if "allreduce_s" in runs[0]:
                summary[k]["allreduce_s"] = statistics.median(x["allreduce_s"] for x in runs)
                summary[k]["allreduce_exposed_s"] = statistics.median(x["allreduce_exposed_s"] for x in runs)
        if "ddp" in summary and "dtactor_fp32" in summary:
            summary["fp32_vs_ddp"] = summary["dtactor_fp32"]["samples_per_s"] / summary["ddp"]["samples_per_s"]
        if "ddp_fp16_hook" in summary and "dtactor_bf16" in summary:
            summary["bf16_vs_ddp_fp16_hook"] = summary["dtactor_bf16"]["samples_per_s"] / summary["ddp_fp16_hook"]["samples_per_s"]
        report_cap(results, cap, summary)
    F = bench_meta.figure
    figures = []
    for cap in results["caps"]:
        for wire, ddp, anchor in (("fp32", "ddp", "PyTorch DDP"), ("bf16", "ddp_fp16_hook", "DDP with its fp16 compression hook")):
            figures.append(F("%s: samples/s%s" % (cap, "" if wire == "fp32" else " with the bf16 wire"),
                             ["caps", cap, "dtactor_" + wire, "samples_per_s"], "samples/s", anchor, ["caps", cap, ddp, "samples_per_s"]))
    figures.sort(key=lambda f: "bf16" in f["what"])
    write_results(results, a.out,
                  "Two hosts (network namespaces) x 1 rank over capped links against PyTorch DDP under torchrun, the ViT, %d repeats"
                  % a.repeats, figures)


if __name__ == "__main__":
    main()
