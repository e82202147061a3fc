#!/usr/bin/python3.11
"""Step throughput of the 202M GPT with train.zero = 2 against zero = 0
(issue 26), or any two settings: `dtactor local` on this machine, N nodes x
P ranks, the same job, runs alternating A (zero=2) and B (zero=0); per run the median time
between consecutive journaled steps after the first two (start-up, the
first step's allocations and the reshard excluded), then the paired ratios'
median, and each run's peak RSS per rank from the journal's resources
events. Prints one JSON object.

Usage: bench/zero_gpt_throughput.py [--pairs 3] [--steps 8] [--nodes 2]
       [--nproc-per-node 1] [--set key=value ...]
       [--a key=value ...] [--b key=value ...] [--hosts [--cap RATE] [--kill-at-step K]]
--hosts (root): the nodes on separate network-namespace hosts
(scripts/netns/hosts.sh), the coordinator on a host of its own, each link
capped at --cap (default 10gbit) by tbf: 2 nodes x 2 ranks is the issue's
"world 4 = 2 hosts x 2 ranks", hierarchical by default.
--kill-at-step K (with --hosts): once step K is journaled, kill -9 of every
process on the last node's host; the step time is then taken before the
kill, and each run reports the first step at the smaller world after it,
the steps lost, where the optimizer state came from and the recovery's
phases.
--a / --b replace what A and B set (default train.zero=2 / train.zero=0):
e.g. --a cluster.shm_ring_mb=64 --b cluster.shm_ring_mb=4096 measures what
the shared-memory ring's bound costs at zero = 0; an item env:NAME=VALUE
goes into that run's environment instead (e.g. GLIBC_TUNABLES), and an
item bin:PATH runs that side with another build's dtactor (its libraries
from its own directory): --a train.zero=2 --b train.zero=2 --b bin:OLD
is a paired A/B of two builds on the same job.
The default job is bench_state_path.py's GPT (dim 1024, 16 layers, 16
heads, context 32, global batch 4 in micro-batches of 2); zero=0 at world 2
needs about 13 GB.
"""
import argparse, json, os, signal, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "dtactor"))
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--nproc-per-node", type=int, default=1)
ap.add_argument("--set", action="append", default=[])
ap.add_argument("--a", action="append", default=None)
ap.add_argument("--b", action="append", default=None)
ap.add_argument("--hosts", action="store_true")
ap.add_argument("--cap", default="10gbit")
ap.add_argument("--kill-at-step", type=int, default=0,
                help="--hosts: once the journal shows this step, kill -9 every process on the last node's host; "
                     "the step time is then the steps' before it, and the run reports the recovery")
a = ap.parse_args()
A_SET = a.a or ["train.zero=2"]
B_SET = a.b or ["train.zero=0"]

job = ["model.name=gpt", "model.dim=1024", "model.layers=16", "model.heads=16", "model.context=32", "train.global_batch_size=4",
       "train.micro_batch_size=2", "train.warmup_steps=2", "train.log_every_steps=1", "checkpoint.every_steps=0", "eval.every_steps=0",
       "eval.max_samples=8", "data.max_text_bytes=2000000", f"train.max_steps={a.steps}", f"cluster.min_nodes={a.nodes}"] + a.set


HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "netns", "hosts.sh")
TAG = "dtzg"


class Done:
    def __init__(self, returncode, stdout):
        self.returncode, self.stdout = returncode, stdout


KILLED_AT = []  # the wall time of the last run's kill, when there was one


def kill_host_at_step(journal, coord):
    """kill -9 of everything on the last node's host (its node and ranks)
    once `journal` shows step a.kill_at_step."""
    KILLED_AT.clear()
    while coord.poll() is None:
        try:
            with open(journal) as f:
                if any(json.loads(x).get("event") == "step" and json.loads(x)["step"] >= a.kill_at_step for x in f):
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    else:
        return
    pids = subprocess.run(["ip", "netns", "pids", "%s-h%d" % (TAG, a.nodes)], capture_output=True, text=True).stdout.split()
    KILLED_AT.append(time.time())
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def on_hosts(argv_sets, d, env):
    """The coordinator on host 0, node i on host i; their output together."""
    outs = [tempfile.TemporaryFile("w+") for _ in range(a.nodes + 1)]
    coord = subprocess.Popen([HOSTS, "run", TAG, "0", a.bin, "--role", "coordinator", "--listen", "tcp://198.18.0.1:29400",
                              "--run-dir", d, "--no-resume", *argv_sets], stdout=outs[0], stderr=subprocess.STDOUT, env=env)
    nodes = [subprocess.Popen([HOSTS, "run", TAG, str(h), a.bin, "--role", "node", "--coordinator", "tcp://198.18.0.1:29400",
                               "--node-id", "n%d" % h, "--nproc-per-node", str(a.nproc_per_node)],
                              stdout=outs[h], stderr=subprocess.STDOUT, env=env) for h in range(1, a.nodes + 1)]
    killer = None
    if a.kill_at_step:
        killer = threading.Thread(target=kill_host_at_step, args=(os.path.join(d, "journal.jsonl"), coord))
        killer.start()
    rc = coord.wait()
    if killer:
        killer.join()
    for n in nodes:
        n.wait()
    text = ""
    for o in outs:
        o.seek(0)
        text += o.read()
    return Done(rc, text)


