#!/usr/bin/python3.11
"""kill -9 of one worker: torchrun's elastic restart against dtactor, in one run.

torchrun (PyTorch 1.13.1, `python3 -m torch.distributed.run --nnodes=1
--nproc_per_node=2 --max_restarts=3`, its default monitor interval) runs a
DDP job as torchrun users write it: the ViT of dtactor's default job
(bench/torchscript_vit.py), Fashion-MNIST, AdamW, global batch 128, Gloo, one
thread a worker; rank 0 saves a checkpoint (model, optimizer, step) every
--checkpoint-every steps and every worker resumes from it at start. After
--kill-at steps one worker is killed with SIGKILL. torchrun then stops the
other worker, starts both again (all workers restart), and they resume from
the last checkpoint. Measured: the time from the kill to the first step
completed after the restart, and the steps lost (the steps done before the
kill that the restart does again).

dtactor's side, in the same run: build/bench/bench_chaos --kinds kill9
(coordinator + 2 nodes x 1 rank, the default ViT job, a node killed -9; the
time from the kill to the first step at the new world size, and the steps
lost).

Usage (from the repository root; about 2 minutes):
  bench/torchrun_recovery.py [--trials 3] [--kill-at 70] [--checkpoint-every 20]
      [--steps 200] [--chaos build/bench/bench_chaos] [--no-dtactor]
      [--out bench/torchrun_recovery_results.json]
The worker itself: bench/torchrun_recovery.py --worker DIR (under torchrun)."""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from bench_net import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(a):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    sys.path.insert(0, HERE)
    from ddp_vit import load
    from torchscript_vit import ViT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(a.worker, "pid.%d.%d" % (restart, rank)), "w") as f:
        f.write(str(os.getpid()))
    x, y = load(a.data)
    torch.manual_seed(0)
    model = DistributedDataParallel(ViT())
    opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.05)
    ckpt = os.path.join(a.worker, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    per = a.global_batch // world
    log = open(os.path.join(a.worker, "steps.log"), "a") if rank == 0 else None
    for step in range(start, a.steps):
        gen = torch.Generator().manual_seed(1234 + step)
        idx = torch.randint(0, x.shape[0], (a.global_batch,), generator=gen)[rank * per:(rank + 1) * per]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log:
            log.write("%d %.6f %d %d\n" % (step + 1, time.time(), restart, start))
            log.flush()
            if (step + 1) % a.checkpoint_every == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def read_steps(path):
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) == 4:
                    rows.append((int(p[0]), float(p[1]), int(p[2]), int(p[3])))
    return rows


def torchrun_trial(a, t):
    d = tempfile.mkdtemp(prefix="torchrun-recovery-")
    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--max_restarts=3",
           "--master_port=%d" % free_port(),
           # torchrun 1.13 under Python 3.11 cannot parse its default "0" for
           # these (Std.NONE is not iterated by 3.11's enum): tee instead.
           "--redirects", "1", "--tee", "1", "--log_dir", os.path.join(d, "logs"),
           os.path.abspath(__file__), "--worker", d, "--steps", str(a.steps), "--checkpoint-every", str(a.checkpoint_every)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logf = open(os.path.join(d, "torchrun.log"), "w")
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    steps = os.path.join(d, "steps.log")
    try:
        deadline = time.time() + 300
        while not any(r[0] >= a.kill_at for r in read_steps(steps)):
            if p.poll() is not None or time.time() > deadline:
                raise SystemExit("torchrun trial %d: no step %d (log in %s)" % (t, a.kill_at, d))
            time.sleep(0.01)
        with open(os.path.join(d, "pid.0.1")) as f:
            victim = int(f.read())
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        while True:
            after = [r for r in read_steps(steps) if r[2] >= 1]
            if after:
                break
            if p.poll() is not None or time.time() > deadline:
                raise SystemExit("torchrun trial %d: no step after the restart (log in %s)" % (t, d))
            time.sleep(0.01)
        first = after[0]
        last_before = max(r[0] for r in read_steps(steps) if r[2] == 0)
        p.wait(timeout=300)
        return {"kill_to_first_step_after_restart_s": round(first[1] - t_kill, 3),
                "last_step_before_kill": last_before, "resumed_from_step": first[3],
                "steps_lost": last_before - first[3], "restarts": first[2], "exit": p.returncode, "log_dir": d}
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=70)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--chaos", default=os.path.join(ROOT, "build", "bench", "bench_chaos"))
    ap.add_argument("--no-dtactor", action="store_true", help="torchrun only")
    ap.add_argument("--out", default=os.path.join(HERE, "torchrun_recovery_results.json"))
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    trials = []
    for t in range(a.trials):
        r = torchrun_trial(a, t)
        print(json.dumps(r), flush=True)
        trials.append(r)
    rec = [r["kill_to_first_step_after_restart_s"] for r in trials]
    result = {"torchrun": {
        "setup": "torchrun --nnodes=1 --nproc_per_node=2 --max_restarts=3 (static rendezvous, monitor interval 5 s: the default), "
                 "DDP over Gloo, the default job's ViT, global batch %d, checkpoint every %d steps, a worker killed -9 after step %d"
                 % (a.global_batch, a.checkpoint_every, a.kill_at),
        "trials": trials,
        "kill_to_first_step_after_restart_s_median": statistics.median(rec),
        "steps_lost_max": max(r["steps_lost"] for r in trials)}}
    figures = []
    import bench_meta
    F = bench_meta.figure
    if not a.no_dtactor:
        out = subprocess.run([a.chaos, "--trials", str(a.trials), "--kinds", "kill9"], check=True, stdout=subprocess.PIPE,
                             text=True).stdout
        chaos = json.loads(out)
        result["dtactor"] = {"command": "%s --trials %d --kinds kill9" % (os.path.relpath(a.chaos, ROOT), a.trials),
                             "kill9": chaos["kill9"]}
        figures = [
            F("kill -9 of a worker: from the kill to the first step completed after it (median); dtactor goes on at the new "
              "world size, torchrun restarts every worker from the last checkpoint",
              ["dtactor", "kill9", "first_step_at_new_world_s", "median"], "s",
              "torchrun --max_restarts=3", ["torchrun", "kill_to_first_step_after_restart_s_median"]),
            F("kill -9 of a worker: completed steps lost (worst trial)", ["dtactor", "kill9", "lost_steps", "max"], "steps",
              "torchrun (checkpoint every %d steps)" % a.checkpoint_every, ["torchrun", "steps_lost_max"]),
        ]
    else:
        figures = [F("torchrun --max_restarts=3: kill -9 of a worker to the first step after the restart (median)",
                     ["torchrun", "kill_to_first_step_after_restart_s_median"], "s")]
    bench_meta.write(a.out, result, "kill -9 of one of two workers on one machine: dtactor against torchrun's elastic restart",
                     "Recovery from faults", figures,
                     notes="torchrun's time runs from the kill to the first step after the restart: the agent's monitor interval (the failure is noticed at its next tick, "
             "up to 5 s), both workers started again and the checkpoint loaded; its steps lost are those since its last checkpoint "
             "(every %d steps here). dtactor's: from the kill to the survivors' first step at the new world size." % a.checkpoint_every)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
