#!/usr/bin/python3
"""A warm standby node taking a lost node's place (docs/fault_handling.md,
"A standby node"): kill -9 of a member node (the node process and its rank
processes) of a job whose world is 2 nodes (cluster.max_nodes = 2) of the
default config (the ViT on Fashion-MNIST), with a third node waiting as a
warm standby (cluster.standby_nodes = 1) and without one (the world
shrinks to 1), alternating in one run. Each trial, on loopback:

  a coordinator, nodes x and y (one rank each) and, with a standby, node z

z starts once x and y train (so that it is the node outside the world).
Once the job trains at world 2 past step 15 (and z, with a standby, is
registered with its rank warmed up: ready on the coordinator's
/status.json), node x is
killed (SIGKILL to its process group). Measured:
  full_world_s   from the kill to the first step journaled at world size 2
                 in a generation after the one the kill hit (the journal's
                 step lines, train.log_every_steps = 1)
  first_step_s   from the kill to the first step journaled at any world size
                 after the kill's generation
  shrank         whether a generation at world size 1 came in between
  lost_steps     recovery_done lost_steps after the kill (sum)
  promoted       standby nodes planned in after the kill (generation_started's
                 standby_promoted)

  phases         the recovery_done of the generation that reached world 2:
                 its plan to the first step (duration_s) and the slowest
                 rank's drain_s, group_s, state_s and first_step_s

--modes picks the arms: standby (z with cluster.standby_nodes = 1; by
default it heals while the survivor trains, cluster.heal_while_training),
standby_broadcast (the same with the state sent before the first step), extra
(z with cluster.standby_nodes = 0: a third node beyond cluster.max_nodes,
refused until a place is free, then it starts its rank), none (no z).
--set adds a config setting to every arm (another model: the 202M GPT of
bench/gpt_join.py, --gpt), --kill-at-step when to kill.

--hosts (root): each process on a network-namespace host of its own
(scripts/netns/hosts.sh): the coordinator on 198.18.0.1, x, y and z on
.2, .3 and .4, each link capped at --cap (default 10gbit); the kill is
SIGKILL to every process on x's host (its sockets closed by its kernel, as
a killed node's are). Also measured: step_s, the median gap between the
journal's step lines at world 2 before the kill, and the survivor's pause
(pause_s: its last step line before the kill to its first at world 2
after it, less one step_s).

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/standby_node_takeover.py [--trials 5] [--out FILE]
  /usr/bin/python3 bench/standby_node_takeover.py --gpt --modes standby,extra --trials 3 --kill-at-step 6 \
      --out bench/standby_node_takeover_gpt_results.json
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
from bench_jobs import journal, kill_groups, named, netns_hosts, summary, wait  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
GPT_SETS = ["model.name=gpt", "model.dim=1024", "model.layers=16", "model.heads=16", "model.context=32", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=2", "checkpoint.every_steps=2", "data.max_text_bytes=2000000",
            "eval.max_samples=8", "cluster.digest_every_steps=2"]
SETS = ["train.log_every_steps=1", "eval.every_steps=0", "eval.max_samples=1000", "checkpoint.every_steps=100000",
        "train.max_steps=1000000", "cluster.min_nodes=2", "cluster.max_nodes=2"]
MODES = {"standby": (3, ["cluster.standby_nodes=1"]), "none": (2, []), "extra": (3, []),
         "standby_broadcast": (3, ["cluster.standby_nodes=1", "cluster.heal_while_training=false"])}
HOSTS_SH = os.path.join(ROOT, "scripts", "netns", "hosts.sh")
TAG = "dtsn"
HOST_OF = {"coordinator": 0, "x": 1, "y": 2, "z": 3}


class place:
    """Where the trial's processes run: loopback, or namespace hosts (a
    bench_jobs.netns_hosts)."""

    def __init__(self, hosts=None):
        self.hosts = hosts

    def addr(self, name):
        return self.hosts.address(HOST_OF[name]) if self.hosts else "127.0.0.1"

    def prefix(self, name):
        return self.hosts.run(HOST_OF[name]) if self.hosts else []

    def status(self, port):
        url = "http://%s:%d/status.json" % (self.addr("coordinator"), port)
        if not self.hosts:
            return urllib.request.urlopen(url, timeout=2).read().decode()
        return subprocess.run(self.prefix("coordinator") + ["curl", "-s", "--max-time", "2", url], capture_output=True, text=True,
                              timeout=10).stdout

    def kill(self, name, proc):
        if self.hosts:
            self.hosts.kill(HOST_OF[name])
        else:
            os.killpg(proc.pid, signal.SIGKILL)


def member(where, port, node):
    """Node `node` as the coordinator's /status.json lists it ({} when not a member)."""
    try:
        status = json.loads(where.status(port))
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return next((m for m in status.get("members", []) if m.get("node") == node), {})


