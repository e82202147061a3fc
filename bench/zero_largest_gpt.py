#!/usr/bin/python3.11
"""The largest GPT this machine trains at world 4 (2 nodes x 2 ranks,
`dtactor local`) with train.zero = 0, 1 and 2 (issue 26).

For each level: two GPT sizes (dim 1024, 16 heads, context 32; the layer
count varies, 12.6M parameters a layer) run a few steps each while this
script samples the machine's memory in use (MemTotal - MemAvailable, every
0.1 s: shared-memory segments counted once, unlike the ranks' summed RSS);
a line through the two peaks (bytes above the idle machine against
parameters) predicts the most layers that fit in the machine's memory less
a margin; that size is then run, then one layer more while it fits (or one less
while it does not), so that a size that fits and one that does not bracket
the answer (a watchdog ends a run when MemAvailable drops below the margin, so
the machine never reaches the OOM killer). Prints one JSON object.

Usage: bench/zero_largest_gpt.py [--levels 0,1,2] [--probe-layers 4,8]
       [--steps 3] [--margin-gib 1.5] [--set key=value ...]
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "dtactor"))
ap.add_argument("--levels", default="0,1,2")
ap.add_argument("--probe-layers", default="4,8")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--nproc-per-node", type=int, default=2)
ap.add_argument("--margin-gib", type=float, default=1.5)
ap.add_argument("--max-tries", type=int, default=4)
ap.add_argument("--set", action="append", default=[])
a = ap.parse_args()
GiB = 1 << 30


def meminfo():
    m = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            m[k] = int(v.split()[0]) * 1024
    return m


def job(layers, zero):
    return ["model.name=gpt", "model.dim=1024", f"model.layers={layers}", "model.heads=16", "model.context=32",
            "train.global_batch_size=4", "train.micro_batch_size=1", "train.warmup_steps=1", "train.log_every_steps=1",
            "checkpoint.every_steps=0", "eval.every_steps=0", "eval.max_samples=8", "data.max_text_bytes=2000000",
            f"train.max_steps={a.steps}", f"cluster.min_nodes={a.nodes}", f"cluster.max_nodes={a.nodes}", "cluster.settle_ms=600000",
            f"train.zero={zero}"] + a.set


def run(layers, zero):
    d = tempfile.mkdtemp(prefix="dtactor-zlarge-")
    argv = [a.bin, "local", "--nodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--run-dir", d, "--no-resume"]
    for s in job(layers, zero):
        argv += ["--set", s]
    idle = meminfo()
    idle_used = idle["MemTotal"] - idle["MemAvailable"]
    peak = [idle_used]
    killed = [False]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    done = threading.Event()

    def watch():
        while not done.is_set():
            m = meminfo()
            peak[0] = max(peak[0], m["MemTotal"] - m["MemAvailable"])
            if m["MemAvailable"] < a.margin_gib * GiB / 2 and not killed[0]:
                killed[0] = True
                # every process of the run: each has a process group of its
                # own, all share the session started for it
                subprocess.run(["pkill", "-KILL", "-s", str(p.pid)])
            time.sleep(0.1)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.time()
    out = p.communicate()[0]
    done.set()
    t.join()
    # The next run starts once nothing of this one is left (a rank ends
    # when it notices its node gone).
    while subprocess.run(["pgrep", "-s", str(p.pid)], stdout=subprocess.DEVNULL).returncode == 0:
        time.sleep(0.2)
    wall = time.time() - t0
    params, steps, rss_peak = None, [], 0.0
    try:
        with open(os.path.join(d, "journal.jsonl")) as f:
            for line in f:
                e = json.loads(line)
                if e.get("event") == "step":
                    steps.append(e)
                elif e.get("event") == "resources":
                    for r in e.get("ranks", []):
                        rss_peak = max(rss_peak, r.get("peak_rss_bytes") or 0)
                        if r.get("param_bytes"):
                            params = r["param_bytes"] // 4  # fp32: every rank holds every parameter
    except FileNotFoundError:
        pass
    subprocess.run(["rm", "-rf", d])
    ok = p.returncode == 0 and not killed[0] and any(s["step"] >= a.steps for s in steps)
    gaps = [b["t"] - x["t"] for x, b in zip(steps, steps[1:]) if b["step"] == x["step"] + 1]
    row = {"layers": layers, "zero": zero, "parameters": params, "ok": ok, "killed_for_memory": killed[0], "exit": p.returncode,
           "peak_used_above_idle_bytes": peak[0] - idle_used, "idle_used_bytes": idle_used, "largest_rank_peak_rss_bytes": rss_peak,
           "last_step_s": gaps[-1] if gaps else None, "wall_s": wall}
    if not ok and not killed[0]:
        row["tail"] = out[-1500:]
    print(f"zero={zero} layers={layers}: {'ok' if ok else 'FAILED'} params={params} peak above idle "
          f"{(peak[0] - idle_used) / GiB:.2f} GiB, rank RSS peak {rss_peak / GiB:.2f} GiB, {wall:.0f} s", file=sys.stderr)
    return row


total = meminfo()["MemTotal"]
budget = total - a.margin_gib * GiB
probes = [int(x) for x in a.probe_layers.split(",")]
out = {"what": "largest GPT (dim 1024, 16 heads, context 32) trained at world "
               f"{a.nodes * a.nproc_per_node} ({a.nodes} nodes x {a.nproc_per_node} ranks, dtactor local) per train.zero level; "
               "memory = the machine's MemTotal - MemAvailable above idle, sampled every 0.1 s",
       "mem_total_bytes": total, "margin_gib": a.margin_gib, "steps": a.steps, "settings": a.set, "levels": {}}
for zero in [int(x) for x in a.levels.split(",")]:
    rows = [run(L, zero) for L in probes]
    good = [r for r in rows if r["ok"]]
    lvl = {"probes": rows}
    if len(good) == 2 and good[1]["parameters"] != good[0]["parameters"]:
        (r0, r1) = good
        slope = (r1["peak_used_above_idle_bytes"] - r0["peak_used_above_idle_bytes"]) / (r1["parameters"] - r0["parameters"])
        per_layer = (r1["parameters"] - r0["parameters"]) / (r1["layers"] - r0["layers"])
        base_params = r0["parameters"] - per_layer * r0["layers"]
        fixed = r0["peak_used_above_idle_bytes"] - slope * r0["parameters"]
        room = budget - r0["idle_used_bytes"] - fixed
        predicted = int((room / slope - base_params) // per_layer)
        lvl.update({"bytes_per_parameter_machine": slope, "fixed_bytes": fixed, "predicted_layers": predicted,
                    "predicted_parameters": int(base_params + per_layer * predicted)})
        # From the prediction: up one layer at a time while it fits, down
        # while it does not, so that the answer is bracketed by a run that
        # fits and one that does not.
        tries = []
        L = max(predicted, probes[-1] + 1)
        first = run(L, zero)
        tries.append(first)
        step = 1 if first["ok"] else -1
        while len(tries) < a.max_tries:
            L += step
            if L <= probes[-1]:
                break
            r = run(L, zero)
            tries.append(r)
            if r["ok"] != first["ok"]:
                break
        lvl["tries"] = tries
        fit = [r for r in tries if r["ok"]]
        over = [r for r in tries if not r["ok"]]
        best = max(fit, key=lambda r: r["layers"]) if fit else good[-1]
        lvl["largest_layers"] = best["layers"]
        lvl["largest_parameters"] = best["parameters"]
        lvl["largest_verified"] = bool(fit)
        lvl["smallest_not_fitting_layers"] = min(r["layers"] for r in over) if over else None
    out["levels"][str(zero)] = lvl
if "0" in out["levels"] and out["levels"]["0"].get("largest_parameters"):
    base = out["levels"]["0"]["largest_parameters"]
    for k, v in out["levels"].items():
        if v.get("largest_parameters"):
            v["largest_over_zero0"] = v["largest_parameters"] / base
F = bench_meta.figure
figures = []
for k, v in out["levels"].items():
    if not v.get("largest_verified"):
        continue
    anchor = k != "0" and out["levels"].get("0", {}).get("largest_verified")
    figures.append(F("largest GPT, zero=%s" % k, ["levels", k, "largest_parameters"], "parameters", "zero=0" if anchor else None,
                     ["levels", "0", "largest_parameters"] if anchor else None))
print(json.dumps(bench_meta.stamped(out, "The largest GPT that trains at world %d (%d nodes x %d ranks) by train.zero level%s"
                                    % (a.nodes * a.nproc_per_node, a.nodes, a.nproc_per_node, " (%s)" % ", ".join(a.set) if a.set else ""),
                                    "Sharded state (ZeRO)", figures), indent=1))
