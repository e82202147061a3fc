#!/usr/bin/env python3
"""A scrape of the coordinator's /metrics while slow clients hold its HTTP
port: N connections that send nothing or trickle a request a byte every
half second, each reconnecting as soon as the server drops it (as an
attacker would). Prints and writes the JSON: scrape latency idle and under
the clients (median and max of the scrapes), the clients, and the
coordinator's RSS before and during.

usage: /usr/bin/python3 bench/scrape_slow_clients.py [--clients 100]
       [--scrapes 20] [--binary build/dtactor] [--out bench/scrape_slow_clients_results.json]
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402
from attacks import free_port, status_kb  # noqa: E402


def scrape(port):
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    s.close()
    if b" 200 " not in data.split(b"\r\n", 1)[0]:
        raise RuntimeError("scrape failed: %r" % data[:100])
    return time.monotonic() - t0


def slow_client(port, trickle, stop):
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.settimeout(0.5)
            msg = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10000
            i = 0
            while not stop.is_set():
                if trickle and i < len(msg):
                    s.send(msg[i:i + 1])
                    i += 1
                try:
                    if s.recv(1) == b"":
                        break  # dropped by the server: come back at once
                except socket.timeout:
                    pass
            s.close()
        except OSError:
            time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--binary", default="build/dtactor")
    ap.add_argument("--out", default="bench/scrape_slow_clients_results.json")
    a = ap.parse_args()
    http = free_port()
    run = tempfile.mkdtemp(prefix="dtactor-scrape-")
    coord = subprocess.Popen([a.binary, "--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % free_port(), "--run-dir", run + "/run",
                              "--metrics-port", str(http), "--metrics-addr", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                scrape(http)
                break
            except OSError:
                time.sleep(0.1)
        idle = [scrape(http) for _ in range(a.scrapes)]
        rss_idle = status_kb(coord.pid, "VmRSS")
        stop = threading.Event()
        threads = [threading.Thread(target=slow_client, args=(http, i % 2 == 1, stop), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(3)  # every client connected, the first ones dropped and back
        under = []
        for _ in range(a.scrapes):
            under.append(scrape(http))
            time.sleep(0.2)
        rss_attack = status_kb(coord.pid, "VmRSS")
        stop.set()
    finally:
        coord.terminate()
        coord.wait()
    result = {
        "clients": a.clients,
        "scrapes": a.scrapes,
        "idle": {"median_s": statistics.median(idle), "max_s": max(idle)},
        "slow_clients": {"median_s": statistics.median(under), "max_s": max(under)},
        "coordinator_rss_kb": {"idle": rss_idle, "under_slow_clients": rss_attack},
    }
    figures = [
        bench_meta.figure("a /metrics scrape beside %d slow clients, median" % a.clients, ["slow_clients", "median_s"], "s",
                          anchor="no other client", anchor_at=["idle", "median_s"]),
        bench_meta.figure("a /metrics scrape beside %d slow clients, slowest of %d" % (a.clients, a.scrapes), ["slow_clients", "max_s"], "s"),
    ]
    out = bench_meta.write(a.out, result, title="/metrics under slow HTTP clients (civetweb, 128 workers, 2 s to read a request)",
                           group="Control plane and security", figures=figures)
    print(out)


if __name__ == "__main__":
    main()
