#!/usr/bin/env python3
"""The coordinator at scale: one real `dtactor --role coordinator` (CURVE on,
a job key from `dtactor keygen`) and N simulated nodes (build/bench/scale_nodes:
ZeroMQ DEALERs speaking the node's protocol, no ranks or LibTorch) from a few
processes, spread over loopback source addresses 127.0.0.x.

For each N it measures, from the coordinator's journal, /proc and the
simulators' JSON lines:
  - the cold start storm: every simulator started at once, to the last
    node_joined in the journal, and to the first generation planned;
  - the coordinator's CPU (cores, from /proc/PID/stat over a steady window,
    and per thread) and memory (VmRSS, VmHWM) at steady state;
  - losses detected: K running nodes go silent (stop sending, keep the
    socket), then K others close their socket; node_lost's journal time
    minus each node's last message sent; with heartbeat relays active
    (cluster.relay_from_nodes), then R relays go silent and R others close
    (their members must give them up without being lost);
  - heartbeat relays at steady state: relays, nodes beating one, the
    members' beats relays passed on, relays given up;
  - a generation planned and sent to all: generation_started's journal time
    to the last simulated node's receipt of that plan.

Usage: /usr/bin/python3 bench/scale_nodes.py --nodes 1000,3000,10000 --out bench/scale_nodes_results.json
"""
import argparse
import json
import math
import re
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402
from bench_jobs import journal, named, poll, text_of  # noqa: E402
from bench_net import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICKS = os.sysconf("SC_CLK_TCK")


def raise_fd_limit():
    """Soft and hard RLIMIT_NOFILE as high as this process may set them (the
    coordinator and the simulators inherit it); the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (1 << 20, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard) if want == hard else want))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def machine_limits():
    def read(path):
        return text_of(path).strip()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"cores": os.cpu_count(), "fd_limit_soft": soft, "fd_limit_hard": hard,
            "ephemeral_ports": read("/proc/sys/net/ipv4/ip_local_port_range").replace("\t", "-"),
            "somaxconn": int(read("/proc/sys/net/core/somaxconn") or 0),
            "tcp_max_syn_backlog": int(read("/proc/sys/net/ipv4/tcp_max_syn_backlog") or 0)}


def cpu_s(pid):
    """utime + stime of a process (or a thread: /proc/PID/task/TID), seconds."""
    fields = text_of("/proc/%s/stat" % pid).rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS if len(fields) > 12 else 0.0


def threads_cpu(pid):
    """{thread name: CPU seconds} summed over the threads of that name."""
    out = {}
    base = "/proc/%d/task" % pid
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        name = text_of("%s/%s/comm" % (base, tid)).strip() or "?"
        out[name] = out.get(name, 0.0) + cpu_s("%d/task/%s" % (pid, tid))
    return out


def status_bytes(pid, field):
    for line in text_of("/proc/%d/status" % pid).splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def sim_lines(path):
    out = []
    for line in text_of(path).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def wait_for(cond, limit_s, poll_s=0.25):
    """cond()'s first true value, or None after limit_s."""
    return poll(cond, limit_s, poll_s)


def rounded(v, digits=3):
    return None if v is None else round(v, digits)


