#!/usr/bin/python3
"""The largest GPT that trains when every rank process has the same memory
cap, as an accelerator's fixed memory would give it: each rank runs in a
cgroup (v1 memory.limit_in_bytes, no swap) of its own, set before the rank
process starts. Per world size (`dtactor local`, 2 ranks a node) and
train.zero level, the layer count (dim 1024, 16 heads, context 32, 12.6M
parameters a layer; one sample a rank a step, as bench/zero_largest_gpt.py
runs it, so no rank accumulates gradients over micro-batches) is searched
until a size that trains --steps steps and one that does not bracket the
answer. A rank the kernel kills for memory
ends its run at once (the node would start it again).

Also per run, each rank's peak charge (memory.max_usage_in_bytes: resident
memory and the page cache it touched, such as the final checkpoint's files,
which the kernel reclaims under the cap) and the peak of what it cannot
reclaim without swap (anonymous memory and the shared-memory segments
charged to it, sampled every 0.25 s). The bytes a parameter per rank follow
from the two probes' anonymous peaks, and predict where the search starts.

Usage: bench/zero_capped_gpt.py [--cap-gib 2] [--worlds 4,8] [--levels 0,2,3]
       [--probe-layers 2,6] [--steps 2] [--max-tries 6] [--set key=value ...]
       [--out bench/zero_capped_gpt_results.json] [--update]
--update searches only the given worlds and levels again and keeps the
other entries of --out, which must have been run with the same cap, steps
and settings; the file's notes say which entries came from which run.
Needs root (it makes cgroups under /sys/fs/cgroup/memory).
"""
import argparse, json, os, shutil, signal, stat, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "dtactor"))
ap.add_argument("--cap-gib", type=float, default=2.0)
ap.add_argument("--worlds", default="4,8")
ap.add_argument("--levels", default="0,2,3")
ap.add_argument("--probe-layers", default="2,6")
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--max-tries", type=int, default=6)
ap.add_argument("--timeout-s", type=float, default=900)
ap.add_argument("--set", action="append", default=[])
ap.add_argument("--out", default=os.path.join(HERE, "zero_capped_gpt_results.json"))
ap.add_argument("--update", action="store_true",
                help="search only --worlds x --levels again and keep the other entries of --out (same cap, steps and settings)")
a = ap.parse_args()
GiB = 1 << 30
CAP = int(a.cap_gib * GiB)
CG_ROOT = "/sys/fs/cgroup/memory"


def job(layers, zero, nodes):
    return ["model.name=gpt", "model.dim=1024", f"model.layers={layers}", "model.heads=16", "model.context=32",
            f"train.global_batch_size={2 * nodes}", "train.micro_batch_size=1", "train.warmup_steps=1", "train.log_every_steps=1",
            "checkpoint.every_steps=0", "eval.every_steps=0", "eval.max_samples=8", "data.max_text_bytes=2000000",
            f"train.max_steps={a.steps}", f"cluster.min_nodes={nodes}", f"cluster.max_nodes={nodes}", "cluster.settle_ms=600000",
            f"train.zero={zero}"] + a.set


def wrapper(dirpath, parent):
    """DTACTOR_TRAIN_BINARY: a rank process joins a memory cgroup of its own
    under `parent`, capped, then becomes dtactor-train."""
    real = os.path.join(os.path.dirname(os.path.abspath(a.bin)), "dtactor-train")
    path = os.path.join(dirpath, "capped-train")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                f'cg={parent}/rank-$$\n'
                'mkdir "$cg" || exit 70\n'
                f'echo {CAP} > "$cg/memory.limit_in_bytes" || exit 70\n'
                'echo $$ > "$cg/cgroup.procs" || exit 70\n'
                f'exec {real} "$@"\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def read(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def oom_kills(cg):
    for line in read(os.path.join(cg, "memory.oom_control")).splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


