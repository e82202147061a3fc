"""Attacks on a coordinator from a stranger on the network, as raw
sockets: hand-made ZMTP greetings and frames, hand-encoded Protobuf
envelopes, no ZeroMQ or Protobuf library. Used by tests/adversarial_test.py
(each attack with its bound, in CI) and bench/attack_rss.py (the
coordinator's peak memory under each). Stdlib only.

A coordinator is started alone (no node: nothing trains, so its memory is
the control plane's), keyed (--key) or open; its resident memory is read
from /proc/PID/status (VmRSS when idle, VmHWM: the peak since it started).
"""
import json
import os
import random
import socket
import subprocess
import tempfile
import time
from bench_net import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MB = 1024 * 1024


def fail(why):
    raise SystemExit("attack: FAILED: " + why)


# ---- processes -------------------------------------------------------------

def journal(run_dir):
    out = []
    try:
        with open(os.path.join(run_dir, "journal.jsonl"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def status_kb(pid, field):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Coordinator:
    """A coordinator on 127.0.0.1 in a temporary directory; stderr goes to
    coordinator.log there. Use as a context manager."""

    def __init__(self, dtactor, keyed, sets=(), metrics=False):
        self.dir = tempfile.mkdtemp(prefix="attack-")
        self.run = os.path.join(self.dir, "run")
        self.port = free_port()
        self.metrics_port = free_port() if metrics else 0
        self.log_path = os.path.join(self.dir, "coordinator.log")
        args = [dtactor, "--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % self.port, "--run-dir", self.run, "--no-resume",
                "--set", "cluster.min_nodes=1", "--set", "train.max_steps=1000000"]
        if metrics:
            args += ["--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1"]
        for s in sets:
            args += ["--set", s]
        env = dict(os.environ)
        env.pop("DTACTOR_KEY_FILE", None)
        if keyed:
            key = os.path.join(self.dir, "job.key")
            subprocess.run([dtactor, "keygen", "--out", key], check=True, stdout=subprocess.DEVNULL)
            args += ["--key", key]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.keyed = keyed
        end = time.time() + 60
        started = []
        while not started:
            if self.proc.poll() is not None:
                fail("the coordinator exited (%s): %s" % (self.proc.returncode, self.text()[-2000:]))
            if time.time() > end:
                fail("the coordinator did not start: " + self.text()[-2000:])
            started = [e for e in journal(self.run) if e.get("event") == "coordinator_started"]
            time.sleep(0.02)
        self.store_port = started[0]["store_port"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not os.environ.get("DTACTOR_KEEP_TEST_DIRS"):
            subprocess.run(["rm", "-rf", self.dir])

    def alive(self):
        return self.proc.poll() is None

    def rss_mb(self):
        return status_kb(self.proc.pid, "VmRSS") / 1024.0

    def peak_mb(self):
        return status_kb(self.proc.pid, "VmHWM") / 1024.0

    def settle(self, seconds=1.0):
        """The idle RSS: the lowest of a few readings once start-up is over."""
        end = time.time() + seconds
        low = self.rss_mb()
        while time.time() < end:
            time.sleep(0.05)
            low = min(low, self.rss_mb())
        return low

    def text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def raw_log(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()


# ---- ZMTP 3.0 by hand -------------------------------------------------------

def greeting(mechanism):
    m = mechanism.encode()
    return b"\xff" + b"\x00" * 7 + b"\x01\x7f" + b"\x03\x01" + m + b"\x00" * (20 - len(m)) + b"\x00" + b"\x00" * 31


def frame(payload, more=False):
    n = len(payload)
    if n < 256:
        return bytes([0x01 if more else 0x00, n]) + payload
    return bytes([0x03 if more else 0x02]) + n.to_bytes(8, "big") + payload


def frame_header(claimed, more=False):
    return bytes([0x03 if more else 0x02]) + claimed.to_bytes(8, "big")


def ready(socket_type=b"DEALER", identity=b""):
    props = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    if identity:
        props += b"\x08Identity" + len(identity).to_bytes(4, "big") + identity
    body = b"\x05READY" + props
    if len(body) < 256:
        return b"\x04" + bytes([len(body)]) + body
    return b"\x06" + len(body).to_bytes(8, "big") + body


def connect(port, host="127.0.0.1", timeout=10, source=None):
    """A TCP connection; `source`: the local address to connect from (any
    127.x.y.z works on loopback, so one machine can play many peers)."""
    s = socket.create_connection((host, port), timeout=timeout, source_address=(source, 0) if source else None)
    return s


def recv_exactly(s, n):
    got = b""
    while len(got) < n:
        d = s.recv(n - len(got))
        if not d:
            raise ConnectionError("closed")
        got += d
    return got


def null_session(port, identity=b""):
    """A completed NULL handshake as a DEALER (an open coordinator or store)."""
    s = connect(port)
    s.sendall(greeting("NULL"))
    recv_exactly(s, 64)
    s.sendall(ready(identity=identity))
    # The server's READY command.
    head = recv_exactly(s, 2)
    size = head[1] if head[0] == 0x04 else int.from_bytes(recv_exactly(s, 7), "big") if head[0] == 0x06 else 0
    recv_exactly(s, size)
    return s


def read_message(s, timeout=10):
    """One ZMTP message (its frames), skipping commands (heartbeats)."""
    s.settimeout(timeout)
    frames = []
    while True:
        flags = recv_exactly(s, 1)[0]
        n = int.from_bytes(recv_exactly(s, 8), "big") if flags & 0x02 else recv_exactly(s, 1)[0]
        body = recv_exactly(s, n)
        if flags & 0x04:
            continue
        frames.append(body)
        if not flags & 0x01:
            return frames


# ---- Protobuf by hand (proto/wire.proto's field numbers) --------------------

def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_int(num, n):
    return varint(num << 3) + varint(n)


def f_bytes(num, b):
    if isinstance(b, str):
        b = b.encode("utf-8", errors="surrogateescape")
    return varint(num << 3 | 2) + varint(len(b)) + b


def envelope(body_field, body, sender="node/evil", job_id=b"", incarnation=7, generation=0, version=1):
    e = f_int(1, version) + f_bytes(3, sender) + f_int(4, incarnation) + f_int(5, generation)
    if job_id:
        e += f_bytes(2, job_id)
    return e + f_bytes(body_field, body)


def register_node(node_id, nproc=1, advertise=b"127.0.0.1"):
    return f_bytes(1, node_id) + f_bytes(2, advertise) + f_int(3, nproc)


REGISTER, RANK_STATUS, STEP_REPORT, CHECKPOINT_WRITTEN, LEAVE, JOB_ERROR = 10, 15, 16, 23, 19, 22


# ---- the attacks ------------------------------------------------------------

def big_frame(port, mechanism, connections=8, claimed=256 * MB - 64, send_mb=64, null_first=False):
    """Each connection: a greeting, then (open: after the NULL handshake) a
    frame header claiming `claimed` bytes (268 MB: just under the 256 MiB
    the sockets took before their limits), then up to `send_mb` MB of it, all
    connections at once, held open. Returns the sockets (close them) and the
    MB the coordinator took before it dropped them."""
    held, sent = [], 0
    for _ in range(connections):
        try:
            s = null_session(port) if null_first else connect(port)
            if not null_first:
                s.sendall(greeting(mechanism))
            s.sendall(frame_header(claimed))
            held.append(s)
        except OSError:
            pass
    chunk = b"\x00" * MB
    for _ in range(send_mb):
        for s in list(held):
            try:
                s.settimeout(2)
                s.sendall(chunk)
                sent += 1
            except OSError:
                held.remove(s)
                s.close()
    return held, sent


def near_limit_frames(port, mechanism, connections, limit=2 * MB, null_first=False, sources=1):
    """The most a connection can make the coordinator hold: a frame just
    under the control plane's limit (net/wire.hpp), all of it but its last
    byte, on `connections` connections at once, held open (keyed: before the
    handshake, released after its 3 s limit), from `sources` addresses
    (127.0.0.1, 127.0.0.2, ...) in turn. Returns the sockets."""
    claimed = limit - 64
    held = []
    for i in range(connections):
        try:
            s = null_session(port) if null_first else connect(port, source="127.0.0.%d" % (1 + i % sources))
            if not null_first:
                s.sendall(greeting(mechanism))
            s.sendall(frame_header(claimed))
            held.append(s)
        except OSError:
            pass
    body = b"\x00" * (claimed - 1)
    for s in list(held):
        try:
            s.settimeout(5)
            s.sendall(body)
        except OSError:
            held.remove(s)
            s.close()
    return held


def half_open_and_garbage(port, connections=200, garbage=200, seed=47):
    """Half-open connections (half a greeting, then nothing) held open, and
    connections that send random bytes and close."""
    rng = random.Random(seed)
    held = []
    for _ in range(connections):
        try:
            s = connect(port)
            s.sendall(b"\xff\x00\x00\x00")
            held.append(s)
        except OSError:
            pass
    for _ in range(garbage):
        try:
            s = connect(port)
            s.sendall(rng.randbytes(rng.randint(1, 4096)))
            s.close()
        except OSError:
            pass
    return held


HOSTILE = [
    "evil\x1b[2J\x1b[H",                                            # clears the operator's terminal
    "x\ncoordinator: job finished at step 999999",                 # a forged line
    "nul\x00cut",                                                  # cuts a C string
    "\u202egnp.exe",                                               # reads backwards
    "A" * 10240,                                                   # a 10 KB id
    "bad-utf8-\udcff\udcfe",                                       # invalid UTF-8 (surrogateescape bytes)
]


def hostile_texts(port):
    """Everything a stranger can make an open coordinator print, with hostile
    text: ids, reasons, details, errors, paths, digests, senders, job ids."""
    s = null_session(port, identity=b"node/evil/7")
    sent = 0

    def send(e):
        nonlocal sent
        s.sendall(frame(e))
        sent += 1

    for h in HOSTILE:
        send(envelope(REGISTER, register_node(h)))                         # refused node '...'
        send(envelope(REGISTER, register_node("evil-" + str(sent), nproc=2 ** 31 - 1)))
        send(envelope(12, f_int(1, 1), sender="node/" + h, version=99))   # version_mismatch: peer '<sender>'
        send(envelope(12, f_int(1, 1), sender="node/" + h, job_id=h))     # foreign_job: job '<job_id>'
    send(envelope(REGISTER, register_node("evil", advertise="\x1b[31m127.0.0.1\n")))
    for h in HOSTILE:
        send(envelope(STEP_REPORT, f_int(1, 1) + f_int(2, 0) + f_bytes(24, h)))  # a metric label and the status page
        send(envelope(JOB_ERROR, f_bytes(1, h), sender="node/" + h))
        send(envelope(JOB_ERROR, f_bytes(1, h)))
        send(envelope(CHECKPOINT_WRITTEN, f_int(1, 5) + f_int(2, 0) + f_int(3, 1) + f_bytes(8, h), sender="node/" + h))
        # data files whose digests differ: the refusal names the path and digests
        digests = f_bytes(1, h) + f_bytes(2, "digest-" + h)
        send(envelope(RANK_STATUS, f_int(2, 0) + f_int(3, 6) + f_bytes(14, digests), sender="node/" + h))
        digests2 = f_bytes(1, h) + f_bytes(2, "other-" + h)
        send(envelope(RANK_STATUS, f_int(2, 0) + f_int(3, 6) + f_bytes(14, digests2), sender="node/" + h))
        send(envelope(RANK_STATUS, f_int(1, (1 << 64) - 1) + f_int(2, 0) + f_int(3, 3) + f_bytes(4, h), sender="node/" + h))
        send(envelope(REGISTER, register_node("evil")))
        send(envelope(LEAVE, f_bytes(1, h) + f_bytes(3, f_bytes(1, h) + f_bytes(2, h))))
    return s, sent


def utf8_flood(port, frames=20000):
    """Envelopes whose string field holds invalid UTF-8: libprotobuf logs an
    ERROR for each one it parses."""
    s = null_session(port)
    bad = envelope(REGISTER, register_node(b"\xff\xfe\xfd"))
    batch = frame(bad) * 1000
    for _ in range(frames // 1000):
        s.sendall(batch)
    return s, frames


def store_request(s, op, *args, rid=1):
    s.sendall(b"".join(frame(f, more=True) for f in [rid.to_bytes(8, "little"), op.encode(), *args[:-1]]) + frame(args[-1]))


def store_flood(store_port, values=32, value_mb=8, small=2000, small_kb=60):
    """An open store: `values` sets of `value_mb` MB (each over the frame
    limit now: its connection is dropped), then `small` sets of `small_kb` KB
    under distinct keys (refused once the store is full). Returns the
    replies' errors seen."""
    errors = []
    big = b"v" * (value_mb * MB)
    for i in range(values):
        try:
            s = null_session(store_port)
            store_request(s, "set", b"big-%d" % i, big)
            reply = read_message(s, timeout=5)
            if reply[1] == b"err":
                errors.append(reply[2].decode(errors="replace"))
            s.close()
        except (OSError, ConnectionError):
            pass
    s = null_session(store_port)
    value = b"w" * (small_kb * 1024)
    for i in range(small):
        store_request(s, "set", b"small-%d" % i, value, rid=i + 1)
        reply = read_message(s)
        if reply[1] == b"err":
            errors.append(reply[2].decode(errors="replace"))
    s.close()
    return errors