def spread(values):
    if not values:
        return None
    v = sorted(values)
    return {"n": len(v), "min": rounded(v[0]), "median": rounded(v[len(v) // 2]), "max": rounded(v[-1])}


class trial:
    """One coordinator and its simulators in WORK, for N nodes."""

    def __init__(self, a, n, work):
        self.a, self.n, self.work = a, n, work
        self.run = os.path.join(work, "run")
        self.key = os.path.join(work, "job.key")
        self.coord = None
        self.sims = []  # (Popen, stdout path, node count)

    def start_coordinator(self):
        subprocess.run([self.a.dtactor, "keygen", "--out", self.key], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.port = free_port()
        sets = ["cluster.min_nodes=%d" % self.n, "cluster.max_nodes=%d" % self.n, "train.max_steps=100000000",
                "checkpoint.every_steps=0", "eval.every_steps=0"] + self.a.set
        log = open(os.path.join(self.work, "coordinator.log"), "w")
        args = [self.a.dtactor, "--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % self.port, "--advertise-addr", "127.0.0.1",
                "--run-dir", self.run, "--key", self.key, "--metrics-port", "0"] + [x for s in sets for x in ("--set", s)]
        self.coord = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_for(lambda: "listening on" in text_of(os.path.join(self.work, "coordinator.log")), 30, 0.05):
            raise RuntimeError("the coordinator did not listen: " + text_of(os.path.join(self.work, "coordinator.log"))[-2000:])

    def start_simulators(self):
        """Every simulator at once (the storm); the unix time they were started."""
        procs = max(1, math.ceil(self.n / self.a.per_process))
        t0 = time.time()
        for p in range(procs):
            count = self.n // procs + (1 if p < self.n % procs else 0)
            sources = ",".join("127.0.0.%d" % (2 + p * self.a.addresses + i) for i in range(self.a.addresses))
            out = os.path.join(self.work, "sim%d.jsonl" % p)
            args = [self.a.sim, "--coordinator", "tcp://127.0.0.1:%d" % self.port, "--key", self.key, "--nodes", str(count),
                    "--prefix", "s%d" % p, "--sources", sources, "--report-every-s", str(self.a.report_every_s)] + self.a.sim_arg
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=open(out, "w"),
                                    stderr=open(os.path.join(self.work, "sim%d.err" % p), "w"), start_new_session=True)
            self.sims.append((proc, out, count))
        return t0

    def tell(self, index, line):
        proc = self.sims[index][0]
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()

    def sim_events(self, name):
        out = []
        for _, path, _ in self.sims:
            out += [e for e in sim_lines(path) if e.get("event") == name]
        return out

    def sims_cpu(self):
        return sum(cpu_s(p.pid) for p, _, _ in self.sims)

    def stop(self):
        for proc, _, _ in self.sims:
            if proc.poll() is None:
                try:
                    proc.stdin.write(b"quit\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        for proc, _, _ in self.sims:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.coord and self.coord.poll() is None:
            self.coord.send_signal(signal.SIGTERM)
            try:
                self.coord.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.coord.pid, signal.SIGKILL)
                self.coord.wait()


def plan_to_all(t, gen):
    """A generation's journal time to the last simulated node that received
    its plan (among the nodes it names), and how many received it."""
    started = [e for e in named(journal(t.run), "generation_started") if e.get("generation") == gen]
    if not started:
        return None
    got = [e for e in t.sim_events("plan") if e.get("generation") == gen and e.get("in_plan")]
    want = len(started[0].get("nodes", []))
    last = max((e["t"] for e in got), default=None)
    frame = max((e.get("bytes", 0) for e in got), default=0)
    return {"generation": gen, "world_size": started[0].get("world_size"), "nodes_received": len(got), "nodes_planned": want,
            "plan_frame_bytes": frame, "plan_bytes_to_all": frame * want,
            "to_last_s": rounded(last - started[0]["t"]) if last is not None and len(got) >= want else None,
            "to_median_s": rounded(sorted(e["t"] for e in got)[len(got) // 2] - started[0]["t"]) if got else None}


def first_joins(run):
    """{node: its first node_joined time}."""
    out = {}
    for e in named(journal(run), "node_joined"):
        out.setdefault(e.get("node"), e["t"])
    return out


def storm(t, res):
    """Every simulator started at once: to all registered and the first plan."""
    c0 = cpu_s(t.coord.pid)
    t0 = t.start_simulators()
    done = wait_for(lambda: len(first_joins(t.run)) >= t.n, t.a.register_limit_s, 0.5)
    first = first_joins(t.run)
    times = sorted(first.values())
    ev = journal(t.run)
    res["registered"] = {"nodes": len(first), "node_joined_events": len(named(ev, "node_joined")),
                         "all_s": rounded(times[-1] - t0) if done else None,
                         "half_s": rounded(times[len(times) // 2] - t0) if times else None,
                         "limit_s": t.a.register_limit_s, "nodes_lost_meanwhile": len(named(ev, "node_lost")),
                         "coordinator_cores": rounded((cpu_s(t.coord.pid) - c0) / max(1e-3, time.time() - t0)),
                         "coordinator_hwm_bytes": status_bytes(t.coord.pid, "VmHWM")}
    first = wait_for(lambda: named(journal(t.run), "generation_started"), 60 if done else 5, 0.5)
    if not first:
        ev = journal(t.run)
        causes = {}
        for e in named(ev, "node_lost"):
            causes[str(e.get("cause"))] = causes.get(str(e.get("cause")), 0) + 1
        res["first_plan"] = {"error": "no generation planned: %d of %d nodes registered within %d s" % (
            len(first_joins(t.run)), t.n, t.a.register_limit_s), "node_lost_by_cause": causes,
            "nodes_quarantined": len(named(ev, "node_quarantined")), "simulators": sims_totals(t)}
        return False
    res["first_plan"] = {"after_start_s": rounded(first[0]["t"] - t0), "generation": first[0]["generation"]}
    wait_for(lambda: (plan_to_all(t, first[0]["generation"]) or {}).get("to_last_s") is not None, 60, 0.5)
    res["first_plan"].update(plan_to_all(t, first[0]["generation"]) or {})
    return True


def asked_interval(t):
    """The longest heartbeat interval the coordinator asked a node for (0: none asked)."""
    out = 0
    for _, path, _ in t.sims:
        stats = [e for e in sim_lines(path) if e.get("event") == "stats"]
        if stats:
            out = max(out, stats[-1].get("asked_interval_ms_max", 0))
    return out


def sims_totals(t):
    """The simulators' counters now (stats on demand), summed."""
    for i in range(len(t.sims)):
        t.tell(i, "stats")
    time.sleep(0.5)
    tot = {}
    for _, path, _ in t.sims:
        stats = [e for e in sim_lines(path) if e.get("event") == "stats"]
        if stats:
            for k, v in stats[-1].items():
                if isinstance(v, (int, float)) and k != "t":
                    tot[k] = tot.get(k, 0) + v
    return tot


def steady(t, res):
    """The coordinator's CPU and memory over a window with every node running."""
    time.sleep(t.a.settle_s)
    pid = t.coord.pid
    ev0 = len(journal(t.run))
    lost0 = len(named(journal(t.run), "node_lost"))
    gens0 = len(named(journal(t.run), "generation_started"))
    s0, c0, th0, sims0, w0 = sims_totals(t), cpu_s(pid), threads_cpu(pid), t.sims_cpu(), time.time()
    perf = start_perf(t, pid)
    time.sleep(t.a.steady_s)
    s1, c1, th1, sims1, w1 = sims_totals(t), cpu_s(pid), threads_cpu(pid), t.sims_cpu(), time.time()
    wall = w1 - w0
    per_thread = {k: rounded((v - th0.get(k, 0.0)) / wall) for k, v in th1.items() if v - th0.get(k, 0.0) > 0.005 * wall}
    res["steady"] = {
        "window_s": rounded(wall, 1), "coordinator_cores": rounded((c1 - c0) / wall),
        "coordinator_cores_by_thread": dict(sorted(per_thread.items(), key=lambda kv: -kv[1])),
        "coordinator_rss_bytes": status_bytes(pid, "VmRSS"), "coordinator_hwm_bytes": status_bytes(pid, "VmHWM"),
        "coordinator_threads": len(os.listdir("/proc/%d/task" % pid)),
        "simulators_cores": rounded((sims1 - sims0) / wall),
        "messages_to_coordinator_per_s": rounded((s1.get("sent", 0) - s0.get("sent", 0)) / wall, 1),
        "messages_from_coordinator_per_s": rounded((s1.get("received", 0) - s0.get("received", 0)) / wall, 1),
        "relays": s1.get("relays", 0), "via_relay": s1.get("via_relay", 0),
        "beats_to_relays_per_s": rounded((s1.get("relay_beats_sent", 0) - s0.get("relay_beats_sent", 0)) / wall, 1),
        "relay_answers_per_s": rounded((s1.get("relay_answers", 0) - s0.get("relay_answers", 0)) / wall, 1),
        "relayed_entries_sent_per_s": rounded((s1.get("relayed_entries_sent", 0) - s0.get("relayed_entries_sent", 0)) / wall, 1),
        "relay_give_ups_in_window": s1.get("relay_give_ups", 0) - s0.get("relay_give_ups", 0),
        "relay_unanswered_in_window": s1.get("relay_unanswered", 0) - s0.get("relay_unanswered", 0),
        "beats_for_groups_not_relayed_in_window": s1.get("relay_not_here", 0) - s0.get("relay_not_here", 0),
        "simulator_loop_stalls_in_window": s1.get("loop_stalls", 0) - s0.get("loop_stalls", 0),
        "heartbeat_interval_ms_configured": s1.get("heartbeat_interval_ms", 0) // max(1, len(t.sims)),
        "heartbeat_interval_ms_asked": asked_interval(t),
        "nodes_running": s1.get("running"), "nodes_registering": s1.get("registering"),
        "re_registers_in_window": s1.get("re_registers", 0) - s0.get("re_registers", 0),
        "nodes_lost_in_window": len(named(journal(t.run), "node_lost")) - lost0,
        "generations_in_window": len(named(journal(t.run), "generation_started")) - gens0,
        "journal_events_in_window": len(journal(t.run)) - ev0}
    if perf:
        res["steady"]["perf_top"] = perf_top(t, perf)


def start_perf(t, pid):
    """--perf: a flat profile of the coordinator over the steady window."""
    if not t.a.perf or not shutil.which("perf"):
        return None
    data = os.path.join(t.work, "perf.data")
    return subprocess.Popen(["perf", "record", "-F", "499", "-p", str(pid), "-o", data, "--", "sleep", str(t.a.steady_s)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), data


def perf_top(t, perf):
    """The symbols with the most samples: [{percent, thread, dso, symbol}]."""
    proc, data = perf
    proc.wait()
    rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "comm,dso,symbol", "--percent-limit", "0.7"],
                         capture_output=True, text=True, errors="replace")
    top = []
    for line in rep.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[0].endswith("%") and not line.lstrip().startswith("#"):
            sym = parts[3].split("] ", 1)[-1].strip().rstrip(" -")
            top.append({"percent": float(parts[0][:-1]), "thread": parts[1], "dso": parts[2], "symbol": sym[:160]})
    return top[:30]


def stopped_nodes(t):
    return {e["node"] for e in t.sim_events("silenced") + t.sim_events("closed")}


def losses(t, res, how, count, relays=False):
    """COUNT running nodes go silent (or close their socket), spread over the
    simulators (RELAYS: nodes that relay their group): node_lost minus each
    one's last message sent, nodes lost meanwhile that were not stopped, and
    the re-plan's time to the last node it names."""
    gens_before = {e["generation"] for e in named(journal(t.run), "generation_started")}
    word = "silenced" if how == "silent" else "closed"
    before = len(t.sim_events(word))
    t0 = time.time()
    procs = len(t.sims)
    for i in range(procs):
        share = count // procs + (1 if i < count % procs else 0)
        if share:
            t.tell(i, "%s %d%s" % (how, share, " relays" if relays else ""))
    stopped = wait_for(lambda: t.sim_events(word)[before:] if len(t.sim_events(word)) - before >= count else None, 10, 0.1) or []
    if not stopped:
        stopped = t.sim_events(word)[before:]
    ids = {e["node"]: e for e in stopped}
    key = how + ("_relays" if relays else "")
    if relays and not ids:  # relays went inactive (fewer members than cluster.relay_from_nodes)
        res[key] = {"nodes": 0, "note": "no running node relays its group now"}
        return
    limit = t.a.loss_limit_s

    def lost_now():
        got = {e["node"]: e for e in named(journal(t.run), "node_lost") if e.get("node") in ids}
        return got if len(got) >= len(ids) else None
    got = wait_for(lost_now, limit, 0.2) or {e["node"]: e for e in named(journal(t.run), "node_lost") if e.get("node") in ids}
    after_sent = [got[n]["t"] - ids[n]["last_sent_t"] for n in got]
    after_cmd = [got[n]["t"] - ids[n]["t"] for n in got]
    out = {"nodes": len(ids), "detected": len(got), "causes": sorted({str(e.get("cause")) for e in got.values()}),
           "after_last_sent_s": spread(after_sent), "after_command_s": spread(after_cmd),
           "coordinator_detected_after_s": spread([e.get("detected_after_s", 0) for e in got.values()]),
           "relays": sum(1 for e in ids.values() if e.get("relay")), "via_relay": sum(1 for e in ids.values() if e.get("via_relay"))}
    time.sleep(t.a.replan_wait_s)
    stopped = stopped_nodes(t)
    out["others_lost"] = len([e for e in named(journal(t.run), "node_lost") if e.get("node") not in stopped and e["t"] >= t0])
    new = sorted({e["generation"] for e in named(journal(t.run), "generation_started")} - gens_before)
    out["generations_after"] = len(new)
    plans = []
    for g in new[:3]:  # a coordinator that fell behind may re-plan hundreds of times
        wait_for(lambda: (plan_to_all(t, g) or {}).get("to_last_s") is not None, 30, 0.5)
        plans.append(plan_to_all(t, g))
    out["replans"] = plans
    out["plan_to_all_s_max"] = max((p["to_last_s"] for p in plans if p and p.get("to_last_s") is not None), default=None)
    res[key] = out


def log_counts(log):
    """What the coordinator's log says: lines, connections the handshake gate
    shed ("busy": the lines logged plus the "(N similar lines not logged)"
    its rate limit folded in), and stalls it noticed in itself."""
    busy = [line for line in log.splitlines() if "busy, too many connections" in line]
    folded = 0
    for line in busy:
        m = re.search(r"\((\d+) similar lines not logged\)", line)
        folded += int(m.group(1)) if m else 0
    return {"lines": log.count("\n"), "handshake_busy_lines": len(busy), "handshakes_shed": len(busy) + folded,
            "stalled_lines": log.count("the coordinator stalled")}


def one_n(a, n):
    res = {"nodes": n, "load_average_1m_at_start": float(text_of("/proc/loadavg").split()[0]),
           "simulator_processes": max(1, math.ceil(n / a.per_process)),
           "source_addresses": max(1, math.ceil(n / a.per_process)) * a.addresses}
    with tempfile.TemporaryDirectory(prefix="scale-nodes-") as work:
        t = trial(a, n, work)
        try:
            t.start_coordinator()
            if storm(t, res):
                steady(t, res)
                losses(t, res, "silent", a.lose)
                time.sleep(a.settle_s)
                losses(t, res, "close", a.lose)
                if a.lose_relays and res["steady"].get("relays"):
                    for how in ("silent", "close"):
                        time.sleep(a.settle_s)
                        losses(t, res, how, a.lose_relays, relays=True)
        except RuntimeError as e:
            res["error"] = str(e)
        finally:
            res["coordinator_exit"] = t.coord.poll() if t.coord else None
            if t.coord and t.coord.poll() is None:
                res["coordinator_hwm_bytes_end"] = status_bytes(t.coord.pid, "VmHWM")
            res["journal_counts"] = {}
            for e in journal(t.run):
                k = e.get("event", "?")
                res["journal_counts"][k] = res["journal_counts"].get(k, 0) + 1
            t.stop()
            res["coordinator_log"] = log_counts(text_of(os.path.join(work, "coordinator.log")))  # to its exit
            if a.keep:
                shutil.copytree(work, os.path.join(a.keep, "n%d" % n), dirs_exist_ok=True)
    return res


def figures_for(result):
    """Per N: the storm, the steady state, detection and the re-plan; only
    those the runs produced."""
    F = bench_meta.figure
    out = []
    for key in result["runs"]:
        n = "{:,}".format(int(key))
        for what, at, unit in (
                ("%s nodes: all registered after the cold start storm" % n, ["registered", "all_s"], "s"),
                ("%s nodes: nodes registered within the storm's limit" % n, ["registered", "nodes"], "count"),
                ("%s nodes: nodes declared lost during the storm" % n, ["registered", "nodes_lost_meanwhile"], "count"),
                ("%s nodes: connections the handshake gate shed (busy), whole run" % n, ["coordinator_log", "handshakes_shed"], "count"),
                ("%s nodes: coordinator CPU at steady state" % n, ["steady", "coordinator_cores"], "cores"),
                ("%s nodes: the simulators' CPU at steady state (the same 2 cores)" % n, ["steady", "simulators_cores"], "cores"),
                ("%s nodes: messages to the coordinator at steady state" % n, ["steady", "messages_to_coordinator_per_s"], "messages/s"),
                ("%s nodes: nodes that beat a heartbeat relay at steady state" % n, ["steady", "via_relay"], "count"),
                ("%s nodes: coordinator resident memory at steady state" % n, ["steady", "coordinator_rss_bytes"], "bytes"),
                ("%s nodes: a silent node's loss in the journal after its last message (worst of them)" % n,
                 ["silent", "after_last_sent_s", "max"], "s"),
                ("%s nodes: a closed node's loss in the journal after its last message (worst of them)" % n,
                 ["close", "after_last_sent_s", "max"], "s"),
                ("%s nodes: the re-plan after the silent nodes' loss, journal to the last node's receipt (worst)" % n,
                 ["silent", "plan_to_all_s_max"], "s"),
                ("%s nodes: a silent relay's loss in the journal after its last message (worst of them)" % n,
                 ["silent_relays", "after_last_sent_s", "max"], "s"),
                ("%s nodes: a closed relay's loss in the journal after its last message (worst of them)" % n,
                 ["close_relays", "after_last_sent_s", "max"], "s"),
                ("%s nodes: members lost with the silent relays (none expected)" % n, ["silent_relays", "others_lost"], "count"),
                ("%s nodes: members lost with the closed relays (none expected)" % n, ["close_relays", "others_lost"], "count")):
            try:
                bench_meta.lookup(result["runs"][key], at)
            except (KeyError, IndexError, TypeError):
                continue
            out.append(F(what, ["runs", key] + at, unit))
    return out


NOTES = ("One real coordinator (CURVE on, heartbeat and relay settings at their defaults: relays from 1,000 nodes, 64 a group) "
         "and simulated nodes (build/bench/scale_nodes: ZeroMQ DEALERs that register, heartbeat, report a ready rank and step "
         "reports as a node agent does, without ranks, and that dial again later each time their connection is shut before its "
         "handshake, as a node's bridge does), from up to 2,500 nodes per process, each process on 4 loopback source addresses. "
         "Heartbeat relays are simulated as a node agent runs them (a DEALER per member to its relay, CURVE, an answer per beat, "
         "give-ups and refusals), except that each simulator process binds one relay listener for all its nodes, where a real node "
         "binds its own. What the machine limits: its 2 cores are shared by the coordinator and the simulators (their CPU is in "
         "the JSON). With relays the members' beats and their answers (4 a second a node from 2,500 nodes on, each a CURVE message) "
         "move from the coordinator to the simulated relays, on the same 2 cores: the coordinator's load falls, the machine's does "
         "not. At 10,000 nodes the simulators' beats, answers and handshakes take the cores the cold start needs, and it does not "
         "complete within the limit here (the count registered is in the JSON). The descriptor limit is raised to the hard limit, "
         "loopback connections to one port are bounded by the ephemeral port range per source address, and every simulated "
         "node's plan is decoded on those same 2 cores. Each run's 1-minute load average at its start is in the JSON. The "
         "coordinator answers the nodes' ZMTP pings and sends none of its own, and a registration finds its node rank in "
         "O(log n). Loss times are from a simulated node's last message to the journal's node_lost: through a relay they "
         "include the simulated relay's own delay on the loaded machine. Single runs, not paired; a cold start's figures vary "
         "from run to run by tens of percent.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1000,3000,10000", help="comma-separated node counts")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "scale_nodes_results.json"))
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--sim", default=os.path.join(ROOT, "build", "bench", "scale_nodes"))
    ap.add_argument("--per-process", type=int, default=2500, help="simulated nodes per process at most")
    ap.add_argument("--addresses", type=int, default=4, help="loopback source addresses per simulator process")
    ap.add_argument("--report-every-s", type=float, default=5.0, help="step reports of each simulated rank")
    ap.add_argument("--settle-s", type=float, default=10.0, help="after the first plan reached all, before the steady window")
    ap.add_argument("--steady-s", type=float, default=20.0, help="the steady window")
    ap.add_argument("--lose", type=int, default=10, help="nodes made silent, then as many closed")
    ap.add_argument("--lose-relays", type=int, default=2,
                    help="then, where heartbeat relays are active, relays made silent, then as many closed (0: none)")
    ap.add_argument("--register-limit-s", type=float, default=180.0)
    ap.add_argument("--loss-limit-s", type=float, default=30.0)
    ap.add_argument("--replan-wait-s", type=float, default=3.0)
    ap.add_argument("--set", action="append", default=[], help="a coordinator config override (repeatable)")
    ap.add_argument("--sim-arg", action="append", default=[], help="an argument for every simulator (repeatable; what-ifs)")
    ap.add_argument("--perf", action="store_true", help="profile the coordinator over the steady window (perf record)")
    ap.add_argument("--keep", help="copy each run's directory (logs, journal, simulator lines) under this directory")
    a = ap.parse_args()
    limits = raise_fd_limit()
    result = {"machine_limits": machine_limits(), "fd_limit_in_force": list(limits), "settings": {
        "per_process": a.per_process, "addresses_per_process": a.addresses, "report_every_s": a.report_every_s,
        "steady_s": a.steady_s, "lose": a.lose, "lose_relays": a.lose_relays, "coordinator_sets": a.set, "simulator_args": a.sim_arg},
        "runs": {}}
    for n in [int(x) for x in a.nodes.split(",") if x]:
        print("scale_nodes: %d nodes ..." % n, file=sys.stderr, flush=True)
        result["runs"][str(n)] = one_n(a, n)
        print(json.dumps(result["runs"][str(n)], indent=1), file=sys.stderr, flush=True)
    bench_meta.write(a.out, result, title="The coordinator at 1,000 to 10,000 simulated nodes: registration storm, steady CPU and "
                     "memory, loss detection, a plan to all (CURVE on)", group="Control plane and security",
                     figures=figures_for(result), notes=NOTES)
    print("scale_nodes: wrote " + a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
