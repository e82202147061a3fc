#!/usr/bin/python3
"""Issue 47's attacks as processes against a real coordinator, keyed and
open, each with its bound (ctest label `adversarial`; bench/attacks.py has
the attacks, bench/attack_rss.py the figures).

Usage: tests/adversarial_test.py DTACTOR CASE
  big_frame_keyed, big_frame_open   8 connections each claim a 268 MB frame
                                    before (keyed) or right after (open) the
                                    handshake and send 64 MB of it: the
                                    coordinator's peak RSS stays within 64 MB
                                    of idle (it was 2 GB: 256 MiB a frame)
  garbage_keyed, garbage_open       200 half-open connections and 200 of
                                    random bytes: within 64 MB, still serving,
                                    each counted (keyed: the garbage too)
  handshake_flood_keyed             256 near-limit frames before the
                                    handshake at each port from 64
                                    addresses: within 64 MB, shed as busy
  hostile_ids                       escapes, newlines, NUL, bidi overrides,
                                    invalid UTF-8 and 10 KB in every field an
                                    open coordinator prints: every log and
                                    journal line one bounded printable line
  utf8_flood                        20,000 envelopes with invalid UTF-8: at
                                    most a burst of libprotobuf lines plus one
                                    a second (it was 20,000 lines)
  store_flood                       an open store: 8 MB values and 2,000 of
                                    60 KB: refused with a reason, within 64 MB
  store_bind                        --listen 127.0.0.1: the store does not
                                    answer on 127.0.0.2 (it bound every
                                    interface)
  bad_command_lines                 exit 2, one line, no run directory
Exit 0 when the bound holds; 1 with one line saying which did not."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import attacks  # noqa: E402
from attacks import MB, Coordinator  # noqa: E402

MAX_GROWTH_MB = 64


def check(ok, why):
    if not ok:
        print("adversarial: FAILED: " + why, flush=True)
        raise SystemExit(1)


def memory_bound(c, idle, what):
    peak = c.peak_mb()
    print("%s: idle %.1f MB, peak %.1f MB (+%.1f MB)" % (what, idle, peak, peak - idle), flush=True)
    check(peak - idle <= MAX_GROWTH_MB, "%s: the coordinator's peak RSS rose %.1f MB above idle (%.1f -> %.1f), over %d MB" %
          (what, peak - idle, idle, peak, MAX_GROWTH_MB))
    check(c.alive(), "%s: the coordinator died: %s" % (what, c.text()[-2000:]))


def big_frame(dtactor, keyed):
    with Coordinator(dtactor, keyed) as c:
        idle = c.settle()
        held, sent = attacks.big_frame(c.port, "CURVE" if keyed else "NULL", null_first=not keyed)
        # The store's port takes the same before its handshake.
        held2, sent2 = attacks.big_frame(c.store_port, "CURVE" if keyed else "NULL", connections=4, send_mb=32, null_first=not keyed)
        print("sent %d MB to the coordinator's port, %d MB to the store's" % (sent, sent2))
        memory_bound(c, idle, "big frame (%s)" % ("keyed" if keyed else "open"))
        for s in held + held2:
            s.close()


def garbage(dtactor, keyed):
    with Coordinator(dtactor, keyed, metrics=True) as c:
        idle = c.settle()
        held = attacks.half_open_and_garbage(c.port) + attacks.half_open_and_garbage(c.store_port, connections=50, garbage=50)
        memory_bound(c, idle, "garbage and half-open (%s)" % ("keyed" if keyed else "open"))
        # Still serving: /metrics answers, and counts every connection as a
        # refused handshake: the half-open ones shed as they came (busy) or
        # dropped at libzmq's handshake limit (3 s), and the garbage,
        # including what a keyed socket refuses at the greeting with no
        # event of libzmq's own (net/handshake_gate.hpp).
        import urllib.request

        def refused():
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % c.metrics_port, timeout=10).read().decode()
            return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("dtactor_refused_handshakes_total"))
        end = time.time() + 30
        expected = 400 if keyed else 200
        while refused() < expected and time.time() < end:
            time.sleep(0.2)
        print("refused handshakes counted: %d" % refused())
        check(refused() >= expected, "the coordinator counted %d refused handshakes of 200 half-open and 200 garbage connections, expected %d" %
              (refused(), expected))
        check(b"refused a connection on link 'nodes' from 127.0.0.1:" in c.raw_log(), "no log line names a refused peer's address")
        for s in held:
            s.close()


def handshake_flood(dtactor):
    """256 connections at each of the keyed coordinator's two ports, from 64
    addresses, each holding a frame just under the 2 MiB limit before its
    handshake: the gate keeps 10 a port, so within 64 MB; the shed ones are
    counted as busy."""
    with Coordinator(dtactor, True, metrics=True) as c:
        idle = c.settle()
        held = (attacks.near_limit_frames(c.port, "CURVE", 256, sources=64) +
                attacks.near_limit_frames(c.store_port, "CURVE", 256, sources=64))
        memory_bound(c, idle, "handshake flood from 64 addresses (keyed)")
        import urllib.request
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % c.metrics_port, timeout=10).read().decode()
        busy = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith('dtactor_refused_handshakes_total{') and 'reason="busy"' in l)
        print("shed as busy at the control port: %d" % busy)
        check(busy >= 200, "only %d of 256 connections at the control port were shed (busy)" % busy)
        for s in held:
            s.close()


def printable_line(line):
    return all(b >= 0x20 and b != 0x7F for b in line)


def strings_in(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from strings_in(x)
    elif isinstance(v, list):
        for x in v:
            yield from strings_in(x)


def hostile_ids(dtactor):
    with Coordinator(dtactor, False, metrics=True) as c:
        s, sent = attacks.hostile_texts(c.port)
        # Every envelope read: the bridge counted or handed each on.
        time.sleep(0.5)
        end = time.time() + 30
        # Each leave that parses is logged (invalid UTF-8 does not parse).
        leaves = sum(1 for h in attacks.HOSTILE if "\udcff" not in h)
        while time.time() < end and c.raw_log().count(b"left:") < leaves:
            time.sleep(0.1)
        s.close()
        check(c.alive(), "the coordinator died: " + c.text()[-2000:])
        logs = {"stderr": c.raw_log()}
        try:
            with open(os.path.join(c.run, "train.log"), "rb") as f:
                logs["train.log"] = f.read()
        except FileNotFoundError:
            pass
        for name, raw in logs.items():
            lines = raw.split(b"\n")
            longest = max(len(l) for l in lines)
            print("%s: %d lines, the longest %d bytes" % (name, len(lines), longest))
            for l in lines:
                check(printable_line(l), "%s: an unprintable line: %r" % (name, l[:300]))
                check(len(l) <= 2000, "%s: a line of %d bytes: %r..." % (name, len(l), l[:200]))
                check(not l.startswith(b"coordinator: job finished at step 999999"), "%s: a forged line: %r" % (name, l))
        text = logs["stderr"]
        for want in (b"refused node 'evil\\x1b[2J", b"left: ", b"more than cluster.max_ranks_per_node"):
            check(want in text, "the coordinator's log lacks %r (did the attack reach it?): %s" % (want, text[-3000:].decode(errors="replace")))
        import urllib.request
        for path in ("/metrics", "/status.json"):
            body = urllib.request.urlopen("http://127.0.0.1:%d%s" % (c.metrics_port, path), timeout=10).read()
            for l in body.split(b"\n"):
                check(printable_line(l) and (path != "/metrics" or len(l) <= 4000), "%s: an unprintable or long line: %r" % (path, l[:300]))
            if path == "/status.json":
                for v in strings_in(json.loads(body)):
                    check(all(ord(ch) >= 0x20 and ord(ch) != 0x7F for ch in v) and len(v) <= 2000, "/status.json holds an unprintable or long string %r" % v[:200])
        for e in attacks.journal(c.run):
            for v in strings_in(e):
                check(all(ord(ch) >= 0x20 and ord(ch) != 0x7F and not 0x80 <= ord(ch) <= 0x9F for ch in v),
                      "journal event %s holds an unprintable string %r" % (e.get("event"), v[:200]))
                check(len(v) <= 2000, "journal event %s holds a string of %d characters" % (e.get("event"), len(v)))


def utf8_flood(dtactor):
    with Coordinator(dtactor, False) as c:
        t0 = time.time()
        s, frames = attacks.utf8_flood(c.port)
        time.sleep(1.0)
        # Wait until the bridge has read them all (the garbage count in /proc
        # is not exposed; the log's growth stopping is enough).
        last, end = -1, time.time() + 60
        while time.time() < end:
            n = c.raw_log().count(b"libprotobuf")
            if n == last:
                break
            last = n
            time.sleep(1.0)
        elapsed = time.time() - t0
        s.close()
        lines = c.raw_log().count(b"libprotobuf")
        bound = 10 + int(elapsed) + 2
        print("%d frames with invalid UTF-8 in %.1f s: %d libprotobuf lines (bound %d)" % (frames, elapsed, lines, bound))
        check(lines <= bound, "%d libprotobuf lines for %d frames in %.1f s, over %d" % (lines, frames, elapsed, bound))
        check(c.alive(), "the coordinator died")


def store_flood(dtactor):
    with Coordinator(dtactor, False) as c:
        idle = c.settle()
        errors = attacks.store_flood(c.store_port)
        memory_bound(c, idle, "store flood (open)")
        print("refusals: %d, e.g. %r" % (len(errors), errors[:1]))
        check(any("the rendezvous store is full" in e for e in errors), "no 'store is full' refusal came back: %r" % errors[:3])
        check("rendezvous store: refused a request" in c.text(), "no log line for the refusals")
        check(c.text().count("rendezvous store: refused a request") <= 10 + 60, "the refusals' log lines are not rate-limited")


def store_bind(dtactor):
    with Coordinator(dtactor, False) as c:
        try:
            s = socket.create_connection(("127.0.0.2", c.store_port), timeout=5)
            s.close()
            check(False, "the store (--listen 127.0.0.1) accepted a connection on 127.0.0.2:%d" % c.store_port)
        except ConnectionRefusedError:
            pass
        s = socket.create_connection(("127.0.0.1", c.store_port), timeout=5)
        s.close()


def bad_command_lines(dtactor):
    listen = "tcp://127.0.0.1:%d" % attacks.free_port()  # valid, never bound: each case is refused before
    cases = [
        ["--role", "coordinator", "--listen", listen, "--metrics-port", "70000"],
        ["--role", "coordinator", "--listen", listen, "--metrics-port", "9", "--metrics-addr", "999.1.1.1"],
        ["--role", "coordinator", "--listen", listen, "--config", "/dev/zero"],
        ["--role", "coordinator", "--listen", listen, "--config", "/"],
        ["--role", "coordinator", "--listen", listen, "--set", "train.threads=100000"],
        ["train", "--config", "/"],
        ["train", "--config", "/dev/zero"],
        ["train", "--set", "train.threads=100000"],
        ["local", "--nodes", "100000"],
        ["local", "--metrics-addr", "999.1.1.1"],
        ["--role", "node", "--coordinator", "tcp://127.0.0.1:9", "--metrics-addr", "nonsense"],
    ]
    for args in cases:
        with tempfile.TemporaryDirectory() as d:
            run_dir = os.path.join(d, "run")
            p = subprocess.run([dtactor, *args, "--run-dir", run_dir] if args[0] != "--role" or args[1] != "node" else [dtactor, *args],
                               capture_output=True, timeout=60, cwd=d)
            err = p.stderr.decode(errors="replace").strip().splitlines()
            print("%s -> exit %d: %s" % (" ".join(args), p.returncode, err[-1] if err else ""))
            check(p.returncode == 2, "%s: exit %d, not 2: %s" % (" ".join(args), p.returncode, p.stderr.decode(errors="replace")[-500:]))
            check(len(err) == 1, "%s: %d lines, not one: %r" % (" ".join(args), len(err), err))
            check(os.listdir(d) == [], "%s: created %s before refusing" % (" ".join(args), os.listdir(d)))


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        raise SystemExit(2)
    dtactor, case = os.path.abspath(sys.argv[1]), sys.argv[2]
    cases = {
        "big_frame_keyed": lambda: big_frame(dtactor, True),
        "big_frame_open": lambda: big_frame(dtactor, False),
        "garbage_keyed": lambda: garbage(dtactor, True),
        "garbage_open": lambda: garbage(dtactor, False),
        "handshake_flood_keyed": lambda: handshake_flood(dtactor),
        "hostile_ids": lambda: hostile_ids(dtactor),
        "utf8_flood": lambda: utf8_flood(dtactor),
        "store_flood": lambda: store_flood(dtactor),
        "store_bind": lambda: store_bind(dtactor),
        "bad_command_lines": lambda: bad_command_lines(dtactor),
    }
    if case not in cases:
        print("unknown case %r; one of %s" % (case, ", ".join(cases)))
        raise SystemExit(2)
    cases[case]()
    print("adversarial %s: passed" % case)


if __name__ == "__main__":
    main()
