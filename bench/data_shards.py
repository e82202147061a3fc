#!/usr/bin/python3.11
"""Sharded data (issue 29, docs/data.md): the same TorchScript GPT trained
with `dtactor train` (default settings: every core, data.shuffle_block_shards
4, data.read_ahead_blocks 1) on the same tokens read three ways:
  - file: one local .bin, memory-mapped (what dtactor did before shards);
  - dir:  a directory of --shards shard files, by glob (mapped in place);
  - s3:   the same shards in S3 (Ceph's radosgw on loopback, as the tests
          start it: scripts/rgw/start-rgw.sh), fetched into an empty cache
          directory at the start of every run.
Modes are interleaved in every repeat (same machine load). Per run, from the
journal: samples/s (median of the `step` lines after the first fifth of
--steps), data wait per step (median of the same lines: time the step spent
assembling its batch, fetching included), and the cache's peak bytes (the
final `resources` row). Prints a JSON line per run, then the medians and the
ratios dir/file and s3/file (paired: the median of the per-repeat ratios);
writes bench/data_shards_results.json.

With --pair, each mode runs side by side with `file` instead (one compute
thread each, so each has a core): both see the same machine load, and the
ratio of their samples/s is steadier than that of runs one after the other
(this shared machine's load drifts by ±15% over tens of seconds).

With --model vit, the built-in ViT (its defaults) on Fashion-MNIST instead:
  - file: Debian's IDX files, decoded into memory at the start (what the
          built-in ViT reads without data.train_shards);
  - dir:  the same 60,000 images as 30 PNG tar shards of 2,000 samples
          (examples/shards/make_tar_shards.py; data.train_shards by glob);
  - s3:   those shards in S3.

Usage: bench/data_shards.py [--model gpt|vit] [--repeats 3] [--steps 300] [--shards 32]
  [--tokens 8388608] [--modes file,dir,s3] [--pair] [--dtactor build/dtactor] [--out FILE]
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402
ROOT = os.path.dirname(HERE)
ACCESS = "TESTACCESSKEY0000001"
SECRET = "testsecretkey0000000000000000000000000001"

MODEL = r'''
import sys, torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, context, d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.tok(idx) + self.pos[:, :t]
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))

torch.manual_seed(0)
torch.jit.script(GPT(256, 64, 128, 2, 4)).save(sys.argv[1])
'''


def curl_put(endpoint, path, data_file=None):
    body = open(data_file, "rb").read() if data_file else b""
    cmd = ["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", ACCESS + ":" + SECRET, "-X", "PUT",
           "-H", "x-amz-content-sha256: " + hashlib.sha256(body).hexdigest()]
    if data_file:
        cmd += ["--upload-file", data_file]
    subprocess.run(cmd + [endpoint + path], check=True)


def journal(rd):
    out = []
    try:
        for line in open(os.path.join(rd, "journal.jsonl")):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except FileNotFoundError:
        pass
    return out


def start_run(args, mode, work, spec, endpoint, threads=None):
    rd = os.path.join(work, "run-%s-%d" % (mode, time.time_ns()))
    cache = os.path.join(work, "cache-%s-%d" % (mode, time.time_ns()))
    if args.model == "vit":
        sets = ["model.name=vit", "train.max_steps=%d" % args.steps, "train.log_every_steps=10", "eval.every_steps=0",
                "eval.max_samples=64", "checkpoint.every_steps=0", "data.cache_dir=" + cache, "data.s3_endpoint=" + (endpoint or "")]
        if mode != "file":
            sets.append("data.train_shards=" + spec)
    else:
        sets = ["model.name=torchscript", "model.file=" + os.path.join(work, "gpt.pt"), "data.train_tokens=" + spec,
                "data.eval_tokens=" + os.path.join(work, "eval.bin"), "model.context=64", "model.vocab_size=256",
                "train.global_batch_size=32", "train.max_steps=%d" % args.steps, "train.warmup_steps=10", "train.lr=0.001",
                "train.log_every_steps=10", "eval.every_steps=0", "eval.max_samples=64", "checkpoint.every_steps=0",
                "data.cache_dir=" + cache, "data.s3_endpoint=" + (endpoint or "")]
    if threads:
        sets.append("train.threads=%d" % threads)
    cmd = [args.dtactor, "train", "--run-dir", rd]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return {"mode": mode, "rd": rd, "cache": cache, "p": p, "t0": time.time()}


def finish_run(args, r):
    _, err = r["p"].communicate()
    wall = time.time() - r["t0"]
    if r["p"].returncode != 0:
        raise SystemExit("%s run failed (exit %d): %s" % (r["mode"], r["p"].returncode, err.strip().splitlines()[-1:]))
    j = journal(r["rd"])
    steps = [e for e in j if e.get("event") == "step" and e.get("step", 0) > args.steps // 5]
    res = [e for e in j if e.get("event") == "resources"]
    row = res[-1]["ranks"][0] if res and res[-1].get("ranks") else {}
    out = {"mode": r["mode"], "samples_per_s": statistics.median(e["samples_per_s"] for e in steps),
           "data_wait_s_per_step": statistics.median(e.get("data_wait_s", 0) for e in steps),
           "wall_s": wall,
           "cache_peak_bytes": row.get("data_cache_peak_bytes", 0), "bytes_s3": row.get("data_bytes_s3", 0),
           "bytes_local": row.get("data_bytes_local", 0), "cache_misses": row.get("data_cache_misses", 0),
           "shards_verified": row.get("data_shards_verified", 0)}
    shutil.rmtree(r["rd"], ignore_errors=True)
    shutil.rmtree(r["cache"], ignore_errors=True)
    return out


def run_once(args, mode, work, spec, endpoint):
    return finish_run(args, start_run(args, mode, work, spec, endpoint))


def shards_to_s3(dtactor, work, names, prefix, pattern):
    """Starts radosgw under work/ceph, puts work/shards/<names> under
    /bench<prefix>, and indexes them (digests, tar shards' sample counts).
    Returns (rgw_dir, endpoint); stop it with scripts/rgw/stop-rgw.sh."""
    rgw_dir = os.path.join(work, "ceph")
    port = free_port()
    env = dict(os.environ, RGW_PORT=str(port), MON_PORT=str(free_port()), S3_ACCESS_KEY=ACCESS, S3_SECRET_KEY=SECRET)
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "rgw", "start-rgw.sh"), rgw_dir], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    endpoint = "http://127.0.0.1:%d" % port
    curl_put(endpoint, "/bench")
    for n in names:
        curl_put(endpoint, prefix + n, os.path.join(work, "shards", n))
    subprocess.run([dtactor, "data", "index", pattern, "--s3-endpoint", endpoint], check=True,
                   env=dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET), stdout=subprocess.DEVNULL)
    return rgw_dir, endpoint


def setup_of(args):
    if args.model == "vit":
        return {"model": "built-in ViT, its defaults (dim 64, 4 layers, global batch 128), Fashion-MNIST",
                "shards": "30 PNG tar shards of 2,000 samples (examples/shards/make_tar_shards.py), 4.6 MB each"}
    return {"tokens": args.tokens, "shards": args.shards, "global_batch_size": 32,
            "model": "TorchScript GPT, 2 layers, d 128, context 64, vocab 256"}


def make_gpt_shards(args, work):
    import numpy as np
    with open(os.path.join(work, "model.py"), "w") as f:
        f.write(MODEL)  # a file: torch.jit.script reads the classes' source
    subprocess.run(["/usr/bin/python3.11", os.path.join(work, "model.py"), os.path.join(work, "gpt.pt")], check=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=args.tokens, dtype=np.uint16)
    tokens.tofile(os.path.join(work, "one.bin"))
    rng.integers(0, 256, size=1 << 16, dtype=np.uint16).tofile(os.path.join(work, "eval.bin"))
    os.makedirs(os.path.join(work, "shards"))
    names = []
    for k, part in enumerate(np.array_split(tokens, args.shards)):
        name = "train-%04d.bin" % k
        part.tofile(os.path.join(work, "shards", name))
        names.append(name)
    return names, {"file": os.path.join(work, "one.bin"), "dir": os.path.join(work, "shards", "train-*.bin")}


def make_vit_shards(work):
    shard_dir = os.path.join(work, "shards")
    subprocess.run(["/usr/bin/python3.11", os.path.join(ROOT, "examples", "shards", "make_tar_shards.py"), "--out", shard_dir,
                    "--per-shard", "2000"], check=True, stderr=subprocess.DEVNULL)
    names = sorted(n for n in os.listdir(shard_dir) if n.endswith(".tar"))
    return names, {"file": "", "dir": os.path.join(shard_dir, "train-*.tar")}


def write(args, result, modes, ratio, how):
    """args.out with bench_meta's header; figures: each mode against the one file."""
    F = bench_meta.figure
    names = {"dir": "a directory of shards", "s3": "S3 (Ceph radosgw)"}
    figures = []
    for m in modes:
        if m == "file" or "file" not in modes:
            continue
        figures += [F("samples/s from %s" % names.get(m, m), ["summary", m, "samples_per_s"], "samples/s", "one file (IDX / .bin)",
                      ["summary", "file", "samples_per_s"]),
                    F("%s over one file (%s)" % (names.get(m, m), "median of the side-by-side ratios" if "side" in ratio else "median of the pairs"),
                      ["summary", "%s_over_file_samples_per_s_%s" % (m, ratio)], "x")]
        if m == "s3":
            figures.append(F("a step's wait for data from S3", ["summary", "s3", "data_wait_s_per_step"], "s", "one file",
                             ["summary", "file", "data_wait_s_per_step"]))
    model = "built-in ViT from 30 PNG tar shards" if args.model == "vit" else "TorchScript GPT from %d token shards" % args.shards
    bench_meta.write(args.out, result, "%s, %s, %d repeats" % (model, how, args.repeats), "Data", figures)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["gpt", "vit"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8 << 20)
    ap.add_argument("--modes", default="file,dir,s3")
    ap.add_argument("--pair", action="store_true",
                    help="run each mode side by side with `file` (one compute thread each, one core each): both see the same load")
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out")
    args = ap.parse_args()
    if not args.out:
        args.out = os.path.join(HERE, "data_shards_results.json" if args.model == "gpt" else "data_shards_vit_results.json")
    modes = args.modes.split(",")
    work = tempfile.mkdtemp(prefix="dtactor-bench-data-")
    rgw_dir = None
    endpoint = None
    try:
        if args.model == "vit":
            names, specs = make_vit_shards(work)
            prefix, pattern = "/bench/imgs/", "s3://bench/imgs/train-*.tar"
        else:
            names, specs = make_gpt_shards(args, work)
            prefix, pattern = "/bench/corpus/", "s3://bench/corpus/train-*.bin"
        if "s3" in modes:
            rgw_dir, endpoint = shards_to_s3(args.dtactor, work, names, prefix, pattern)
            specs["s3"] = pattern
        subprocess.run([args.dtactor, "data", "index", specs["dir"]], check=True, stdout=subprocess.DEVNULL)
        runs = []
        if args.pair:
            ratios = {}
            for r in range(args.repeats):
                for m in modes:
                    if m == "file":
                        continue
                    a = start_run(args, "file", work, specs["file"], endpoint, threads=1)
                    b = start_run(args, m, work, specs[m], endpoint, threads=1)
                    xa, xb = finish_run(args, a), finish_run(args, b)
                    for x in (xa, xb):
                        x["repeat"] = r
                        x["paired_with"] = m
                        print(json.dumps(x), flush=True)
                        runs.append(x)
                    ratios.setdefault(m, []).append(xb["samples_per_s"] / xa["samples_per_s"])
            summary = {}
            for m in modes:
                mine = [x for x in runs if x["mode"] == m]
                summary[m] = {k: statistics.median(x[k] for x in mine)
                              for k in ("samples_per_s", "data_wait_s_per_step", "cache_peak_bytes", "bytes_s3", "cache_misses")}
            for m, v in ratios.items():
                summary[m + "_over_file_samples_per_s_side_by_side_median"] = statistics.median(v)
                summary[m + "_over_file_ratios"] = v
            result = {"setup": {**setup_of(args), "steps": args.steps,
                                "threads": "1 compute thread per run, two runs side by side",
                                "defaults": "data.shuffle_block_shards 4, data.read_ahead_blocks 1, data.cache_bytes 4 GiB"},
                      "summary": summary, "runs": runs}
            print(json.dumps(summary))
            write(args, result, modes, "side_by_side_median", "side by side with the one-file data set")
            return
        for r in range(args.repeats):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            this = {}
            for m in order:
                x = run_once(args, m, work, specs[m], endpoint)
                x["repeat"] = r
                print(json.dumps(x), flush=True)
                runs.append(x)
                this[m] = x
        summary = {}
        for m in modes:
            mine = [x for x in runs if x["mode"] == m]
            summary[m] = {k: statistics.median(x[k] for x in mine)
                          for k in ("samples_per_s", "data_wait_s_per_step", "cache_peak_bytes", "bytes_s3", "cache_misses")}
        for m in modes:
            if m != "file" and "file" in modes:
                ratios = []
                for r in range(args.repeats):
                    a = [x for x in runs if x["repeat"] == r and x["mode"] == m][0]
                    b = [x for x in runs if x["repeat"] == r and x["mode"] == "file"][0]
                    ratios.append(a["samples_per_s"] / b["samples_per_s"])
                summary[m + "_over_file_samples_per_s_paired_median"] = statistics.median(ratios)
        result = {"setup": {**setup_of(args), "steps": args.steps,
                            "global_batch_size": 32, "defaults": "data.shuffle_block_shards 4, data.read_ahead_blocks 1, data.cache_bytes 4 GiB"},
                  "summary": summary, "runs": runs}
        print(json.dumps(summary))
        write(args, result, modes, "paired_median", "one run after the other")
    finally:
        if rgw_dir:
            subprocess.run(["bash", os.path.join(ROOT, "scripts", "rgw", "stop-rgw.sh"), rgw_dir], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