def anon_bytes(cg):
    """What the kernel cannot reclaim from a rank under its cap (no swap):
    its anonymous memory and the shared memory charged to it."""
    v = {}
    for line in read(os.path.join(cg, "memory.stat")).splitlines():
        k, _, n = line.partition(" ")
        if k in ("rss", "shmem"):
            v[k] = int(n)
    return v.get("rss", 0) + v.get("shmem", 0)


def ranks_of(parent):
    return [os.path.join(parent, n) for n in sorted(os.listdir(parent)) if n.startswith("rank-")] if os.path.isdir(parent) else []


def run(layers, zero, nodes):
    d = tempfile.mkdtemp(prefix="dtactor-capped-")
    parent = os.path.join(CG_ROOT, "dtactor-capped-%d-%d" % (os.getpid(), time.monotonic_ns()))
    os.mkdir(parent)
    env = dict(os.environ, DTACTOR_TRAIN_BINARY=wrapper(d, parent))
    argv = [a.bin, "local", "--nodes", str(nodes), "--nproc-per-node", "2", "--run-dir", os.path.join(d, "run"), "--no-resume"]
    for s in job(layers, zero, nodes):
        argv += ["--set", s]
    log = open(os.path.join(d, "out.log"), "w")
    t0 = time.time()
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    killed = timed_out = False
    anon_peak = {}
    while p.poll() is None:
        for cg in ranks_of(parent):
            anon_peak[cg] = max(anon_peak.get(cg, 0), anon_bytes(cg))
        if any(oom_kills(cg) for cg in ranks_of(parent)):
            killed = True
        elif time.time() - t0 > a.timeout_s:
            timed_out = True
        if killed or timed_out:
            subprocess.run(["pkill", "-KILL", "-s", str(p.pid)])
            p.wait()
            break
        time.sleep(0.25)
    while subprocess.run(["pgrep", "-s", str(p.pid)], stdout=subprocess.DEVNULL).returncode == 0:
        time.sleep(0.2)
    wall = time.time() - t0
    ranks = [{"peak_bytes": int(read(os.path.join(cg, "memory.max_usage_in_bytes"), "0") or 0), "anon_peak_bytes": anon_peak.get(cg, 0),
              "oom_kills": oom_kills(cg)} for cg in ranks_of(parent)]
    killed = killed or any(r["oom_kills"] for r in ranks)
    for cg in ranks_of(parent):
        os.rmdir(cg)
    os.rmdir(parent)
    steps, params = [], None
    for line in read(os.path.join(d, "run", "journal.jsonl")).splitlines():
        e = json.loads(line)
        if e.get("event") == "step":
            steps.append(e["step"])
        elif e.get("event") == "resources" and (zero == 0 or (zero <= 2 and "train.precision=bf16" not in a.set)):
            for r in e.get("ranks", []):
                if r.get("param_bytes"):
                    # every parameter on every rank below zero 3 (but bf16's masters from zero 1 on):
                    # fp32 4 bytes each, bf16 6 (the masters and the copy)
                    params = r["param_bytes"] // (6 if "train.precision=bf16" in a.set else 4)
    ok = p.returncode == 0 and not killed and max(steps, default=0) >= a.steps
    row = {"layers": layers, "zero": zero, "world": 2 * nodes, "ok": ok, "killed_for_memory": killed, "timed_out": timed_out,
           "exit": p.returncode, "parameters_read": params, "rank_processes": len(ranks),
           "largest_rank_peak_bytes": max((r["peak_bytes"] for r in ranks), default=0),
           "largest_rank_anon_peak_bytes": max((r["anon_peak_bytes"] for r in ranks), default=0), "ranks": ranks, "wall_s": round(wall, 1)}
    if not ok and not killed:
        row["tail"] = read(os.path.join(d, "out.log"))[-1500:]
    shutil.rmtree(d, ignore_errors=True)
    print(f"world={2 * nodes} zero={zero} layers={layers}: {'ok' if ok else 'FAILED'}{' (memory)' if killed else ''} "
          f"peak rank {row['largest_rank_peak_bytes'] / GiB:.2f} GiB (anonymous {row['largest_rank_anon_peak_bytes'] / GiB:.2f}), {wall:.0f} s", file=sys.stderr, flush=True)
    return row


