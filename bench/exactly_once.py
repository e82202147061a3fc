#!/usr/bin/python3.11
"""Exactly once per epoch through faults, from the processes' own records
(issue 29; docs/data.md, "Auditing the order: data.sample_log").

A TorchScript bigram job on --shards local token shards (random ids, a
window of model.context + 1 tokens per sample), data.sample_log on, ranks
--nproc per node, one epoch of steps (train.max_steps = N / B):

  1. nodes a and b; once a step past --kill-at of the epoch is journaled,
     b is killed -9 with its rank processes (the job goes on without it);
  2. node c joins;
  3. once a checkpoint past --stop-at of the epoch is committed and a few
     steps more are journaled, every process is killed -9 (coordinator,
     nodes, ranks): the steps after that checkpoint are lost;
  4. the job is started again in the same run directory on three nodes
     (a, c, d: another world size) and resumes from the checkpoint to the
     end of the epoch.

Then bench/check_sample_log.py reads the records: every step's batch from
the newest generation that trained it, every index of [0, N) once. Prints
one JSON object (and writes it to --out): samples in the epoch, steps, the
steps redone after the resume, indices seen 0 times / once / more than
once, the world sizes, lines inferred (a rank killed after its step's
allreduce completed elsewhere), wall times.

Usage: bench/exactly_once.py [--shards 32] [--tokens-per-shard 4112]
  [--batch 32] [--nproc 2] [--kill-at 0.15] [--stop-at 0.55]
  [--dtactor build/dtactor] [--out bench/exactly_once_results.json] [--keep]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
ROOT = os.path.dirname(HERE)
CONTEXT = 16


def descendants(pid):
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for k in kids:
            out.append(k)
            out += descendants(k)
    return out


def kill_tree(proc):
    """kill -9 of a process and every process below it (its ranks)."""
    kids = descendants(proc.pid)
    for pid in [proc.pid] + kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def journal(run_dir):
    out = []
    try:
        with open(os.path.join(run_dir, "journal.jsonl")) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def wait_for(run_dir, pred, coord, timeout, since=0):
    """Polls the journal (from line `since`) until pred(events) holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = journal(run_dir)[since:]
        got = pred(ev)
        if got:
            return got
        if coord.poll() is not None:
            return pred(journal(run_dir)[since:])
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout} s; see {run_dir}")


def events(ev, name):
    return [e for e in ev if e.get("event") == name]


def last_step(ev):
    s = events(ev, "step")
    return s[-1]["step"] if s else -1


