#!/usr/bin/python3.11
"""A lost node and its replacement at the 202M GPT (2.4 GB of state), with
the default settings, as medians of several runs: bench/bench_state_path.py
(coordinator + 2 nodes on this machine, a checkpoint due every 2 steps to a
directory store, node b killed -9, node c started to replace it) run
--trials times, one after the other.

Per run, from its JSON and its journal (recovery_done of the join's
generation): the replacement's registration to its first step at world 2,
and where that time went: registration to the plan (the new node's rank
starting and building the model), group_s (the plan to the group: the
survivor's step in hand), state_s (the group to the last READY: the peer
state transfer, the reducers' buffers, the joining rank's first touch of
its gradient buffer), first_step_s (READY to the first step at world 2),
and their sum, the survivor's pause (it trains on until its group is
built);
the transfer's rate; kill -9 to the first step at world 1; the longest
checkpoint stall against the median step. The peer transfer is the state's
replicated part, sent from a survivor: at train.zero = 0 the whole state;
from train.zero = 1 on the moments (and from zero = 2 the gradients) are
sharded and move in the reshard, so it is the parameters; where the
parameters are sharded too (train.precision = bf16 from zero = 1, or
zero = 3) it holds no parameters, a few kilobytes, and has no rate worth
quoting.

With --baseline DIR (a directory holding another build's dtactor,
dtactor-train and libdtactor.so.0), the runs alternate between that build
and this one, --trials each, and the medians of both are written side by
side (the same machine, interleaved).

Writes bench/gpt_join_results.json (or --out): the medians and every run's
figures.

Usage: bench/gpt_join.py [--trials 5] [--steps 14] [--bin build/dtactor]
                         [--set KEY=VALUE ...] [--baseline DIR] [--baseline-set KEY=VALUE ...]
                         [--baseline-is TEXT] [--out FILE]
       bench/gpt_join.py --from-runs FILE [--out FILE]   (no new runs: the
                         medians and figures again from FILE's runs)
"""
import argparse, json, os, shutil, statistics, subprocess, sys

import bench_meta

here = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(here, "..", "build", "dtactor"))
ap.add_argument("--trials", type=int, default=5)
ap.add_argument("--steps", type=int, default=14)
ap.add_argument("--baseline", default="", help="a directory with another build's dtactor, dtactor-train and libdtactor.so.0")
ap.add_argument("--baseline-is", default="the build before", help="what the baseline build is, for the page")
ap.add_argument("--set", action="append", default=[], help="one more config setting for every run (bench_state_path.py --set)")
ap.add_argument("--baseline-set", action="append", default=[],
                help="one more config setting for the baseline's runs only (without --baseline: this build with these settings is the baseline)")
ap.add_argument("--out", default=os.path.join(here, "gpt_join_results.json"))
ap.add_argument("--from-runs", default="", help="no new runs: the medians and figures again from the runs an earlier results file holds")
a = ap.parse_args()
has_baseline = bool(a.baseline or a.baseline_set)

KEPT = ["replacement_registered_to_first_step_s", "peer_transfer_while_training", "peer_transfer_s", "peer_transfer_gb_per_s", "kill_to_first_step_at_world_1_s",
        "stall_s_max", "stall_max_over_step", "step_s_median", "lost_steps", "peer_transfer_bytes"]


def join_phases(run_dir):
    """recovery_done of the generation the replacement joined, and the gap
    from its node_joined to that generation's plan."""
    events = [json.loads(line) for line in open(os.path.join(run_dir, "journal.jsonl"))]
    joined = [e for e in events if e.get("event") == "node_joined" and e.get("node") == "c"]
    started = [e for e in events if e.get("event") == "generation_started" and e.get("cause") == "node_joined"]
    if not joined or not started:
        sys.exit("the journal has no join of node c: " + run_dir)
    gen = started[0]["generation"]
    done = [e for e in events if e.get("event") == "recovery_done" and e.get("generation") == gen]
    if not done:
        sys.exit("the journal has no recovery_done for generation %d: %s" % (gen, run_dir))
    d = done[0]
    return {"registered_to_plan_s": round(started[0]["t"] - joined[0]["t"], 3), "group_s": round(d["group_s"], 3),
            "state_s": round(d["state_s"], 3), "first_step_s": round(d["first_step_s"], 3), "plan_to_first_step_s": round(d["duration_s"], 3),
            "pause_s": round(d["state_s"] + d["first_step_s"], 3)}


