#!/usr/bin/python3.11
"""PyTorch DDP, as torchrun users run it, on the ViT dtactor's built-in
model is (bench/torchscript_vit.py), Fashion-MNIST from Debian's
dataset-fashion-mnist, AdamW, clipping, global batch split over the ranks:
the comparison of bench/bench_hosts.py. Rank 0 prints one JSON line with
the median step time over the steps after the first fifth.

Usage (per host): python3.11 -m torch.distributed.run --nnodes 2 --node_rank I
  --nproc_per_node 1 --master_addr A --master_port P bench/ddp_vit.py
  [--steps 300] [--global-batch 128] [--threads 1] [--fp16-hook]"""
import argparse
import gzip
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchscript_vit import ViT  # noqa: E402


def load(d):
    with gzip.open(os.path.join(d, "train-images-idx3-ubyte.gz")) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(os.path.join(d, "train-labels-idx1-ubyte.gz")) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return torch.from_numpy(x.astype(np.float32) / 255.0), torch.from_numpy(y.astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fp16-hook", action="store_true")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load(a.data)
    torch.manual_seed(0)
    model = DistributedDataParallel(ViT())
    if a.fp16_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.05)
    per = a.global_batch // world
    gen = torch.Generator().manual_seed(1234)
    times, losses = [], []
    for _ in range(a.steps):
        idx = torch.randint(0, x.shape[0], (a.global_batch,), generator=gen)[rank * per:(rank + 1) * per]
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = times[a.steps // 5:]
    med = statistics.median(steady)
    if rank == 0:
        print(json.dumps({"world": world, "steps": a.steps, "global_batch": a.global_batch, "fp16_hook": a.fp16_hook,
                          "median_step_s": med, "samples_per_s": a.global_batch / med, "last_loss": losses[-1]}), flush=True)
    # Every rank reaches this point (the last step's allreduce is a barrier);
    # Gloo's teardown can hang a rank at exit, so end here.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
