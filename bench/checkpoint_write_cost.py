#!/usr/bin/python3.11
"""What a checkpoint costs the steps around it: checkpoint.direct = true (the
part read from the state while the next step computes its gradients; the
update waits for the write) against false (the default: copied into a kept
buffer, written in the background), or any two settings. `dtactor local`
on this machine, the same job, runs alternating A and B; per run the
checkpoints' median stall_s and write_s (checkpoint_saved), the time per
step from step 2 to the last step (checkpoints every --every steps
included: what they cost all told), and each rank's peak RSS. Prints one
JSON object: the runs, and the paired ratios' medians.

Usage: bench/checkpoint_write_cost.py [--pairs 3] [--steps 10] [--every 2]
       [--nodes 2] [--nproc-per-node 1] [--set key=value ...]
       [--a key=value ...] [--b key=value ...]
The default job is the 202M GPT (dim 1024, 16 layers; zero_gpt_throughput.py's)
with train.zero = 2 at world 2: a 2.4 GB checkpoint.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "dtactor"))
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--every", type=int, default=2)
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--nproc-per-node", type=int, default=1)
ap.add_argument("--set", action="append", default=[])
ap.add_argument("--a", action="append", default=None)
ap.add_argument("--b", action="append", default=None)
a = ap.parse_args()
A_SET = a.a or ["checkpoint.direct=true"]
B_SET = a.b or ["checkpoint.direct=false"]
job = ["model.name=gpt", "model.dim=1024", "model.layers=16", "model.heads=16", "model.context=32", "train.global_batch_size=4",
       "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every_steps=1", f"checkpoint.every_steps={a.every}", "eval.every_steps=0",
       "eval.max_samples=8", "data.max_text_bytes=2000000", f"train.max_steps={a.steps}", "train.zero=2"] + a.set


def run(extra):
    d = tempfile.mkdtemp(prefix="dtactor-ckcost-")
    sets = []
    for s in job + extra:
        sets += ["--set", s]
    argv = [a.bin, "local", "--nodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--run-dir", d, "--no-resume", *sets]
    t0 = time.time()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        subprocess.run(["rm", "-rf", d])
        sys.exit(f"{' '.join(extra)} failed ({p.returncode}):\n" + p.stdout[-3000:])
    steps, saved, peak = {}, [], {}
    with open(os.path.join(d, "journal.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step":
                steps[e["step"]] = e["t"]
            elif e.get("event") == "checkpoint_saved":
                saved.append(e)
            elif e.get("event") == "resources":
                for r in e["ranks"]:
                    peak[r["rank"]] = max(peak.get(r["rank"], 0), r["peak_rss_bytes"])
    subprocess.run(["rm", "-rf", d])
    last = max(steps)
    if 2 not in steps or last <= 2:
        sys.exit(f"{' '.join(extra)}: journaled steps {sorted(steps)}")
    # The checkpoints written between steps (the final one, after the last
    # step, costs no step).
    mid = [e for e in saved if e["step"] < last]
    return {"per_step_s": (steps[last] - steps[2]) / (last - 2), "stall_s_median": statistics.median(e["stall_s"] for e in mid),
            "write_s_median": statistics.median(e["write_s"] for e in mid), "checkpoints": len(saved), "bytes": saved[-1].get("bytes"),
            "wall_s": wall, "peak_rss_bytes_by_rank": [peak[r] for r in sorted(peak)]}


rows = []
for i in range(a.pairs):
    A = run(A_SET)
    B = run(B_SET)
    rows.append({"A": A, "B": B, "per_step_ratio": A["per_step_s"] / B["per_step_s"]})
    print(f"pair {i}: A {A['per_step_s']:.3f} s/step (stall {A['stall_s_median']:.2f}, write {A['write_s_median']:.2f}), "
          f"B {B['per_step_s']:.3f} s/step (stall {B['stall_s_median']:.2f}, write {B['write_s_median']:.2f})", file=sys.stderr)
med = lambda k, w: statistics.median(r[w][k] for r in rows)
result = {"a": A_SET, "b": B_SET, "job": job, "nodes": a.nodes, "nproc_per_node": a.nproc_per_node,
          "per_step_ratio_median": statistics.median(r["per_step_ratio"] for r in rows),
          "a_per_step_s_median": med("per_step_s", "A"), "b_per_step_s_median": med("per_step_s", "B"),
          "a_stall_s_median": med("stall_s_median", "A"), "b_stall_s_median": med("stall_s_median", "B"),
          "a_peak_rss_max": max(max(r["A"]["peak_rss_bytes_by_rank"]) for r in rows),
          "b_peak_rss_max": max(max(r["B"]["peak_rss_bytes_by_rank"]) for r in rows), "runs": rows}
F = bench_meta.figure
B_NAME = " ".join(B_SET)
print(json.dumps(bench_meta.stamped(result, "%s against %s: world %d, a checkpoint every %d steps, %d pairs"
                                    % (" ".join(A_SET), B_NAME, a.nodes * a.nproc_per_node, a.every, a.pairs),
                                    "Checkpoints and the state path", [
    F("time a step, checkpoints included (median)", ["a_per_step_s_median"], "s", B_NAME, ["b_per_step_s_median"]),
    F("A over B, time a step (median of the pairs)", ["per_step_ratio_median"], "x"),
    F("training stalled for a checkpoint (median)", ["a_stall_s_median"], "s", B_NAME, ["b_stall_s_median"]),
    F("peak resident memory of a rank", ["a_peak_rss_max"], "bytes", B_NAME, ["b_peak_rss_max"])]), indent=1))