def step_gaps(ev, gen, world):
    ts = [e["t"] for e in named(ev, "step") if e.get("generation") == gen and e["world_size"] == world]
    return [b - a for a, b in zip(ts, ts[1:])]


def one_trial(work, mode, extra=(), kill_at_step=15, where=place()):
    run = os.path.join(work, "run")
    procs = {}
    nodes, extra_sets = MODES[mode]

    def start(name, args):
        log = open(os.path.join(work, name + ".log"), "w")
        procs[name] = subprocess.Popen(where.prefix(name) + [DTACTOR] + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    port, status_port = (29400, 29401) if where.hosts else (free_port(), free_port())
    coord = where.addr("coordinator")
    try:
        start("coordinator", ["--role", "coordinator", "--listen", "tcp://%s:%d" % (coord, port), "--advertise-addr", coord,
                              "--run-dir", run, "--metrics-port", str(status_port), "--metrics-addr", coord] +
              [x for s in SETS + extra_sets + list(extra) for x in ("--set", s)])
        def node(n):
            start(n, ["--role", "node", "--coordinator", "tcp://%s:%d" % (coord, port), "--node-id", n, "--advertise-addr", where.addr(n),
                      "--threads-per-rank", "1"])

        node("x")
        node("y")
        wait(lambda: [e for e in named(journal(run), "step") if e["step"] >= kill_at_step and e["world_size"] == 2], 900,
             "step %d at world 2" % kill_at_step, 0.05)
        if nodes == 3:  # z after x and y train, so that it is the one outside
            node("z")
            if mode == "extra":  # no place for it: refused, it keeps asking
                wait(lambda: "registration refused" in open(os.path.join(work, "z.log")).read(), 60, "z to be refused", 0.05)
        if mode.startswith("standby"):
            # z's rank is up, warmed and ready (the coordinator's status page).
            wait(lambda: member(where, status_port, "z").get("ready_ranks") == 1, 600, "z's rank to be ready", 0.2 if where.hosts else 0.05)
        out = {"mode": mode}
        gen_at_kill = max(e["generation"] for e in named(journal(run), "generation_started"))
        t_kill = time.time()
        where.kill("x", procs["x"])
        first = wait(lambda: [e for e in named(journal(run), "step") if e.get("generation", 0) > gen_at_kill], 120,
                     "a step after the kill", 0.005)[0]
        full = None
        if mode != "none":  # without a third node the world stays at 1
            full = wait(lambda: [e for e in named(journal(run), "step") if e.get("generation", 0) > gen_at_kill and e["world_size"] == 2],
                        600, "a step at world 2 after the kill", 0.005)
        ev = journal(run)
        gaps = step_gaps(ev, gen_at_kill, 2)[1:]
        before = [e["t"] for e in named(ev, "step") if e["t"] < t_kill]
        if gaps:
            out["step_s"] = statistics.median(gaps)
            if full and before:
                out["pause_s"] = full[0]["t"] - before[-1] - out["step_s"]
        last_t = (full[0] if full else first)["t"]
        gens = [g for g in named(ev, "generation_started") if g["generation"] > gen_at_kill and g["t"] <= last_t]
        out.update({
            "full_world_s": full[0]["t"] - t_kill if full else None,
            "first_step_s": first["t"] - t_kill,
            "first_step_world": first["world_size"],
            "shrank": any(g["world_size"] < 2 for g in gens),
            "generations": len(gens),
            "causes": [g["cause"] for g in gens],
            "lost_steps": sum(r.get("lost_steps", 0) for r in named(ev, "recovery_done") if r["t"] > t_kill),
            "promoted": sum(len(g.get("standby_promoted", [])) for g in gens),
        })
        if full:
            done = wait(lambda: [r for r in named(journal(run), "recovery_done") if r["generation"] == full[0]["generation"]], 60,
                        "the recovery_done of the generation at world 2", 0.05)[0]
            out["phases"] = {k: done.get(k) for k in ("duration_s", "drain_s", "group_s", "state_s", "first_step_s")}
        return out
    finally:
        kill_groups(procs.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--modes", default="standby,extra,none")
    ap.add_argument("--out", default=os.path.join(HERE, "standby_node_takeover_results.json"))
    ap.add_argument("--set", action="append", default=[], help="a config setting for every arm (repeatable)")
    ap.add_argument("--gpt", action="store_true", help="the 202M GPT of bench/gpt_join.py (its settings before any --set)")
    ap.add_argument("--kill-at-step", type=int, default=15)
    ap.add_argument("--hosts", action="store_true", help="each process on a namespace host of its own (root)")
    ap.add_argument("--cap", default="10gbit", help="--hosts: every link's rate (tbf)")
    a = ap.parse_args()
    if not a.hosts:
        return trials(a, place())
    if os.geteuid() != 0:
        sys.exit("standby_node_takeover.py: --hosts needs root (network namespaces)")
    with netns_hosts(HOSTS_SH, TAG, len(HOST_OF)) as hosts:
        for h in range(len(HOST_OF)):
            subprocess.run([HOSTS_SH, "cap", TAG, str(h), a.cap], check=True)
        return trials(a, place(hosts))


def trials(a, where):
    extra = (GPT_SETS if a.gpt else []) + a.set
    modes = a.modes.split(",")
    runs = {m: [] for m in modes}
    for i in range(a.trials):
        for mode in modes:
            work = tempfile.mkdtemp(prefix="dtactor-standby-bench-")
            r = one_trial(work, mode, extra, a.kill_at_step, where)
            print("trial %d %s: %s" % (i + 1, mode, json.dumps(r)), file=sys.stderr)
            runs[mode].append(r)
            subprocess.run(["rm", "-rf", work])
    result = {"trials": runs}
    for mode in modes:
        result[mode] = {k: summary(runs[mode], k) for k in ("full_world_s", "first_step_s", "step_s", "pause_s")}
        result[mode]["shrank_trials"] = sum(1 for x in runs[mode] if x["shrank"])
    result["lost_steps_worst"] = max(x["lost_steps"] for m in modes for x in runs[m])
    result["hosts"] = a.hosts
    if a.gpt or a.set or a.hosts:
        return write_other(a, modes, runs, result, extra)
    if a.out == "-" or set(modes) != {"standby", "extra", "none"}:
        print(json.dumps(result, indent=1))
        return 0
    F = bench_meta.figure
    out = bench_meta.write(a.out, result, "A warm standby node takes a lost node's place: kill -9 of a member node of a default-config job "
                           "at world 2 (cluster.max_nodes = 2), with a third node waiting as a standby (cluster.standby_nodes = 1), "
                           "with a third node beyond cluster.max_nodes and no standby place (refused until the loss), and with no "
                           "third node, %d trials each, alternating (medians)" % a.trials,
                           "Recovery from faults", [
                               F("the kill to the first step at full world size, with a standby node", ["standby", "full_world_s", "median"], "s",
                                 "a third node without a standby place (the world shrinks, then it joins cold)", ["extra", "full_world_s", "median"]),
                               F("the kill to the first step, with a standby node (at full size)", ["standby", "first_step_s", "median"], "s",
                                 "without a third node (at world 1)", ["none", "first_step_s", "median"]),
                               F("steps lost (worst trial)", ["lost_steps_worst"], "steps"),
                           ], notes="Loopback, the coordinator and the nodes on the project's 2-core build machine (one compute thread "
                                    "a rank). The times are the coordinator's journal's (a step line is written once every rank "
                                    "reported that step). The node is killed by SIGKILL to its process group (the node and its rank); "
                                    "its closed connection and its peer's failed collective are how the loss is seen.")
    print(json.dumps({k: out[k] for k in modes + ["lost_steps_worst"]}, indent=1))
    return 0


def write_other(a, modes, runs, result, extra):
    """Another config (--gpt, --set): the arms run and each recovery's phases."""
    for mode in modes:
        for k in ("duration_s", "drain_s", "group_s", "state_s", "first_step_s"):
            vals = [x["phases"][k] for x in runs[mode] if x.get("phases") and x["phases"].get(k) is not None]
            if vals:
                result[mode]["phase_" + k] = summary([{"v": v} for v in vals], "v")
    if a.out == "-":
        print(json.dumps(result, indent=1))
        return 0
    F = bench_meta.figure
    figs = []
    if "standby" in modes:
        anchor = (("the state sent before the first step (cluster.heal_while_training = false)", ["standby_broadcast", "full_world_s", "median"])
                  if "standby_broadcast" in modes else
                  ("a third node without a standby place (the world shrinks, then it joins cold)", ["extra", "full_world_s", "median"])
                  if "extra" in modes else ())
        figs.append(F("the kill to the first step at full world size, with a warm standby node", ["standby", "full_world_s", "median"], "s",
                      *anchor))
        figs.append(F("of it, with a standby: its generation's plan to the first step", ["standby", "phase_duration_s", "median"], "s"))
        figs.append(F("of that: the group to READY (agreement; the peer state, when it is sent before the first step)",
                      ["standby", "phase_state_s", "median"], "s",
                      *(("the state sent before the first step", ["standby_broadcast", "phase_state_s", "median"])
                        if "standby_broadcast" in modes else ())))
        figs.append(F("of that: READY to the first step at world 2 (with healing, the parameters' transfer and the step)",
                      ["standby", "phase_first_step_s", "median"], "s",
                      *(("the state sent before the first step", ["standby_broadcast", "phase_first_step_s", "median"])
                        if "standby_broadcast" in modes else ())))
        figs.append(F("the survivor's pause beyond one step while the standby joins (its last step before the kill to its first at "
                      "world 2, less one step)", ["standby", "pause_s", "median"], "s",
                      *(("the state sent before the first step", ["standby_broadcast", "pause_s", "median"])
                        if "standby_broadcast" in modes else ())))
        figs.append(F("the median step time before the kill", ["standby", "step_s", "median"], "s"))
    if "none" in modes:
        figs.append(F("the kill to the first step at world 1, without a third node", ["none", "first_step_s", "median"], "s"))
        figs.append(F("the median step time at world 2 before the kill, without a third node", ["none", "step_s", "median"], "s"))
    figs.append(F("steps lost (worst trial)", ["lost_steps_worst"], "steps"))
    what = "the 202M GPT of bench/gpt_join.py" if a.gpt else "the default config"
    on = ("each process on a network-namespace host of its own (the coordinator, x, y and z on 4 hosts, every link capped at %s; "
          "the kill is SIGKILL to every process on x's host)" % a.cap) if a.hosts else "loopback"
    out = bench_meta.write(a.out, result, "A warm standby node takes a lost node's place at %s: kill -9 of a member node at step %d, "
                           "world 2 (cluster.max_nodes = 2), %s, arms %s, %d trials each, alternating (medians)"
                           % (what, a.kill_at_step, "on separate namespace hosts" if a.hosts else "on one host", ", ".join(modes),
                              a.trials), "Recovery from faults", figs,
                           notes=on[0].upper() + on[1:] + ", on the project's 2-core build machine (one compute thread a "
                                 "rank). Settings beyond the bench's own: " + ", ".join(extra) + ". The times are the coordinator's "
                                 "journal's. A standby's rank is started, has built the model, opened the data and (when the host has "
                                 "room) touched its gradients, moments and reducer buffers before the kill; it receives the state from "
                                 "the survivor after the kill (standby: while the survivor trains the generation's first step alone, "
                                 "cluster.heal_while_training; standby_broadcast: before that step). extra: the third node is refused until the loss, then starts its rank cold.")
    print(json.dumps({k: out[k] for k in modes + ["lost_steps_worst"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
