#!/usr/bin/python3.11
"""A flood at a training job's ports (issue 27): a coordinator and one node
(one rank) started by hand on this machine train while a stranger sends
--frames garbage frames and holds --half-open connections open.

  - garbage frames: ZMTP sessions that complete the NULL handshake as a
    DEALER and then send frames of random bytes (1-300 bytes), spread over
    the coordinator's port, the rendezvous store's port and the node's ipc
    socket for its ranks (the one a rank's frames arrive on). With --key the
    job is keyed: no NULL session completes, so each "frame" is a fresh
    connection's greeting followed by random bytes instead;
  - half-open connections: TCP connections to the coordinator's and the
    store's ports that send half a ZMTP greeting and then nothing, held open
    until the end.

Checks (exit 1 on any failure, one line each): training goes on through the
flood (steps advance while it lasts, and --after steps after it), no node
lost and no new generation, the coordinator counts the garbage it dropped
(dtactor_wire_dropped_frames_total on /metrics, so the frames did arrive),
and resident memory stays bounded (RSS before and after for the coordinator,
the node and the rank; --max-growth-mb each).
Prints JSON (figures for the README) and writes --out if given.
Usage: bench/flood.py [--frames 100000] [--half-open 1000] [--after 20]
  [--key] [--nofile-soft N] [--set KEY=VALUE ...] [--dtactor build/dtactor]
  [--out FILE]"""
import argparse
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
ROOT = os.path.dirname(HERE)


def journal(rd):
    out = []
    try:
        for line in open(os.path.join(rd, "journal.jsonl")):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except FileNotFoundError:
        pass
    return out


def last_step(rd):
    s = [e["step"] for e in journal(rd) if e.get("event") == "step"]
    return max(s) if s else -1