def search(zero, nodes, per_layer, base):
    """Two probes give each rank's peak against parameters; from the size
    the line predicts, up while it trains (to where the two largest sizes
    that trained predict the cap, at least a layer), halfway down to the
    largest that trained while it does not. When the larger probe does not
    train, down from it."""
    probes = [run(L, zero, nodes) for L in [int(x) for x in a.probe_layers.split(",")]]
    lvl = {"probes": probes}
    good = [r for r in probes if r["ok"]]
    if not probes[0]["ok"]:
        lvl["error"] = "the smaller probe did not train under the cap"
        return lvl
    if len(good) == 2:
        r0, r1 = good
        n0, n1 = base + per_layer * r0["layers"], base + per_layer * r1["layers"]
        slope = (r1["largest_rank_anon_peak_bytes"] - r0["largest_rank_anon_peak_bytes"]) / (n1 - n0)
        fixed = r0["largest_rank_anon_peak_bytes"] - slope * n0
        predicted = int(((CAP - fixed) / slope - base) // per_layer)
        lvl.update({"bytes_per_parameter_per_rank": slope, "fixed_bytes_per_rank": fixed, "predicted_layers": predicted})
        L, floor = max(predicted, r1["layers"] + 1), r1["layers"]
    else:
        L, floor = probes[1]["layers"] - 1, probes[0]["layers"]
    tries = []

    def bracketed():
        ok = {r["layers"] for r in tries + probes if r["ok"]}
        return any(r["layers"] - 1 in ok for r in tries + probes if not r["ok"])

    def next_layers(L, r):
        # Down after a size that did not train: halfway to the largest that
        # did (a jump up can overshoot). Up: to where the two largest sizes
        # that trained, nearer the cap than the probes, put the cap (their
        # anonymous peaks against layers), never past a size known not to
        # train; at least one layer up.
        ok = sorted((x for x in tries + good if x["ok"]), key=lambda x: x["layers"])
        over = [x["layers"] for x in tries + probes if not x["ok"]]
        if not r["ok"]:
            below = ok[-1]["layers"] if ok else floor
            return max(below + 1, (below + L) // 2)
        if len(ok) < 2:
            return L + 1
        lo, hi = ok[-2], ok[-1]
        slope = (hi["largest_rank_anon_peak_bytes"] - lo["largest_rank_anon_peak_bytes"]) / (hi["layers"] - lo["layers"])
        if slope <= 0:
            return L + 1
        predicted = hi["layers"] + int((CAP - hi["largest_rank_anon_peak_bytes"]) // slope)
        return max(L + 1, min(predicted, min(over, default=predicted + 1) - 1))

    while len(tries) < a.max_tries and L > floor and not bracketed():
        r = run(L, zero, nodes)
        tries.append(r)
        L = next_layers(L, r)
    lvl["tries"] = tries
    fit = [r for r in tries + good if r["ok"]]
    over = [r for r in tries + probes if not r["ok"]]
    best = max(fit, key=lambda r: r["layers"])
    lvl.update({"largest_layers": best["layers"], "largest_parameters": int(base + per_layer * best["layers"]),
                "largest_rank_peak_bytes": best["largest_rank_peak_bytes"], "largest_rank_anon_peak_bytes": best["largest_rank_anon_peak_bytes"],
                "smallest_not_fitting_layers": min((r["layers"] for r in over), default=None),
                "bracketed": bracketed()})
    return lvl


def main():
    if os.geteuid() != 0 or not os.path.isdir(CG_ROOT):
        sys.exit("zero_capped_gpt: needs root and cgroup v1's memory controller at " + CG_ROOT)
    worlds = [int(x) for x in a.worlds.split(",")]
    # The parameter count of a layer and of the rest, from two zero = 0 runs at world 2 (not capped).
    sizes = []
    for L in (1, 2):
        parent_free = run_uncapped(L)
        sizes.append(parent_free)
    per_layer, base = sizes[1] - sizes[0], sizes[0] - (sizes[1] - sizes[0])
    out = {"cap_bytes": CAP, "steps": a.steps, "settings": a.set, "parameters_per_layer": per_layer, "parameters_outside_layers": base,
           "worlds": {}}
    earlier = None
    if a.update:
        with open(a.out) as f:
            earlier = json.load(f)
        if (earlier["cap_bytes"], earlier["steps"], earlier["settings"]) != (CAP, a.steps, a.set):
            sys.exit("zero_capped_gpt: --update needs the cap, steps and settings of " + a.out)
        out["worlds"] = earlier["worlds"]
        out["searched_again"] = earlier.get("searched_again", [])
    for w in worlds:
        for z in [int(x) for x in a.levels.split(",")]:
            out["worlds"].setdefault(str(w), {})[str(z)] = search(z, w // 2, per_layer, base)
            if earlier:
                out["searched_again"] = [x for x in out["searched_again"] if (x["world"], x["zero"]) != (w, z)]
                out["searched_again"].append({"world": w, "zero": z, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if earlier and "searched_again" not in earlier:  # the first update: what the rest came from
        out["kept_from"] = {"command": earlier["meta"]["command"], "date": earlier["meta"]["date"],
                            "cpu": earlier["meta"].get("machine", {}).get("cpu")}
    elif earlier:
        out["kept_from"] = earlier.get("kept_from")
    F = bench_meta.figure
    figures = []
    for w, levels in out["worlds"].items():
        for z, v in levels.items():
            if "largest_parameters" not in v:
                continue
            anchor = z != "0" and "largest_parameters" in levels.get("0", {})
            figures.append(F(f"largest GPT at world {w}, zero={z}", ["worlds", w, z, "largest_parameters"], "parameters",
                             f"world {w}, zero=0" if anchor else None, ["worlds", w, "0", "largest_parameters"] if anchor else None))
            figures.append(F(f"the largest rank's peak bytes a parameter at world {w}, zero={z} (anonymous and shared memory, from the probes)",
                             ["worlds", w, z, "bytes_per_parameter_per_rank"], "B/param"))
    bench_meta.write(a.out, out, title="The largest GPT that trains with every rank process capped at %.1f GiB (a cgroup each), "
                     "at world %s, by train.zero level%s" % (a.cap_gib, " and ".join(sorted(out["worlds"], key=int)),
                                                             " (%s)" % ", ".join(a.set) if a.set else ""),
                     group="Sharded state (ZeRO)", figures=figures,
                     notes="One host (dtactor local, 2 ranks a node), each rank process in a memory cgroup (v1) of its own capped at "
                     "%.1f GiB, no swap; default settings apart from the model (GPT, dim 1024, 16 heads, context 32), one sample a rank a "
                     "step, %d steps, no checkpoint but the final one; a size fits when the job ends at its last step with no rank killed "
                     "for memory. Parameters are exact (from the journal's reported bytes). The bytes a parameter are the largest rank's "
                     "anonymous and shared-memory peak between the two probes, start-up included." % (a.cap_gib, a.steps) + again(out))


def again(out):
    """--update: which entries this command searched again, and where the rest came from."""
    if not out.get("searched_again"):
        return ""
    which = ", ".join("world %d zero=%d" % (x["world"], x["zero"]) for x in out["searched_again"])
    return (" Searched again with --update: %s (searched_again); the other entries are from %s, run %s on a %s."
            % (which, out["kept_from"]["command"], out["kept_from"]["date"], out["kept_from"].get("cpu") or "machine not recorded"))


def run_uncapped(layers):
    """Parameters of a GPT with `layers` layers: a one-step run at world 2."""
    global CAP
    saved, CAP = CAP, 64 * GiB
    try:
        r = run(layers, 0, 1)
    finally:
        CAP = saved
    if not r["parameters_read"]:
        sys.exit("zero_capped_gpt: no parameter count from a %d-layer run: %s" % (layers, r.get("tail", "")))
    return r["parameters_read"]


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main()
