#!/usr/bin/python3
"""A node joining a running job of the 202M GPT (bench/gpt_join.py's
model, 2.4 GB of state) with no loss: the world grows from 2 nodes to 3
across separate hosts, with the state healed while the first step trains
(cluster.heal_while_training, the default) and sent before it, alternating
in one run.

Each trial (root): a coordinator, nodes x and y (one rank each) on
network-namespace hosts of their own (scripts/netns/hosts.sh, every link
capped at --cap, default 10gbit); cluster.max_nodes = 3. Once x and y
train past step --join-at-step, node z starts on a fourth host. It warms
its rank (process, model, data, its gradients and moments touched) before
it says it is ready, and the coordinator grows the world at the next step
boundary after cluster.settle_ms. Measured, from the coordinator's
journal:

  plan_to_contributing_s    the grow generation's generation_started (the
                            plan, made once z's rank is ready and
                            cluster.settle_ms passed) to the first step
                            journaled at world 3 (every rank's report of
                            it, z's too)
  joined_to_contributing_s  z's node_joined to that step
  gap_s                     x and y's last step at world 2 to that step
  step2_s, step3_s          the median step time at world 2 before the
                            join, and at world 3 after it (3 ranks on the
                            machine's 2 cores)
  pause_s                   gap_s less step3_s: what the join cost the
                            others beyond a step at the new size
  plan_to_switch_s          the plan to x and y's last step at world 2:
                            they train on to the boundary where every
                            rank holds the plan (it rides the step's
                            control words, read when backward ends)
  switch_wait_steps         plan_to_switch_s in world-2 steps (about half
                            a step expected, the plan arriving anywhere
                            in a step)
  phases                    the grow generation's recovery_done (plan to
                            the first step; drain_s, x and y training on
                            to the boundary where they switch; group_s,
                            state_s, first_step_s)
  lost_steps                recovery_done's lost_steps (a join loses none)

  /usr/bin/python3 bench/gpt_grow_hosts.py [--trials 5] [--out FILE]
"""
import argparse
import os
import json
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_jobs import journal, kill_groups, named, netns_hosts, summary, wait  # noqa: E402
from standby_node_takeover import DTACTOR, GPT_SETS, HOST_OF, HOSTS_SH, TAG, place  # noqa: E402

SETS = ["train.log_every_steps=1", "eval.every_steps=0", "train.max_steps=1000000", "cluster.min_nodes=2", "cluster.max_nodes=3"]
ARMS = {"heal": [], "broadcast": ["cluster.heal_while_training=false"]}


def steps_at(ev, world):
    return [e for e in named(ev, "step") if e["world_size"] == world]


