#!/usr/bin/python3
"""Prints a TCP port that is free on every interface now, chosen at random
below the kernel's ephemeral range: a connection or a port-0 listener of
another test is never given it meanwhile (a port the kernel picks, in that
range, can be). With --block N: the first of N consecutive such ports.

Usage: tests/free_port.py [--block N]"""
import random
import socket
import sys


def free(port):
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def main():
    block = int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--block" else 1
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(500):
        base = random.randrange(10000, max(10001, low - block))
        if all(free(p) for p in range(base, base + block)):
            print(base)
            return
    sys.exit("free_port.py: no free block of %d ports below %d" % (block, low))


if __name__ == "__main__":
    main()
