"""Helpers for the bench scripts that run dtactor jobs as processes: the
journal as it is being written, waiting for a condition, process logs, and
a trial of two leased coordinators (the standby benches)."""
import json
import os
import signal
import subprocess
import statistics
import time


def journal(run):
    """The events of RUN/journal.jsonl so far (a line being written is skipped)."""
    path = os.path.join(run, "journal.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def named(ev, name):
    return [e for e in ev if e.get("event") == name]


def poll(cond, limit_s, poll_s=0.01):
    """cond()'s first true value, polled every poll_s; None after limit_s."""
    end = time.time() + limit_s
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(poll_s)
    return None


def wait(cond, limit_s, what, poll_s=0.01):
    """cond()'s first true value, polled every poll_s; RuntimeError after limit_s."""
    v = poll(cond, limit_s, poll_s)
    if not v:
        raise RuntimeError("timed out after %d s waiting for %s" % (limit_s, what))
    return v


def kill_groups(procs):
    """SIGKILL to each still running process's group (a stopped one is
    continued first), and reaped."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def summary(trials, key):
    """Median, min and max of trials' `key` where it was measured; None when never."""
    vals = [x[key] for x in trials if x.get(key) is not None]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None


def text_of(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class lease_trial:
    """One trial's processes in WORK: coordinators sharing the lease
    WORK/lease and the run directory WORK/run, and nodes; each in a session
    of its own, its output in WORK/NAME.log."""

    def __init__(self, work, ttl_ms, dtactor, sets, lease=None):
        """lease: where the lease lives (--lease); WORK/lease where None."""
        self.work, self.run, self.lease = work, os.path.join(work, "run"), lease or os.path.join(work, "lease")
        self.ttl_ms, self.dtactor, self.sets = ttl_ms, dtactor, sets
        self.procs = {}

    def start(self, name, args, prefix=(), program=None):
        """Starts program (dtactor where None) with args, after prefix (a
        command that runs it elsewhere, e.g. scripts/netns/hosts.sh run TAG H)."""
        log = open(os.path.join(self.work, name + ".log"), "w")
        self.procs[name] = subprocess.Popen(list(prefix) + [program or self.dtactor] + args, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def coordinator(self, name, port, address="127.0.0.1", prefix=()):
        self.start(name, ["--role", "coordinator", "--listen", "tcp://%s:%d" % (address, port), "--advertise-addr", address,
                          "--run-dir", self.run, "--lease", self.lease, "--standby", "--lease-ttl-ms", str(self.ttl_ms)]
                   + [x for s in self.sets for x in ("--set", s)], prefix)

    def log(self, name):
        return text_of(os.path.join(self.work, name + ".log"))

    def kill_all(self):
        kill_groups(self.procs.values())


class netns_hosts:
    """Hosts on this machine, made by scripts/netns/hosts.sh (root): network
    namespaces TAG-h0 .. TAG-h(n-1), host h at 198.18.0.(h+1) on one test
    switch. Use as a context manager: the hosts and everything that runs in
    them are removed on leaving, also on errors."""

    def __init__(self, script, tag, n):
        self.script, self.tag, self.n = script, tag, n

    def _do(self, *args, check=True):
        return subprocess.run([self.script, *args], check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self):
        self._do("down", self.tag, check=False)
        self._do("up", self.tag, str(self.n))
        return self

    def __exit__(self, *exc):
        self._do("down", self.tag, check=False)

    @staticmethod
    def address(h):
        return "198.18.0.%d" % (h + 1)

    def run(self, h):
        """The command prefix that runs a program on host h."""
        return [self.script, "run", self.tag, str(h)]

    def cut(self, h):
        """Host h's link passes nothing, either way (no FIN, no reset reaches anyone)."""
        self._do("cut", self.tag, str(h))

    def heal(self, h):
        self._do("heal", self.tag, str(h))

    def pids(self, h):
        out = subprocess.run(["ip", "netns", "pids", "%s-h%d" % (self.tag, h)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def kill(self, h):
        """kill -9 of every process on host h; returns how many there were."""
        pids = self.pids(h)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)