def median_gap(steps):
    ts = [e["t"] for e in steps]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def one_trial(work, arm, where, join_at, after, model_sets):
    run = os.path.join(work, "run")
    procs = {}

    def start(name, args):
        log = open(os.path.join(work, name + ".log"), "w")
        procs[name] = subprocess.Popen(where.prefix(name) + [DTACTOR] + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def node(n):
        start(n, ["--role", "node", "--coordinator", "tcp://%s:%d" % (coord, port), "--node-id", n, "--advertise-addr", where.addr(n),
                  "--threads-per-rank", "1"])

    port = 29400
    coord = where.addr("coordinator")
    try:
        start("coordinator", ["--role", "coordinator", "--listen", "tcp://%s:%d" % (coord, port), "--advertise-addr", coord, "--run-dir", run,
                              "--metrics-port", "0"] +
              [x for s in model_sets + SETS + ARMS[arm] for x in ("--set", s)])
        node("x")
        node("y")
        wait(lambda: [e for e in steps_at(journal(run), 2) if e["step"] >= join_at], 900, "step %d at world 2" % join_at, 0.05)
        node("z")
        first = wait(lambda: steps_at(journal(run), 3), 600, "a step at world 3", 0.005)[0]
        wait(lambda: len(steps_at(journal(run), 3)) > after, 600, "%d steps at world 3" % (after + 1), 0.05)
        ev = journal(run)
        at2 = [e for e in steps_at(ev, 2) if e["t"] < first["t"]]
        joined = [e for e in named(ev, "node_joined") if e.get("node") == "z"]
        planned = [g for g in named(ev, "generation_started") if g["generation"] == first["generation"]]
        out = {"arm": arm, "plan_to_contributing_s": first["t"] - planned[0]["t"] if planned else None,
               "joined_to_contributing_s": first["t"] - joined[0]["t"] if joined else None,
               "gap_s": first["t"] - at2[-1]["t"], "step2_s": median_gap(at2[1:]), "step3_s": median_gap(steps_at(ev, 3))}
        out["pause_s"] = out["gap_s"] - out["step3_s"] if out["step3_s"] is not None else None
        # x and y train on after the plan to the boundary where they switch.
        out["plan_to_switch_s"] = at2[-1]["t"] - planned[0]["t"] if planned else None
        out["switch_wait_steps"] = out["plan_to_switch_s"] / out["step2_s"] if planned and out["step2_s"] else None
        done = [r for r in named(ev, "recovery_done") if r["generation"] == first["generation"]]
        out["phases"] = {k: done[0].get(k) for k in ("duration_s", "drain_s", "group_s", "state_s", "first_step_s")} if done else None
        out["lost_steps"] = sum(r.get("lost_steps", 0) for r in named(ev, "recovery_done"))
        out["healed"] = any(r.get("while_training") for r in named(ev, "checkpoint_restored"))
        return out
    finally:
        kill_groups(procs.values())


KEYS = ("plan_to_contributing_s", "joined_to_contributing_s", "gap_s", "step2_s", "step3_s", "pause_s", "plan_to_switch_s", "switch_wait_steps")


def run_trials(a, where):
    runs = {arm: [] for arm in ARMS}
    for i in range(a.trials):
        for arm in ARMS:
            work = tempfile.mkdtemp(prefix="dtactor-grow-bench-")
            r = one_trial(work, arm, where, a.join_at_step, a.steps_after, [] if a.vit else GPT_SETS)
            print("trial %d %s: %s" % (i + 1, arm, json.dumps(r)), file=sys.stderr)
            runs[arm].append(r)
            if a.keep:
                print("trial %d %s: kept %s" % (i + 1, arm, work), file=sys.stderr)
            else:
                subprocess.run(["rm", "-rf", work])
    result = {"trials": runs, "lost_steps_worst": max(x["lost_steps"] for arm in ARMS for x in runs[arm])}
    for arm in ARMS:
        result[arm] = {k: summary(runs[arm], k) for k in KEYS}
        result[arm]["healed_trials"] = sum(1 for x in runs[arm] if x["healed"])
        for k in ("duration_s", "drain_s", "group_s", "state_s", "first_step_s"):
            vals = [{"v": x["phases"][k]} for x in runs[arm] if x.get("phases") and x["phases"].get(k) is not None]
            result[arm]["phase_" + k] = summary(vals, "v")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--join-at-step", type=int, default=4)
    ap.add_argument("--steps-after", type=int, default=4, help="steps at world 3 to wait for (the world-3 step time)")
    ap.add_argument("--cap", default="10gbit")
    ap.add_argument("--keep", action="store_true", help="keep each trial's run directory (journal, logs) and say where")
    ap.add_argument("--vit", action="store_true", help="the default config's ViT instead of the GPT (a quick check of the bench; --out - only)")
    ap.add_argument("--out", default=os.path.join(HERE, "gpt_grow_hosts_results.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("gpt_grow_hosts.py: needs root (network namespaces)")
    with netns_hosts(HOSTS_SH, TAG, len(HOST_OF)) as hosts:
        for h in range(len(HOST_OF)):
            subprocess.run([HOSTS_SH, "cap", TAG, str(h), a.cap], check=True)
        result = run_trials(a, place(hosts))
    if a.out == "-" or a.vit or a.keep:
        print(json.dumps(result, indent=1))
        return 0
    F = bench_meta.figure
    bc = "the state sent before the first step (cluster.heal_while_training = false)"

    def both(what, key, unit="s"):
        return F(what, ["heal", key, "median"], unit, bc, ["broadcast", key, "median"])

    cmd = " ".join(["bench/gpt_grow_hosts.py", "--trials", str(a.trials)] + (["--out", os.path.relpath(a.out, os.path.dirname(HERE))]
                                                                          if a.out != os.path.join(HERE, "gpt_grow_hosts_results.json") else []))
    def resolves(f):
        try:
            return all(bench_meta.lookup(result, at) is not None for at in (f["at"], f.get("anchor_at", f["at"])))
        except (KeyError, IndexError, TypeError):
            return False

    out = bench_meta.write(
        a.out, result, "A node joins a running job of the 202M GPT with no loss (world 2 to 3) on separate namespace hosts: healed while "
        "the first step trains (the default) against the state sent before it, %d trials each, alternating (medians)" % a.trials,
        "Recovery from faults", [f for f in [
            both("the grow generation's plan to its first step at world 3 (the plan follows the joining node's ready ranks "
                 "after cluster.settle_ms; x and y train on at world 2 until the step boundary where they switch)",
                 "plan_to_contributing_s"),
            both("the others' pause beyond a step at world 3 (their last step at world 2 to the first at world 3, less the median "
                 "world-3 step)", "pause_s"),
            both("of the grow generation: the group to READY (agreement; the state, when it is sent first)", "phase_state_s"),
            both("the plan to x and y's last step at world 2, in world-2 steps (they train on to the boundary where all switch)",
                 "switch_wait_steps", unit="steps"),
            F("the median step time at world 2 before the join", ["heal", "step2_s", "median"], "s"),
            F("the median step time at world 3 after the join (3 ranks on 2 cores)", ["heal", "step3_s", "median"], "s"),
            F("steps lost (worst trial)", ["lost_steps_worst"], "steps"),
        ] if resolves(f)], cmd=cmd,
        notes="Each process on a network-namespace host of its own (the coordinator, x, y and z on 4 hosts, every link capped at %s), on "
              "the project's 2-core build machine (one compute thread a rank; at world 3 three ranks share the 2 cores, so a step at "
              "world 3 is not shorter than at world 2). Settings beyond the bench's own: %s. The times are the coordinator's journal's; "
              "z's rank has started, built the model, opened the data and touched its gradients and moments before it is ready, and the "
              "coordinator grows the world at the next step boundary after cluster.settle_ms (300 ms)." % (a.cap, ", ".join(GPT_SETS)))
    print(json.dumps({k: out[k] for k in list(ARMS) + ["lost_steps_worst"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
