#!/usr/bin/python3
"""What a job on a machine loaded past its cores journals around a loss, a
join and its end: the run bench/loaded_end_of_job.sh makes (coordinator +
3 nodes at train.zero = 2, 1 thread a rank, a ViT of dim 192 x 8 layers,
2 busy loops beside it, node c killed at step 100, node d started at 150,
300 steps, a checkpoint every 50). A healthy node must never be declared
lost: the figures are the losses (1 = the kill), the generations (3 =
start, loss, join), the final step's checkpoints (1) and the coordinator's
stalls that were credited to the nodes' silence.

usage: /usr/bin/python3 bench/loaded_end_of_job.py RUN_DIR COORDINATOR_LOG [--out FILE]
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("coordinator_log")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "loaded_end_of_job_results.json"))
    a = ap.parse_args()
    events = [json.loads(l) for l in open(os.path.join(a.run_dir, "journal.jsonl")) if l.strip()]
    kind = lambda k: [e for e in events if e.get("event") == k]  # noqa: E731
    fin = kind("job_finished")
    last = fin[-1]["step"] if fin else None
    stalls = [float(m.group(1)) for m in re.finditer(r"the coordinator stalled ([0-9.]+) s", open(a.coordinator_log).read())]
    result = {
        "nodes_lost": len(kind("node_lost")),
        "lost_nodes": [e["node"] for e in kind("node_lost")],
        "generations": len(kind("generation_started")),
        "final_step": last,
        "final_step_checkpoints": sum(1 for e in kind("checkpoint_saved") if e.get("step") == last),
        "world_size_at_end": fin[-1]["world_size"] if fin else None,
        "lost_steps": sum(e.get("lost_steps", 0) for e in kind("recovery_done")),
        "coordinator_stalls_credited": len(stalls),
        "longest_stall_s": round(max(stalls), 3) if stalls else 0.0,
    }
    F = bench_meta.figure
    figures = [
        F("nodes declared lost (the one killed: 1)", ["nodes_lost"], "count"),
        F("generations (start, the loss, the join: 3)", ["generations"], "count"),
        F("checkpoints of the final step", ["final_step_checkpoints"], "count"),
        F("longest stall of the coordinator, credited to the nodes' silence", ["longest_stall_s"], "s"),
    ]
    bench_meta.write(a.out, result, title="A loss, a join and the end of a job on a machine loaded past its cores",
                     group="Recovery from faults", figures=figures, cmd="bench/loaded_end_of_job.sh",
                     notes="Coordinator + 3 nodes, train.zero = 2, --threads-per-rank 1, ViT dim 192 x 8 layers, 2 busy loops beside; "
                           "c killed at step 100, d started at 150, 300 steps.")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