def run(extra):
    d = tempfile.mkdtemp(prefix="dtactor-zgpt-")
    sets = []
    env = dict(os.environ)
    binary = a.bin
    for s in job + extra:
        if s.startswith("bin:"):
            binary = os.path.abspath(s[4:])
            env["LD_LIBRARY_PATH"] = os.path.dirname(binary)
        elif s.startswith("env:"):
            k, v = s[4:].split("=", 1)
            env[k] = v
        else:
            sets += ["--set", s]
    t0 = time.time()
    if a.hosts:
        p = on_hosts(sets, d, env)
    else:
        argv = [binary, "local", "--nodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--run-dir", d, "--no-resume", *sets]
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(extra)} failed ({p.returncode}):\n" + p.stdout[-3000:])
    steps = []
    transport = ""
    peak = {}  # global rank -> the highest peak RSS its resources events gave
    recoveries = []
    with open(os.path.join(d, "journal.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step":
                steps.append(e)
            elif e.get("event") == "recovery_done":
                recoveries.append(e)
            elif e.get("event") == "resources":
                for r in e["ranks"]:
                    peak[r["rank"]] = max(peak.get(r["rank"], 0), r["peak_rss_bytes"])
    for line in p.stdout.splitlines():
        if "generation" in line and ("gradients" in line or "sharded" in line):
            transport = line.split(": ", 2)[-1]
    subprocess.run(["rm", "-rf", d])
    kill = kill_figures(steps, recoveries) if a.kill_at_step else None
    if kill:
        steps = [x for x in steps if x["t"] < kill["killed_at"]]
    gaps = [b["t"] - x["t"] for x, b in zip(steps, steps[1:]) if b["step"] == x["step"] + 1 and x["step"] >= 2]
    if not gaps:
        # A run that ends with no two consecutive steps from step 2 on (out
        # of memory, a stop) has no step time: say so instead of a median of nothing.
        sys.exit(f"{' '.join(extra)}: no step time (journaled steps: {[x['step'] for x in steps]}; exit {p.returncode}):\n" + p.stdout[-2000:])
    # Where a step's time went (the step events' per-step parts, the slowest
    # rank's each), medians over the same steps as the gaps.
    parts = {}
    for k in ("compute_s", "allreduce_s", "allreduce_exposed_s", "update_s", "gather_s", "pass_gather_s"):
        v = [x[k] for x in steps if x["step"] >= 3 and x.get(k) is not None]
        if v:
            parts[k + "_median"] = statistics.median(v)
    out = {"step_s_median": statistics.median(gaps), "wall_s": wall, "steps": len(steps), "transport": transport,
           "peak_rss_bytes_by_rank": [peak[r] for r in sorted(peak)], **parts}
    if kill:
        out["kill"] = kill
    return out


def kill_figures(steps, recoveries):
    """The recovery from the kill: the first step at the smaller world
    after it, the steps lost, where the shards came from, its phases."""
    if not KILLED_AT:
        sys.exit("the run ended before step %d: nothing was killed" % a.kill_at_step)
    t = KILLED_AT[0]
    rec = next((r for r in recoveries if r["t"] > t), None)
    if rec is None:
        sys.exit("no recovery after the kill")
    last_before = max((x["step"] for x in steps if x["t"] < t), default=-1)
    first = next((x for x in steps if x["t"] > t and x["step"] > last_before), None)
    return {"killed_at": t, "last_step_before": last_before, "world_after": rec["world_size"], "lost_steps": rec["lost_steps"],
            "resumed_step": rec["resumed_step"], "optimizer_source": rec.get("optimizer_source"),
            "first_step_after_s": first["t"] - t if first else None,
            "phases": {k: rec[k] for k in ("ready_s", "group_s", "state_s", "first_step_s", "duration_s") if k in rec}}


if a.hosts:
    if os.geteuid() != 0:
        sys.exit("zero_gpt_throughput.py: --hosts needs root (network namespaces)")
    subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([HOSTS, "up", TAG, str(a.nodes + 1)], check=True, stdout=subprocess.DEVNULL)
    for h in range(a.nodes + 1):
        subprocess.run([HOSTS, "cap", TAG, str(h), a.cap], check=True)
rows = []
try:
    for i in range(a.pairs):
        A = run(A_SET)
        B = run(B_SET)
        rows.append({"A": A, "B": B, "ratio": A["step_s_median"] / B["step_s_median"]})
        def parts(x):
            return ", ".join(f"{k[:-9]} {x[k]:.3f}" for k in x if k.endswith("_s_median") and k != "step_s_median")
        print(f"pair {i}: A {A['step_s_median']:.3f} s/step ({parts(A)}), B {B['step_s_median']:.3f} s/step ({parts(B)})", file=sys.stderr)
finally:
    if a.hosts:
        subprocess.run([HOSTS, "down", TAG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
ratios = sorted(r["ratio"] for r in rows)
result = {
    "what": "202M GPT step time, A against B, " + (f"separate namespace hosts, links capped at {a.cap}" if a.hosts else "dtactor local") + ", median gap between journaled steps from step 2 on, pairs run A B A B",
    "A": A_SET, "B": B_SET,
    "hosts": a.hosts, "nodes": a.nodes, "ranks_per_node": a.nproc_per_node, "settings": a.set, "steps": a.steps,
    "A_step_s_median": statistics.median(r["A"]["step_s_median"] for r in rows),
    "B_step_s_median": statistics.median(r["B"]["step_s_median"] for r in rows),
    "A_over_B_step_paired_median": statistics.median(ratios), "A_over_B_min": ratios[0], "A_over_B_max": ratios[-1],
    "A_transport": rows[0]["A"]["transport"], "B_transport": rows[0]["B"]["transport"],
    # The rank processes' peak RSS (VmHWM, from the journal's resources
    # events; shared-memory pages a rank touched count in it), the largest rank.
    "A_peak_rss_largest_rank_bytes": max((max(r["A"]["peak_rss_bytes_by_rank"] or [0]) for r in rows)),
    "B_peak_rss_largest_rank_bytes": max((max(r["B"]["peak_rss_bytes_by_rank"] or [0]) for r in rows)),
    "runs": rows}
# Where the time went: forward and backward, and of it zero = 3's unit
# gathers and releases (the compute waiting on them), medians of the runs.
for side in ("A", "B"):
    for k in ("compute_s_median", "pass_gather_s_median"):
        v = [r[side][k] for r in rows if k in r[side]]
        if len(v) == len(rows):
            result[side + "_" + k] = statistics.median(v)
if a.kill_at_step:
    for side in ("A", "B"):
        ks = [r[side]["kill"] for r in rows]
        result[side + "_kill_first_step_s_median"] = statistics.median(k["first_step_after_s"] for k in ks)
        result[side + "_kill_lost_steps_max"] = max(k["lost_steps"] for k in ks)
        result[side + "_kill_optimizer_sources"] = sorted({str(k["optimizer_source"]) for k in ks})
F = bench_meta.figure
def side_name(sets):
    # A bin:PATH item reads as "the other build", not its temporary path.
    name = " ".join(x for x in sets if not x.startswith("bin:"))
    return name + (" (the other build)" if any(x.startswith("bin:") for x in sets) else "")


A_NAME, B_NAME = side_name(A_SET), side_name(B_SET)
where = "%d namespace hosts x %d ranks, links at %s" % (a.nodes, a.nproc_per_node, a.cap) if a.hosts else \
    "world %d (%d nodes x %d ranks)" % (a.nodes * a.nproc_per_node, a.nodes, a.nproc_per_node)
print(json.dumps(bench_meta.stamped(result, "%s against %s: 202M GPT at %s, time a step, %d pairs%s"
                                    % (A_NAME, B_NAME, where, a.pairs, " (%s)" % ", ".join(a.set) if a.set else ""),
                                    "Sharded state (ZeRO)", [
    F("time a step, %s (median)" % A_NAME, ["A_step_s_median"], "s", B_NAME, ["B_step_s_median"]),
    F("%s over %s, time a step (median of the pairs)" % (A_NAME, B_NAME), ["A_over_B_step_paired_median"], "x"),
    F("peak resident memory of the largest rank, %s" % A_NAME, ["A_peak_rss_largest_rank_bytes"], "bytes", B_NAME,
      ["B_peak_rss_largest_rank_bytes"])] + ([
    F("forward and backward a step, %s (median)" % A_NAME, ["A_compute_s_median"], "s", B_NAME, ["B_compute_s_median"])]
    if "A_compute_s_median" in result and "B_compute_s_median" in result else []) + ([
    F("of it the units' gathers and releases, %s (median)" % A_NAME, ["A_pass_gather_s_median"], "s")]
    if "A_pass_gather_s_median" in result else []) + ([
    F("kill -9 of the last node's host: the first step at the smaller world after it, %s (median)" % A_NAME,
      ["A_kill_first_step_s_median"], "s", B_NAME, ["B_kill_first_step_s_median"]),
    F("kill -9 of the last node's host: completed steps lost, %s (worst run)" % A_NAME, ["A_kill_lost_steps_max"], "steps"),
    F("kill -9 of the last node's host: completed steps lost, %s (worst run)" % B_NAME, ["B_kill_lost_steps_max"], "steps")]
    if a.kill_at_step else [])), indent=1))
