#!/usr/bin/env python3
"""The coordinator's footprint: start time (process start to its
"listening on" line) and resident memory (VmRSS / VmHWM from
/proc/PID/status once it listens), median of N runs, each in a fresh run
directory; the process is then stopped with SIGTERM.

Usage: bench/coordinator_footprint.py [--runs 7] [--settle 0.5] BINARY [BINARY...]
Prints one JSON object: a row per binary; the last is the figure, the first
its anchor (the same run).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def one_run(binary, settle):
    with tempfile.TemporaryDirectory() as run_dir:
        port = free_port()
        t0 = time.monotonic()
        p = subprocess.Popen([binary, "--role", "coordinator", "--listen", f"tcp://127.0.0.1:{port}", "--run-dir", run_dir],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in p.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        else:
            p.wait()
            sys.exit(f"{binary}: no 'listening on' line (exit {p.returncode}): {''.join(lines)}")
        start_s = time.monotonic() - t0
        time.sleep(settle)
        rss, hwm = status_kib(p.pid, "VmRSS"), status_kib(p.pid, "VmHWM")
        p.send_signal(signal.SIGTERM)
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return start_s, rss, hwm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds after the listening line before reading /proc")
    ap.add_argument("binaries", nargs="+")
    a = ap.parse_args()
    results = {b: [] for b in a.binaries}
    for _ in range(a.runs):  # interleaved, so that both see the same host load
        for b in a.binaries:
            results[b].append(one_run(b, a.settle))
    rows = []
    for b, runs in results.items():
        start = [r[0] for r in runs]
        rows.append({
            "binary": b,
            "runs": len(runs),
            "start_s_median": round(statistics.median(start), 4),
            "start_s_min": round(min(start), 4),
            "start_s_max": round(max(start), 4),
            "vmrss_mib_median": round(statistics.median(r[1] for r in runs) / 1024, 1),
            "vmhwm_mib_median": round(statistics.median(r[2] for r in runs) / 1024, 1),
        })
    # The last binary is the one measured; the first, where there are two or
    # more, its anchor (e.g. the build before a change), in the same run.
    F = bench_meta.figure
    last, first = len(rows) - 1, 0
    anchor = (lambda at: {"anchor": "%s (the first binary given)" % rows[0]["binary"], "anchor_at": ["results", first, at]}) \
        if len(rows) > 1 else (lambda at: {})
    figures = [dict(F("start, process start to listening (median)", ["results", last, "start_s_median"], "s"), **anchor("start_s_median")),
               dict(F("resident memory (VmRSS) %.1f s after the start (median)" % a.settle, ["results", last, "vmrss_mib_median"], "MiB"),
                    **anchor("vmrss_mib_median"))]
    print(json.dumps(bench_meta.stamped({"results": rows}, "The coordinator process: start and resident memory, median of %d"
                                        % a.runs, "Control plane and security", figures), indent=1))


if __name__ == "__main__":
    main()