def wait_for(what, pred, procs, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        r = pred()
        if r:
            return r
        for p in procs:
            if p.poll() is not None:
                fail("%s: a process of the job ended (exit %s) while waiting for %s" % (p.args[0], p.returncode, what))
        time.sleep(0.02)
    fail("timed out waiting for " + what)


def fail(why):
    print("flood: FAILED: " + why, file=sys.stderr, flush=True)
    raise SystemExit(1)


def rss_mb(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def children(pid):
    out = []
    for t in glob.glob("/proc/%d/task/*/children" % pid):
        try:
            out += [int(x) for x in open(t).read().split()]
        except FileNotFoundError:
            pass
    return out


GREETING_NULL = b"\xff" + b"\x00" * 7 + b"\x01\x7f" + b"\x03\x01" + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31


def ready_command():
    props = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    body = b"\x05READY" + props
    return b"\x04" + bytes([len(body)]) + body


def connect(addr, source=None):
    """`source`: the local address to connect from (TCP; any 127.x.y.z works
    on loopback)."""
    if isinstance(addr, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:
            s.bind((source, 0))
    s.settimeout(10)
    s.connect(addr)
    return s


def recv_exactly(s, n):
    got = b""
    while len(got) < n:
        d = s.recv(n - len(got))
        if not d:
            raise ConnectionError("closed during the handshake")
        got += d
    return got


def garbage_frames(n, rng):
    out = bytearray()
    for _ in range(n):
        size = rng.randint(1, 300)
        payload = rng.randbytes(size)
        if size < 256:
            out += bytes([0x00, size]) + payload
        else:
            out += bytes([0x02]) + size.to_bytes(8, "big") + payload
    return bytes(out)


def flood_open(addr, frames, rng, held):
    """One NULL session as a DEALER, then `frames` garbage frames; the
    session stays open (in `held`: a peer that disconnects takes what ZeroMQ
    still queues for it along). Returns the frames sent. From 127.0.0.2: the
    half-open connections from 127.0.0.1 hold that address's places in the
    handshake (net/handshake_gate.hpp), which would shed this one."""
    s = connect(addr, source="127.0.0.2")
    held.append(s)
    if True:
        s.sendall(GREETING_NULL[:10])
        recv_exactly(s, 11)
        s.sendall(GREETING_NULL[10:])
        recv_exactly(s, 53)
        s.sendall(ready_command())
        sent = 0
        while sent < frames:
            n = min(5000, frames - sent)
            s.sendall(garbage_frames(n, rng))
            sent += n
        return sent


def flood_keyed(addr, frames, rng, held):
    """Fresh connections, each a greeting asking for CURVE then random bytes."""
    greeting = b"\xff" + b"\x00" * 7 + b"\x01\x7f" + b"\x03\x01" + b"CURVE" + b"\x00" * 15 + b"\x00" + b"\x00" * 31
    for _ in range(frames):
        try:
            s = connect(addr)
            s.sendall(greeting + rng.randbytes(rng.randint(1, 300)))
            s.close()
        except OSError:
            pass
    return frames


def dropped_frames(metrics_port):
    try:
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics_port, timeout=10).read().decode()
    except OSError:
        return 0
    return sum(float(m.group(1)) for m in re.finditer(r'^dtactor_wire_dropped_frames_total\{[^}]*\} (\S+)$', text, re.M))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=100000)
    ap.add_argument("--half-open", type=int, default=1000)
    ap.add_argument("--after", type=int, default=20)
    ap.add_argument("--max-growth-mb", type=float, default=64.0)
    ap.add_argument("--key", action="store_true")
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--nofile-soft", type=int, default=0,
                    help="start the job's processes with this soft limit of open files (Debian's default is 1024)")
    ap.add_argument("--set", action="append", default=[], help="extra dtactor config KEY=VALUE (repeatable)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    # This process holds every connection it makes.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < a.half_open + 200:
        fail("the hard limit of open files (%d) is below --half-open + 200" % hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile_soft, hard))) if a.nofile_soft else None
    rng = random.Random(27)
    rd = tempfile.mkdtemp(prefix="flood-")
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ)
    env.pop("DTACTOR_KEY_FILE", None)
    key_args = []
    if a.key:
        subprocess.run([a.dtactor, "keygen", "--out", rd + "/job.key"], check=True, stdout=subprocess.DEVNULL)
        key_args = ["--key", rd + "/job.key"]
    sets = []
    for s in ("train.max_steps=100000000", "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=1", "cluster.min_nodes=1",
              "train.global_batch_size=32", *a.set):
        sets += ["--set", s]
    logs = [open(os.path.join(rd, n), "w") for n in ("coordinator.log", "node.log")]
    coord = subprocess.Popen([a.dtactor, "--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % port, "--metrics-port", str(metrics_port),
                              "--run-dir", rd + "/run", "--no-resume", *key_args, *sets], stdout=logs[0], stderr=subprocess.STDOUT, env=env, preexec_fn=limit)
    procs = [coord]
    held = []
    result = {"frames": a.frames, "half_open": a.half_open, "keyed": a.key}
    try:
        run = rd + "/run"
        wait_for("the coordinator", lambda: any(e.get("event") == "coordinator_started" for e in journal(run)), procs)
        store_port = next(e["store_port"] for e in journal(run) if e.get("event") == "coordinator_started")
        node_started = time.time()
        node = subprocess.Popen([a.dtactor, "--role", "node", "--coordinator", "tcp://127.0.0.1:%d" % port, "--node-id", "n1",
                                 "--advertise-addr", "127.0.0.1", "--threads-per-rank", "1", *key_args],
                                stdout=logs[1], stderr=subprocess.STDOUT, env=env, preexec_fn=limit)
        procs.append(node)
        wait_for("step 20", lambda: last_step(run) >= 20, procs)
        ranks = children(node.pid)
        # This node's socket: a node killed earlier (kill -9 leaves its
        # socket file) whose pid this one reuses has a stale one of the same
        # prefix, which refuses connections.
        ipc = [p for p in glob.glob("/tmp/dtactor-%d-*.ipc" % node.pid) if os.stat(p).st_mtime >= node_started - 1]
        if not ranks or not ipc:
            fail("no rank process or no ipc socket of the node (ranks %s, ipc %s)" % (ranks, ipc))
        pids = {"coordinator": coord.pid, "node": node.pid, "rank": ranks[0]}
        before = {k: rss_mb(p) for k, p in pids.items()}
        dropped_before = dropped_frames(metrics_port)
        gens_before = len([e for e in journal(run) if e.get("event") == "generation_started"])
        step_before = last_step(run)
        t0 = time.time()
        # Half-open connections, held to the end.
        half = b"\xff" + b"\x00" * 4
        for i in range(a.half_open):
            try:
                s = connect(("127.0.0.1", port if i % 2 == 0 else store_port))
                s.sendall(half)
                held.append(s)
            except OSError as e:
                fail("half-open connection %d refused: %s" % (i, e))
        # Garbage frames: half at the coordinator, a quarter each at the store and the node's ipc socket.
        targets = [("127.0.0.1", port), ("127.0.0.1", store_port), ipc[0]]
        shares = [a.frames // 2, a.frames // 4, a.frames - a.frames // 2 - a.frames // 4]
        sent = 0
        for addr, n in zip(targets, shares):
            for chunk in range(0, n, 10000):
                m = min(10000, n - chunk)
                sent += (flood_keyed if a.key else flood_open)(addr, m, rng, held)
                for p in procs:
                    if p.poll() is not None:
                        fail("%s ended during the flood (exit %s)" % (p.args[0], p.returncode))
        flood_s = time.time() - t0
        step_flood_end = last_step(run)
        if step_flood_end <= step_before:
            fail("no step completed during the flood (%.1f s): step %d before, %d after" % (flood_s, step_before, step_flood_end))
        wait_for("%d steps after the flood" % a.after, lambda: last_step(run) >= step_flood_end + a.after, procs)
        if not a.key:
            # The coordinator counts what it dropped as its bridge reads it.
            end = time.time() + 60
            while dropped_frames(metrics_port) - dropped_before < shares[0] and time.time() < end:
                time.sleep(0.1)
        after = {k: rss_mb(p) for k, p in pids.items()}
        dropped = dropped_frames(metrics_port) - dropped_before
        j = journal(run)
        lost = [e for e in j if e.get("event") in ("node_lost", "rank_lost", "job_failed")]
        gens_after = len([e for e in j if e.get("event") == "generation_started"])
        result.update({"sent": sent, "flood_s": round(flood_s, 2), "steps_during_flood": step_flood_end - step_before,
                       "rss_mb_before": {k: round(v, 1) for k, v in before.items()}, "rss_mb_after": {k: round(v, 1) for k, v in after.items()},
                       "coordinator_dropped_frames": dropped, "new_generations": gens_after - gens_before, "lost_events": len(lost)})
        print(json.dumps(result), flush=True)
        if lost:
            fail("the job lost a member: %s" % lost[0])
        if gens_after != gens_before:
            fail("a new generation started during the flood")
        for k in pids:
            if after[k] - before[k] > a.max_growth_mb:
                fail("%s grew from %.1f MB to %.1f MB" % (k, before[k], after[k]))
        if not a.key and dropped < shares[0] * 0.99:
            fail("the coordinator counted %d dropped frames of the %d sent to it" % (dropped, shares[0]))
        if a.out:
            F = bench_meta.figure
            bench_meta.write(a.out, result, "Garbage frames and half-open connections at the coordinator, %s" % ("a keyed job" if a.key else "an open job"),
                             "Control plane and security", [
                                 F("steps trained during the flood", ["steps_during_flood"], "steps"),
                                 F("membership changes caused (new generations)", ["new_generations"], "count"),
                                 F("events lost", ["lost_events"], "count"),
                                 F("coordinator resident memory after the flood", ["rss_mb_after", "coordinator"], "MB", "before it",
                                   ["rss_mb_before", "coordinator"])])
    finally:
        for s in held:
            s.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    subprocess.run(["rm", "-rf", rd])


if __name__ == "__main__":
    main()