class Job:
    def __init__(self, a, run_dir, sets, min_nodes):
        self.a, self.run_dir = a, run_dir
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.nodes = {}
        args = [a.dtactor, "--role", "coordinator", "--listen", self.endpoint, "--run-dir", run_dir]
        for s in sets + [f"cluster.min_nodes={min_nodes}"]:
            args += ["--set", s]
        self.log = open(os.path.join(run_dir, f"coordinator-{self.port}.log"), "w")
        self.coord = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def node(self, nid):
        log = open(os.path.join(self.run_dir, f"node-{nid}-{self.port}.log"), "w")
        self.nodes[nid] = subprocess.Popen(
            [self.a.dtactor, "--role", "node", "--coordinator", self.endpoint, "--node-id", nid, "--nproc-per-node", str(self.a.nproc),
             "--threads-per-rank", "1", "--advertise-addr", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT)

    def kill_all(self):
        for p in [self.coord] + list(self.nodes.values()):
            if p.poll() is None:
                kill_tree(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--tokens-per-shard", type=int, default=4112)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.15, help="share of the epoch after which b is killed")
    ap.add_argument("--stop-at", type=float, default=0.55, help="share of the epoch after which everything is killed (after a checkpoint)")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "exactly_once_results.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    a.dtactor = os.path.abspath(a.dtactor)

    import numpy as np  # Debian's python3-numpy (as the fixtures)

    work = tempfile.mkdtemp(prefix="dtactor-exactly-once-")
    t_start = time.monotonic()
    jobs = []
    try:
        fx = os.path.join(work, "fx")
        subprocess.run(["/usr/bin/python3.11", os.path.join(ROOT, "tests", "data", "make_torchscript_fixtures.py"), fx],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        data = os.path.join(work, "data")
        os.makedirs(data)
        rng = np.random.default_rng(29)
        for k in range(a.shards):
            rng.integers(0, 64, a.tokens_per_shard, dtype=np.uint16).tofile(os.path.join(data, f"train-{k:03d}.bin"))
        rng.integers(0, 64, 4096, dtype=np.uint16).tofile(os.path.join(work, "eval.bin"))
        n = a.shards * (a.tokens_per_shard - CONTEXT)
        steps = n // a.batch
        if steps * a.batch != n:
            raise SystemExit(f"N = {n} is not a multiple of --batch {a.batch}: choose --tokens-per-shard so that it is")
        samples = os.path.join(work, "samples")
        run_dir = os.path.join(work, "run")
        os.makedirs(run_dir)
        sets = [
            "model.name=torchscript", f"model.file={fx}/bigram.pt", f"data.train_tokens={data}/train-*.bin",
            f"data.eval_tokens={work}/eval.bin", f"model.context={CONTEXT}", "model.vocab_size=64",
            "data.shuffle_block_shards=4", f"data.sample_log={samples}", f"train.global_batch_size={a.batch}",
            f"train.max_steps={steps}", "train.lr=0.05", "train.warmup_steps=10", "train.log_every_steps=10", "eval.every_steps=0",
            "eval.max_samples=256", f"checkpoint.every_steps={a.checkpoint_every}", "cluster.digest_every_steps=100",
            "cluster.floor_nodes=1",
        ]
        kill_step, stop_step = int(steps * a.kill_at), int(steps * a.stop_at)

        # Run 1: a loss, a join, then everything killed after a checkpoint.
        t0 = time.monotonic()
        job = Job(a, run_dir, sets, 2)
        jobs.append(job)
        job.node("a")
        job.node("b")
        wait_for(run_dir, lambda ev: last_step(ev) >= kill_step, job.coord, 300)
        b_killed_after = last_step(journal(run_dir))
        kill_tree(job.nodes["b"])
        wait_for(run_dir, lambda ev: any(e["node"] == "b" for e in events(ev, "node_lost")), job.coord, 120)
        job.node("c")
        join = wait_for(run_dir, lambda ev: [g for g in events(ev, "generation_started") if "c" in g["nodes"]], job.coord, 300)[0]
        ckpt = wait_for(run_dir, lambda ev: [c for c in events(ev, "checkpoint_saved") if c["step"] >= max(stop_step, join["start_step"] + 1)],
                        job.coord, 600)[0]
        wait_for(run_dir, lambda ev: last_step(ev) >= ckpt["step"] + a.checkpoint_every // 2, job.coord, 300)
        job.kill_all()
        first = journal(run_dir)
        stopped_after = last_step(first)
        first_gens = {g["generation"]: g["world_size"] for g in events(first, "generation_started")}
        run1_s = time.monotonic() - t0

        # Run 2: three nodes, resumed from the checkpoint directory.
        t1 = time.monotonic()
        job2 = Job(a, run_dir, sets, 3)
        jobs.append(job2)
        for nid in ("a", "c", "d"):
            job2.node(nid)
        code = job2.coord.wait(timeout=1800)
        time.sleep(0.5)
        job2.kill_all()
        second = journal(run_dir)[len(first):]
        run2_s = time.monotonic() - t1
        if code != 0:
            raise SystemExit(f"the resumed job exited {code}; see {run_dir}")
        restored = [r["step"] for r in events(second, "checkpoint_restored") if r.get("source") == "disk"]
        fin = events(second, "job_finished")

        t2 = time.monotonic()
        chk = subprocess.run(["/usr/bin/python3.11", os.path.join(HERE, "check_sample_log.py"), samples, "--samples", str(n), "--batch",
                              str(a.batch), "--steps", str(steps)], capture_output=True, text=True)
        check_s = time.monotonic() - t2
        if chk.returncode not in (0, 1):
            raise SystemExit(f"check_sample_log.py failed: {chk.stderr}")
        s = json.loads(chk.stdout)
        result = {
            "bench": "exactly_once",
            "ok": s["ok"],
            "samples_in_epoch": n,
            "global_batch": a.batch,
            "steps": steps,
            "shards": a.shards,
            "ranks_per_node": a.nproc,
            "b_killed_after_step": b_killed_after,
            "c_joined_at_step": join["start_step"],
            "everything_killed_after_step": stopped_after,
            "resumed_from_checkpoint_step": restored[-1] if restored else None,
            "steps_redone_after_the_resume": s["steps_redone"],
            "world_sizes_first_run": sorted(set(first_gens.values())),
            "world_size_resumed": fin[0]["world_size"] if fin else None,
            "generations": s["generations"],
            "indices_seen_0": s["epoch0_indices_seen_0"],
            "indices_seen_once": s["epoch0_indices_seen_once"],
            "indices_seen_more_than_once": s["epoch0_indices_seen_more"],
            # Indices never seen are only those at the positions of lines
            # lost with a killed rank (its step completed on the others).
            "positions_inferred": s["epoch0_positions_inferred"],
            "rank_lines_inferred": s["rank_lines_inferred"],
            "rank_lines_inferred_at": s["rank_lines_inferred_at"],
            "torn_lines": s["torn_lines"],
            "lines": s["lines"],
            "files": s["files"],
            "checker_errors": s["errors"],
            "wall_s": {"first_run": round(run1_s, 1), "resumed_run": round(run2_s, 1), "check": round(check_s, 1),
                       "total": round(time.monotonic() - t_start, 1)},
        }
        F = bench_meta.figure
        out = bench_meta.write(a.out, result, "Exactly once per epoch through a kill -9, a join and a whole-job kill and resume "
                               "(%s samples, %s steps)" % ("{:,}".format(result["samples_in_epoch"]), "{:,}".format(result["steps"])), "Data", [
            F("sample indices seen more than once in the epoch", ["indices_seen_more_than_once"], "count"),
            F("sample indices seen exactly once", ["indices_seen_once"], "count", "samples in the epoch", ["samples_in_epoch"]),
            F("steps trained again after the resume from the checkpoint", ["steps_redone_after_the_resume"], "steps"),
            F("the checker's verdict", ["ok"], "count")])
        print(json.dumps(out, indent=1))
        return 0 if s["ok"] else 1
    finally:
        for j in jobs:
            j.kill_all()
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