def trial(baseline="", sets=()):
    binary = os.path.join(baseline, "dtactor") if baseline else a.bin
    env = dict(os.environ, LD_LIBRARY_PATH=baseline) if baseline else None
    cmd = [sys.executable, os.path.join(here, "bench_state_path.py"), "--bin", binary, "--steps", str(a.steps), "--keep"]
    for kv in list(a.set) + list(sets):
        cmd += ["--set", kv]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit("bench_state_path.py failed:\n" + p.stdout[-2000:] + p.stderr[-2000:])
    r = json.loads(p.stdout)
    run_dir = r["run_dir"]
    try:
        out = {k: r[k] for k in KEPT}
        out.update(join_phases(run_dir))
    finally:
        shutil.rmtree(os.path.dirname(run_dir), ignore_errors=True)
    return out


runs, base_runs = [], []
earlier = json.load(open(a.from_runs)) if a.from_runs else None
if earlier:
    runs, base_runs, a.trials = earlier["runs"], earlier.get("baseline_runs", []), len(earlier["runs"])
for i in range(0 if earlier else a.trials):
    if has_baseline:
        base_runs.append(trial(a.baseline, a.baseline_set))
        print("baseline run %d of %d: %s" % (i + 1, a.trials, json.dumps(base_runs[-1])), file=sys.stderr, flush=True)
    runs.append(trial())
    print("run %d of %d: %s" % (i + 1, a.trials, json.dumps(runs[-1])), file=sys.stderr, flush=True)


def median_of(values):
    """The median of the values a run has (a transfer overlapped with the
    first step, healing while training, has no time of its own: None)."""
    have = [v for v in values if v is not None]
    return round(statistics.median(have), 3) if have else None


def own_time(r):
    """A run's figures, with no transfer time of its own when the transfer
    overlapped the first step (bench_state_path reports 0 then)."""
    return dict(r, peer_transfer_s=None, peer_transfer_gb_per_s=None) if r.get("peer_transfer_while_training") else r


def medians(rs):
    rs = [own_time(r) for r in rs]
    return {k: median_of(r[k] for r in rs) for k in rs[0].keys()}


result = {"trials": a.trials, "median": medians(runs), "runs": runs}
if has_baseline:
    result.update({"baseline_is": a.baseline_is, "baseline_median": medians(base_runs), "baseline_runs": base_runs})
n = a.trials


def run_settings():
    """The runs' settings: --set, or with --from-runs the earlier command's."""
    sets = list(a.set)
    if earlier:
        words = earlier["meta"]["command"].split()
        sets += [v for k, v in zip(words, words[1:]) if k == "--set"]
    return dict(kv.split("=", 1) for kv in sets)


def transfer_what():
    """What the peer transfer carries at these settings (the module's
    docstring), and whether a rate means anything."""
    st = run_settings()
    zero = int(st.get("train.zero", "0"))
    if zero >= 3 or (zero >= 1 and st.get("train.precision") == "bf16"):
        return "the replicated part from a peer (no parameters: they are sharded and move in the reshard)", False
    if zero >= 1:
        return "the replicated part from a peer (the parameters, 0.8 GB; the sharded state moves in the reshard)", True
    return "the peer state transfer (2.4 GB)", True


transfer_label, transfer_rate = transfer_what()


