#!/usr/bin/python3.11
"""DiLoCo over thin links: two node hosts (one rank each, one compute
thread each) and a coordinator host, network namespaces on a test switch
(scripts/netns/hosts.sh), every link capped by tbf at each rate. For each
cap, side by side: train.sync = every_step (fp32 and the bf16 wire) and
train.sync = diloco (train.sync_every = H, fp32 and bf16 pseudo-gradients),
and Streaming DiLoCo (mode "streaming": train.sync = diloco with
train.sync_fragments = --fragments, the default overlap of one step and
mix 0.5), the ViT's default model and global batch.

Figures per run: samples/s over the steady part (steps after the first
fifth: samples / wall time between the journal's step events, so a
window's synchronisation counts, unlike a median of per-step figures),
medians over --repeats runs (the modes interleaved in every round),
payload bytes a rank hands to the exchange per sample (every_step: the
gradients every step; diloco: the outer_step events' pseudo-gradients),
the share of the time the link was busy (diloco: outer_step exchange_s /
window_s), and the final evaluation (accuracy at equal samples).

Usage (root): bench/diloco_links.py [--caps 10gbit,100mbit,10mbit]
  [--steps 200] [--every 50] [--repeats 1] [--modes every_step:fp32,every_step:bf16,diloco:fp32,diloco:bf16,streaming:int8]
  [--fragments 5] [--hosts 2] [--every-step-first-cap-only | --every-step-caps 10gbit,100mbit]
  [--dtactor build/dtactor] [--out bench/diloco_links_results.json]
Prints one JSON line per run and writes the whole JSON at the end."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_hosts import HOSTS, each_cap  # noqa: E402

TAG = "dtdl"
EVAL = "eval"
# Bytes a rank sends per fp32 byte of payload: bf16 half; int8 one byte a
# value and a 4-byte scale per 256 values.
WIRE_FACTOR = {"fp32": 1.0, "bf16": 0.5, "int8": (1 + 4 / 256) / 4, "int4": (0.5 + 4 / 64) / 4}


def run(binary, steps, sync, wire, every, log_dir, name, fragments=1, n_hosts=2):
    with tempfile.TemporaryDirectory() as rd:
        sets = ["train.max_steps=%d" % steps, "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=1",
                "cluster.min_nodes=%d" % n_hosts, "cluster.max_nodes=%d" % n_hosts, "train.sync=" + ("diloco" if sync == "streaming" else sync), "train.sync_every=%d" % every,
                "cluster.wire_dtype=" + wire]
        if sync == "streaming":
            sets.append("train.sync_fragments=%d" % fragments)
        args = [x for s in sets for x in ("--set", s)]
        logs = [open(os.path.join(log_dir, name + n), "w") for n in ["coordinator.log"] + ["node%d.log" % h for h in range(1, n_hosts + 1)]]
        coord = subprocess.Popen([HOSTS, "run", TAG, "0", binary, "--role", "coordinator", "--listen", "tcp://198.18.0.1:29400", "--run-dir", rd,
                                  "--no-resume", *args], stdout=logs[0], stderr=subprocess.STDOUT)
        nodes = [subprocess.Popen([HOSTS, "run", TAG, str(h), binary, "--role", "node", "--coordinator", "tcp://198.18.0.1:29400", "--node-id",
                                   "n%d" % h, "--threads-per-rank", "1"], stdout=logs[h], stderr=subprocess.STDOUT) for h in range(1, n_hosts + 1)]
        rc = coord.wait(timeout=3600)
        for n in nodes:
            n.wait(timeout=120)
        if rc != 0:
            raise SystemExit("dtactor run %s failed (exit %d); logs in %s" % (name, rc, log_dir))
        journal = [json.loads(l) for l in open(os.path.join(rd, "journal.jsonl"))]
    steps_ev = [e for e in journal if e["event"] == "step" and e["world_size"] == n_hosts]
    steady = [e for e in steps_ev if e["step"] >= steps // 5]
    first, last = steady[0], steady[-1]
    batch = 128
    sps = (last["step"] - first["step"]) * batch / (last["t"] - first["t"])
    outer = [e for e in journal if e["event"] == "outer_step"]
    res = [e for e in journal if e["event"] == "resources"]
    param_bytes = None
    for e in res:
        for r in e.get("ranks", []):
            param_bytes = param_bytes or r.get("param_bytes")
    evals = [e for e in journal if e["event"] == EVAL]
    out = {"samples_per_s": round(sps, 1), "final_metrics": {k: v for k, v in evals[-1].items() if isinstance(v, float) and k not in ("t", "duration_s")} if evals else {}}
    if outer:
        # What crossed over the run per sample trained (streaming: each
        # event is one fragment's exchange).
        payload = sum(e["payload_bytes"] for e in outer)
        out["payload_bytes_per_sample"] = round(payload / (outer[-1]["step"] * batch) * WIRE_FACTOR[wire], 2)
        out["outer_steps"] = len(outer)
        out["exchange_s_median"] = round(statistics.median(e["exchange_s"] for e in outer), 4)
        out["link_busy"] = round(sum(e["exchange_s"] for e in outer) / max(1e-9, sum(e["window_s"] for e in outer)), 4)
    elif param_bytes:
        out["payload_bytes_per_sample"] = round(param_bytes / batch * WIRE_FACTOR[wire], 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="10gbit,100mbit,10mbit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", default="every_step:fp32,every_step:bf16,diloco:fp32,diloco:bf16")
    ap.add_argument("--fragments", type=int, default=5)
    ap.add_argument("--hosts", type=int, default=2, help="node hosts (one rank each)")
    ap.add_argument("--every-step-caps", default="", help="run the every_step modes only at these caps (comma-separated)")
    ap.add_argument("--every-step-first-cap-only", action="store_true",
                    help="run the every_step modes at the first cap only (the uncapped baseline), not over the thin links")
    ap.add_argument("--dtactor", default=os.path.join(os.path.dirname(HERE), "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "diloco_links_results.json"))
    a = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="diloco-links-")
    results = {"setup": "%d node hosts x 1 rank (1 thread) + a coordinator host, tbf on every link; ViT default model, global batch 128" % a.hosts,
               "steps": a.steps, "sync_every": a.every, "fragments": a.fragments, "logs": log_dir, "caps": {}}
    modes = [m.split(":") for m in a.modes.split(",")]
    for cap in each_cap(TAG, a.caps.split(","), a.hosts + 1):
        runs = {}
        # Repeats interleaved: every mode once per round.
        for rep in range(a.repeats):
            for sync, wire in modes:
                if a.every_step_first_cap_only and sync == "every_step" and cap != a.caps.split(",")[0]:
                    continue
                if a.every_step_caps and sync == "every_step" and cap not in a.every_step_caps.split(","):
                    continue
                name = "%s %s" % (sync, wire)
                r = run(a.dtactor, a.steps, sync, wire, a.every, log_dir, "%s-%s-%s-%d-" % (cap, sync, wire, rep), a.fragments, a.hosts)
                runs.setdefault(name, []).append(r)
                print(json.dumps({cap: {name: r}}), flush=True)
        results["caps"][cap] = {}
        for name, rs in runs.items():
            m = dict(rs[len(rs) // 2])
            m["samples_per_s"] = statistics.median(r["samples_per_s"] for r in rs)
            m["samples_per_s_runs"] = [r["samples_per_s"] for r in rs]
            if "link_busy" in rs[0]:
                m["link_busy"] = statistics.median(r["link_busy"] for r in rs)
            results["caps"][cap][name] = m
    base = results["caps"].get(a.caps.split(",")[0], {}).get("every_step fp32")
    if base:
        results["ratio_to_first_cap_every_step_fp32"] = {cap: {m: round(v["samples_per_s"] / base["samples_per_s"], 3) for m, v in runs.items()}
                                                        for cap, runs in results["caps"].items()}
    # The page's figures: every mode at the thinnest cap, against every_step
    # fp32 at that cap where it ran there, else uncapped (the first cap).
    F = bench_meta.figure
    caps = a.caps.split(",")
    first, last = caps[0], caps[-1]
    figures = []
    at_last = results["caps"].get(last, {})
    if "every_step fp32" in at_last:
        anchor, anchor_at = "every_step fp32 at %s" % last, ["caps", last, "every_step fp32", "samples_per_s"]
    else:
        anchor, anchor_at = "every_step fp32 uncapped (%s)" % first, ["caps", first, "every_step fp32", "samples_per_s"]
    for name in at_last:
        if name == "every_step fp32" and anchor_at[1] == last:
            continue
        has_anchor = base is not None
        figures.append(F("%s: samples/s, %s" % (last, name), ["caps", last, name, "samples_per_s"], "samples/s",
                         anchor if has_anchor else None, anchor_at if has_anchor else None))
        if has_anchor and not name.startswith("every_step"):
            figures.append(F("%s: %s over the uncapped synchronous throughput" % (last, name),
                             ["ratio_to_first_cap_every_step_fp32", last, name], "x"))
    bench_meta.write(a.out, results, "%s over capped links: %d namespace hosts x 1 rank, %d steps, H = %d, %d repeat(s)"
                     % (", ".join(sorted({s for s, _ in modes})), a.hosts, a.steps, a.every, a.repeats), "DiLoCo and thin links", figures)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
