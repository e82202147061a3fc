#!/usr/bin/python3
"""The coordinator's peak resident memory above idle under each attack of
the outside attack (bench/attacks.py), keyed (--key) and open, a fresh coordinator
for each: VmHWM after the attack less VmRSS when idle (/proc/PID/status).

  big_frame_268mb      8 connections each claim a 268 MB frame and send
                       64 MB of it (before the handshake when keyed; right
                       after the NULL one when open)
  near_limit_N         N connections each hold all but the last byte of a
                       frame just under the 2 MiB limit: the most a
                       connection can cost (keyed: released after the 3 s
                       handshake limit)
  half_open_garbage    1,000 half-open connections held, 1,000 of random bytes
  near_limit_256_both  keyed: 256 such connections at the control port and
                       256 at the rendezvous store's, at once, from one
                       address: what the handshake gate bounds
                       (net/handshake_gate.hpp; 8 places an address)
  near_limit_256_both_64_addresses
                       the same from 64 addresses (127.0.0.1-64): the gate's
                       10 places a port
  store_flood          open: 32 values of 8 MB and 2,000 of 60 KB at the
                       rendezvous store; keyed: 16 near-limit frames at its
                       port before the handshake
  utf8_flood           open: 20,000 envelopes with invalid UTF-8
  hostile_ids          open: escapes, newlines, NUL and 10 KB in every field

Prints the JSON and writes --out (bench/attack_rss_results.json).
usage: /usr/bin/python3 bench/attack_rss.py [--dtactor build/dtactor] [--out FILE]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attacks  # noqa: E402
import bench_meta  # noqa: E402


def measure(dtactor, keyed, attack):
    with attacks.Coordinator(dtactor, keyed) as c:
        idle = c.settle()
        t0 = time.time()
        held = attack(c) or []
        time.sleep(0.5)  # what the coordinator read is in its RSS
        out = {"idle_mb": round(idle, 1), "peak_mb": round(c.peak_mb(), 1), "above_idle_mb": round(c.peak_mb() - idle, 1),
               "attack_s": round(time.time() - t0, 2), "alive": c.alive()}
        for s in held:
            s.close()
        return out


def near(n):
    return lambda c: attacks.near_limit_frames(c.port, "CURVE" if c.keyed else "NULL", n, null_first=not c.keyed)


def attacks_table():
    mech = lambda c: "CURVE" if c.keyed else "NULL"  # noqa: E731
    both = {
        "big_frame_268mb": lambda c: attacks.big_frame(c.port, mech(c), null_first=not c.keyed)[0],
        "near_limit_8": near(8),
        "near_limit_16": near(16),
        "near_limit_64": near(64),
        "half_open_garbage": lambda c: attacks.half_open_and_garbage(c.port, connections=1000, garbage=1000),
        "store_flood": lambda c: (attacks.near_limit_frames(c.store_port, "CURVE", 16) if c.keyed else (attacks.store_flood(c.store_port), [])[1]),
    }
    keyed_only = {
        "near_limit_256_both": lambda c: near(256)(c) + attacks.near_limit_frames(c.store_port, "CURVE", 256),
        "near_limit_256_both_64_addresses": lambda c: (attacks.near_limit_frames(c.port, "CURVE", 256, sources=64) +
                                                       attacks.near_limit_frames(c.store_port, "CURVE", 256, sources=64)),
    }
    open_only = {
        "utf8_flood": lambda c: [attacks.utf8_flood(c.port)[0]],
        "hostile_ids": lambda c: [attacks.hostile_texts(c.port)[0]],
    }
    return both, keyed_only, open_only


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtactor", default=os.path.join(attacks.ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(attacks.HERE, "attack_rss_results.json"))
    a = ap.parse_args()
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    both, keyed_only, open_only = attacks_table()
    result = {"limits": {"max_control_message_bytes": 2 * attacks.MB, "handshake_timeout_s": 3, "max_pending_handshakes": 10, "max_pending_handshakes_per_address": 8, "store_total_bytes_before_any_plan": 8 * attacks.MB,
                         "store_value_bytes_before_any_plan": 64 * 1024},
              "attacks": {}}
    for name, attack in both.items():
        result["attacks"][name] = {"keyed": measure(a.dtactor, True, attack), "open": measure(a.dtactor, False, attack)}
        print(name, json.dumps(result["attacks"][name]), flush=True)
    for name, attack in keyed_only.items():
        result["attacks"][name] = {"keyed": measure(a.dtactor, True, attack)}
        print(name, json.dumps(result["attacks"][name]), flush=True)
    for name, attack in open_only.items():
        result["attacks"][name] = {"open": measure(a.dtactor, False, attack)}
        print(name, json.dumps(result["attacks"][name]), flush=True)
    F = bench_meta.figure
    figures = [
        F("keyed: 8 frames claiming 268 MB before the handshake",
          ["attacks", "big_frame_268mb", "keyed", "above_idle_mb"], "MB"),
        F("keyed: 16 frames of just under 2 MiB held before the handshake", ["attacks", "near_limit_16", "keyed", "above_idle_mb"], "MB"),
        F("keyed: 64 frames of just under 2 MiB held (2 MiB a connection, for 3 s)", ["attacks", "near_limit_64", "keyed", "above_idle_mb"], "MB"),
        F("keyed: 256 frames of just under 2 MiB at the control port and 256 at the store's, at once, from one address",
          ["attacks", "near_limit_256_both", "keyed", "above_idle_mb"], "MB"),
        F("keyed: the same from 64 addresses",
          ["attacks", "near_limit_256_both_64_addresses", "keyed", "above_idle_mb"], "MB"),
        F("keyed: 1,000 half-open and 1,000 garbage connections", ["attacks", "half_open_garbage", "keyed", "above_idle_mb"], "MB"),
        F("open: the rendezvous store flooded (8 MB values, then 2,000 of 60 KB)", ["attacks", "store_flood", "open", "above_idle_mb"], "MB"),
        F("open: 20,000 envelopes with invalid UTF-8", ["attacks", "utf8_flood", "open", "above_idle_mb"], "MB"),
    ]
    bench_meta.write(a.out, result, title="The coordinator's peak memory above idle under a stranger's attacks",
                     group="Control plane and security", figures=figures,
                     notes="A fresh coordinator alone per attack and mode; VmHWM after the attack less VmRSS when idle.")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
