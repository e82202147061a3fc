#!/usr/bin/python3.11
"""The state path at a real model size (issue 16): a GPT of ~200M parameters
(model.dim=1024, model.layers=16) trained by a coordinator and two nodes on
this machine, checkpointing every 2 steps; one node killed -9 and replaced
(state from its peer); then the run resumed by one node (another world size).
Prints one JSON object of figures, from the journal and /proc:

  checkpoint bytes, training stall per checkpoint (median, max) next to the
  median step time, background write throughput, the replacement's state
  transfer rate and its time from registering to its first step, the
  coordinator's peak RSS (sampled from /proc every 0.2 s), and the resume's
  time to first step.

Usage: bench/bench_state_path.py [--dim 1024] [--layers 16] [--steps 10]
       [--checkpoint-dir DIR] [--bin build/dtactor] [--set train.zero=2 ...]
With --set train.zero=2 the kill's figures (detection, first step at world
1, the recovery's optimizer source and reshard bytes) compare with
zero=0's from the same command without it.
Needs ~16 GB of memory and ~8 GB of disk at the default size.
"""
import argparse, json, os, signal, statistics, subprocess, sys, tempfile, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "dtactor"))
ap.add_argument("--dim", type=int, default=1024)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--checkpoint-dir", default="")
ap.add_argument("--keep", action="store_true", help="keep the run directory")
ap.add_argument("--s3", action="store_true", help="checkpoints to a Ceph radosgw started here (scripts/rgw, bluestore on a sparse file)")
ap.add_argument("--set", action="append", default=[], help="one more config setting for every run (e.g. train.zero=2)")
a = ap.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import bench_meta  # noqa: E402

work = tempfile.mkdtemp(prefix="dtactor-state-")
run = os.path.join(work, "run")
ckdir = a.checkpoint_dir or os.path.join(run, "checkpoints")
rgw_dir = None
extra_env_sets = []
if a.s3:
    import random
    rgw_dir = os.path.join(work, "ceph")
    rport = 17000 + random.randint(0, 400)
    env = dict(os.environ, RGW_PORT=str(rport), MON_PORT=str(rport + 1000), OBJECTSTORE="bluestore", STORE_BYTES=str(20 << 30))
    subprocess.run(["bash", os.path.join(here, "..", "scripts", "rgw", "start-rgw.sh"), rgw_dir], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "rgw.log"), "w"))
    endpoint = f"http://127.0.0.1:{rport}"
    os.environ["AWS_ACCESS_KEY_ID"] = "TESTACCESSKEY0000001"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "testsecretkey0000000000000000000000000001"
    e = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    subprocess.run(["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user",
                    os.environ["AWS_ACCESS_KEY_ID"] + ":" + os.environ["AWS_SECRET_ACCESS_KEY"], "-H", "x-amz-content-sha256: " + e,
                    "-X", "PUT", endpoint + "/bench"], check=True)
    ckdir = "s3://bench/run"
    extra_env_sets = [f"checkpoint.s3_endpoint={endpoint}"]
port = 29000 + os.getpid() % 500
sets = ["model.name=gpt", f"model.dim={a.dim}", f"model.layers={a.layers}", f"model.heads={a.heads}", "model.context=32",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=2", "train.log_every_steps=1",
        "checkpoint.every_steps=2", "checkpoint.keep_last=2", f"checkpoint.dir={ckdir}", "eval.every_steps=0", "eval.max_samples=8",
        "data.max_text_bytes=2000000", "cluster.digest_every_steps=2"] + extra_env_sets + a.set


def args_of(extra_sets):
    out = []
    for s in sets + extra_sets:
        out += ["--set", s]
    return out


procs = []


