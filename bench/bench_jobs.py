"""Helpers for the bench scripts that run dtactor jobs as processes: the
journal as it is being written, waiting for a condition, process logs, and
a trial of two leased coordinators (the standby benches)."""
import json
import os
import signal
import subprocess
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


def wait(cond, limit_s, what, poll_s=0.01):
    """cond()'s first true value, polled every poll_s; RuntimeError after limit_s."""
    end = time.time() + limit_s
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(poll_s)
    raise RuntimeError("timed out after %d s waiting for %s" % (limit_s, what))


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

    def __init__(self, work, ttl_ms, dtactor, sets):
        self.work, self.run, self.lease = work, os.path.join(work, "run"), os.path.join(work, "lease")
        self.ttl_ms, self.dtactor, self.sets = ttl_ms, dtactor, sets
        self.procs = {}

    def start(self, name, args):
        log = open(os.path.join(self.work, name + ".log"), "w")
        self.procs[name] = subprocess.Popen([self.dtactor] + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def coordinator(self, name, port):
        self.start(name, ["--role", "coordinator", "--listen", "tcp://127.0.0.1:%d" % port, "--advertise-addr", "127.0.0.1",
                          "--run-dir", self.run, "--lease", self.lease, "--standby", "--lease-ttl-ms", str(self.ttl_ms)]
                   + [x for s in self.sets for x in ("--set", s)])

    def log(self, name):
        return text_of(os.path.join(self.work, name + ".log"))

    def kill_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)  # a stopped one too
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