def F(what, at, unit):
    if not has_baseline:
        return bench_meta.figure(what, at, unit)
    return bench_meta.figure(what, at, unit, a.baseline_is, ["baseline_median"] + at[1:])


out = bench_meta.write(
    a.out, result,
    "A lost node and its replacement at the 202M GPT (2.4 GB of state), %s%s: where the join's time goes (median of %d runs)" % (
        "with " + ", ".join(a.set) if a.set else "default settings",
        " (the replacement heals while the first step trains)" if any(r.get("peer_transfer_while_training") for r in runs) else "", n),
    "Recovery from faults", [f for f in [
        F("the replacement: registration to its first step at world 2", ["median", "replacement_registered_to_first_step_s"], "s"),
        F("of it: registration to the plan (the new rank starts and builds the model)", ["median", "registered_to_plan_s"], "s"),
        F("of it: the plan to the group (the survivor finishes its step)", ["median", "group_s"], "s"),
        F("of it: the group to READY (state transfer, reducers' buffers, first touch of the gradients)", ["median", "state_s"], "s"),
        F("of it: " + transfer_label, ["median", "peer_transfer_s"], "s"),
        F("of it: READY to the first step at world 2", ["median", "first_step_s"], "s"),
        F("the survivor's pause: its group built to the first step at world 2 (state_s + first_step_s)", ["median", "pause_s"], "s"),
        F("peer state transfer rate (same host)", ["median", "peer_transfer_gb_per_s"], "GB/s") if transfer_rate else None,
        F("kill -9 of node b to the first step at world 1", ["median", "kill_to_first_step_at_world_1_s"], "s"),
        F("median step time", ["median", "step_s_median"], "s"),
        F("longest checkpoint stall over the median step time", ["median", "stall_max_over_step"], "x"),
        F("completed steps lost", ["median", "lost_steps"], "steps"),
    ] if f and bench_meta.lookup(result, f["at"]) is not None],  # healing: no transfer time of its own
    cmd=(earlier["meta"]["command"] + ("" if "--out" in earlier["meta"]["command"] or os.path.abspath(a.out) == os.path.join(here, "gpt_join_results.json")
                                       else " --out bench/" + os.path.basename(a.out))) if earlier else "bench/gpt_join.py --trials %d --steps %d%s%s" % (
        n, a.steps, "".join(" --set " + kv for kv in a.set) + ("" if not a.baseline else " --baseline DIR") +
        "".join(" --baseline-set " + kv for kv in a.baseline_set) + (" --baseline-is '%s'" % a.baseline_is if has_baseline else ""),
        "" if os.path.abspath(a.out) == os.path.join(here, "gpt_join_results.json") else " --out bench/" + os.path.basename(a.out)),
    notes=("%d runs of bench_state_path.py one after the other on this machine's 2 cores (GPT model.dim=1024 model.layers=16, global batch 4, " % n) +
          "checkpoint.every_steps=2, " + "".join(kv + ", " for kv in a.set) + "default settings otherwise" +
          ("; the baseline's runs also with " + ", ".join(a.baseline_set) if a.baseline_set else "") +
          ("; the coordinator and both nodes on one host, so the gradients and a broadcast state move through shared memory, and a state or "
           "moments sent point to point are read from the sender's memory (a baseline build may differ: see baseline_is)); the replacement node is started cold after the kill (no spare), so its rank's start, "
           "model build and first touch of its gradients and moments (a warm rank at train.zero = 0 makes them resident before it says it is ready) are in "
           "the time from its registration to the plan, while the survivor still trains.%s Medians per figure; every run's figures are under runs%s." %
           (" The replacement received the state while the first step at world 2 trained (cluster.heal_while_training), so the transfer "
            "has no time of its own: it is in READY to the first step." if any(r.get("peer_transfer_while_training") for r in runs) else "",
            "; with a baseline, its runs alternate with this build's (baseline first), medians under baseline_median" if has_baseline else "")))
print(json.dumps(out, indent=1))