def spawn(argv, log):
    p = subprocess.Popen(argv, stdout=open(os.path.join(work, log), "w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(p)
    return p


def journal():
    try:
        with open(os.path.join(run, "journal.jsonl")) as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []


def of(j, name):
    return [e for e in j if e.get("event") == name]


def wait(pred, timeout=1800):
    end = time.time() + timeout
    while time.time() < end:
        j = journal()
        r = pred(j)
        if r:
            return r
        time.sleep(0.2)
    sys.exit("timed out waiting; logs in " + work)


peak = {"coordinator": 0}
stop_sampling = threading.Event()


def sample(pid):
    while not stop_sampling.is_set():
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak["coordinator"] = max(peak["coordinator"], int(line.split()[1]) * 1024)
        except OSError:
            return
        time.sleep(0.2)


def node(name, log):
    return spawn([a.bin, "--role", "node", "--coordinator", f"tcp://127.0.0.1:{port}", "--node-id", name, "--threads-per-rank", "1"], log)


try:
    coord = spawn([a.bin, "--role", "coordinator", "--listen", f"tcp://127.0.0.1:{port}", "--run-dir", run] +
                  args_of([f"train.max_steps={a.steps}", "cluster.min_nodes=2"]), "coordinator.log")
    threading.Thread(target=sample, args=(coord.pid,), daemon=True).start()
    na, nb = node("a", "node-a.log"), node("b", "node-b.log")
    wait(lambda j: any(e["step"] >= 4 for e in of(j, "checkpoint_saved")))
    killed_at = time.time()
    os.killpg(nb.pid, signal.SIGKILL)
    lost = wait(lambda j: of(j, "node_lost"))[0]
    # The survivor's first step at world 1 (before the replacement joins),
    # and the recovery line of that generation.
    after_kill = wait(lambda j: [e for e in of(j, "recovery_done") if e["t"] > killed_at and e.get("cause") == "node_lost"])[0]
    first_alone = [e for e in of(journal(), "step") if e["t"] > killed_at and e["world_size"] == 1]
    nc = node("c", "node-c.log")
    joined = wait(lambda j: [e for e in of(j, "node_joined") if e["node"] == "c"])[0]
    restored = wait(lambda j: [e for e in of(j, "checkpoint_restored") if e["source"] == "peer" and e["t"] > joined["t"]])[0]
    # The replacement's first step at world 2; none when the survivor alone
    # reached train.max_steps before the replacement was in (the job ends
    # at world 2 without another step).
    first = wait(lambda j: [e for e in of(j, "step") if e["t"] > restored["t"] and e["world_size"] == 2] or
                 ([None] if of(j, "job_finished") else []))[0]
    wait(lambda j: of(j, "job_finished"))
    coord.wait(600)
    j1 = journal()
    # Resume on one node, two more steps.
    t0 = time.time()
    coord2 = spawn([a.bin, "--role", "coordinator", "--listen", f"tcp://127.0.0.1:{port + 1}", "--run-dir", run] +
                   args_of([f"train.max_steps={a.steps + 2}", "cluster.min_nodes=1"]), "coordinator2.log")
    port += 1
    nd = node("d", "node-d.log")
    n_before = len(j1)
    resumed = wait(lambda j: [e for e in j[n_before:] if e.get("event") == "checkpoint_restored" and e["source"] == "disk"])[0]
    first2 = wait(lambda j: [e for e in of(j[n_before:], "step")])[0]
    coord2.wait(600)
    stop_sampling.set()

    saved = [e for e in of(j1, "checkpoint_saved")]
    steps = [e for e in of(j1, "step") if e.get("generation", 1) == 1]
    intervals = [b["t"] - a_["t"] for a_, b in zip(steps, steps[1:]) if b["step"] == a_["step"] + 1]
    started = of(j1, "job_started") or of(j1, "coordinator_started")
    out = {
        "bench": "state_path",
        "store": "s3 (Ceph radosgw, bluestore, loopback)" if a.s3 else "directory",
        "model": f"gpt dim {a.dim}, {a.layers} layers",
        "state_bytes": saved[0]["bytes"] if saved else None,
        "checkpoints": len(saved),
        "step_s_median": round(statistics.median(intervals), 3) if intervals else None,
        "stall_s_median": round(statistics.median(e["stall_s"] for e in saved), 3),
        "stall_s_max": round(max(e["stall_s"] for e in saved), 3),
        "stall_max_over_step": round(max(e["stall_s"] for e in saved) / statistics.median(intervals), 3) if intervals else None,
        "checkpoints_due": len([s for s in range(2, a.steps + 1, 2)]),
        "checkpoints_deferred": sum(1 for e in saved if e.get("due_step")),
        "write_s_median": round(statistics.median(e["write_s"] for e in saved), 3),
        "write_gb_per_s_median": round(statistics.median(e["bytes_per_s"] for e in saved) / 1e9, 3),
        "commit_s_median": round(statistics.median(e["duration_s"] for e in saved), 4),
        "peer_transfer_bytes": restored.get("bytes"),
        # Healing while training (the default at train.zero = 0): the state
        # arrives during the join's first step, which its time is part of.
        "peer_transfer_while_training": bool(restored.get("while_training", False)),
        "peer_transfer_s": round(restored["transfer_s"], 3) if "transfer_s" in restored else None,
        "peer_transfer_gb_per_s": round(restored["gb_per_s"], 3) if "gb_per_s" in restored else None,
        "replacement_registered_to_first_step_s": round(first["t"] - joined["t"], 2) if first else None,
        "settings": a.set,
        "kill_to_detected_s": round(lost["t"] - killed_at, 3),
        "kill_to_first_step_at_world_1_s": round(first_alone[0]["t"] - killed_at, 3) if first_alone else None,
        "kill_recovery_plan_to_first_step_s": round(after_kill.get("duration_s", 0), 3),
        "kill_recovery_lost_steps": after_kill.get("lost_steps", 0),
        "kill_recovery_optimizer_source": after_kill.get("optimizer_source"),
        "kill_recovery_reshard_bytes": after_kill.get("reshard_bytes"),
        "lost_steps": sum(e.get("lost_steps", 0) for e in of(j1, "recovery_done")),
        "ranks_killed_as_hung": sum(1 for e in of(j1, "rank_exited") if e.get("exit_code") == 137),
        "coordinator_peak_rss_mb": round(peak["coordinator"] / 2**20, 1),
        "resume_world_size_1_from_step": resumed["step"],
        "resume_start_to_first_step_s": round(first2["t"] - t0, 2),
        "run_dir": run if a.keep else None,
    }
    F = bench_meta.figure
    store = "S3" if a.s3 else "directory"
    print(json.dumps(bench_meta.stamped(out, "The state path at %s: coordinator + 2 nodes, a checkpoint every 2 steps to a %s store, "
                                        "node b killed -9 and replaced, then resumed at world 1%s"
                                        % (out["model"], store, " (%s)" % ", ".join(a.set) if a.set else ""),
                                        "Checkpoints and the state path", [
        F("training stalled for a checkpoint (median)", ["stall_s_median"], "s"),
        F("checkpoint write rate (median)", ["write_gb_per_s_median"], "GB/s"),
        F("kill -9 of node b: the first step at world 1", ["kill_to_first_step_at_world_1_s"], "s"),
        F("completed steps lost", ["lost_steps"], "steps"),
        F("state to the replacement from a live peer", ["peer_transfer_gb_per_s"], "GB/s"),
        F("the replacement: registration to its first step", ["replacement_registered_to_first_step_s"], "s"),
        F("resume at world 1 from the checkpoint: start to the first step", ["resume_start_to_first_step_s"], "s"),
        F("the coordinator's peak resident memory", ["coordinator_peak_rss_mb"], "MB")])))
finally:
    stop_sampling.set()
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    if rgw_dir:
        subprocess.run(["bash", os.path.join(here, "..", "scripts", "rgw", "stop-rgw.sh"), rgw_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not a.keep:
        subprocess.run(["rm", "-rf", work])
