#!/usr/bin/python3.11
"""Writes what the TorchScript tests train: scripted PyTorch modules (as a
PyTorch user writes them) and .npy arrays. Usage: make_torchscript_fixtures.py OUTDIR"""
import json
import os
import sys

from typing import List

import numpy as np
import torch
from torch import nn

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(7)
w = rng.normal(size=(20, 10)).astype(np.float32)


def data(n):
    x = rng.normal(size=(n, 20)).astype(np.float32)
    return x, (x @ w).argmax(1).astype(np.int64)


x, y = data(1024)
np.save(os.path.join(out, "x_train.npy"), x)
np.save(os.path.join(out, "y_train.npy"), y)
xe, ye = data(256)
np.save(os.path.join(out, "x_eval.npy"), xe)
np.save(os.path.join(out, "y_eval.npy"), ye)
np.save(os.path.join(out, "y_short.npy"), y[:100])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
        self.norm = nn.LayerNorm(20)

    def forward(self, x):
        return self.body(self.norm(x))


class WithLoss(MLP):
    @torch.jit.export
    def loss(self, x, y):
        return nn.functional.cross_entropy(self.forward(x), y, reduction="none")


class BadShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(20, 20)

    def forward(self, x):
        return self.lin(x).view(-1, 10, 2)


class ScalarLoss(MLP):
    @torch.jit.export
    def loss(self, x, y):
        return nn.functional.cross_entropy(self.forward(x), y)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


class Bigram(nn.Module):
    # next-token scores from the current token alone: [batch, positions, vocab]
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 64)

    def forward(self, x):
        return self.table(x)


class BigramWithBias(Bigram):
    # two parameter tensors: streaming DiLoCo can cut it into two fragments
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        return self.table(x) + self.bias


# A module that is not a Sequential but names its `dtactor_units`: at
# train.zero = 3 each is gathered on its own around its calls (blocks.0 and
# blocks.1 are entries of a ModuleList, named by their dotted paths).
class Declared(nn.Module):
    dtactor_units: List[str]

    def __init__(self, residual: bool = False, units=("norm", "blocks.0", "blocks.1", "head"), unused: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(20)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 20)) for _ in range(2)])
        self.head = nn.Linear(20, 10)
        if unused:
            self.unused = nn.Linear(20, 20)
        self.residual = residual
        self.dtactor_units = list(units)

    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = x + b(x) if self.residual else b(x)
        return self.head(x)


# Two inputs to a unit-free sum (a token and a position embedding, as a GPT
# starts), residual blocks inside a container module, the units declared
# at depth, and a loss method that calls forward: each unit is still
# gathered around its own calls.
class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(20), nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 20)) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


class DeclaredDeep(nn.Module):
    dtactor_units: List[str]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(20, 20)
        self.position = nn.Parameter(torch.randn(20) * 0.1)
        self.trunk = Trunk()
        self.head = nn.Linear(20, 10)
        self.dtactor_units = ["trunk.blocks.0", "trunk.blocks.1", "trunk.blocks.2", "head"]

    def forward(self, x):
        h = self.trunk(self.embed(x) + self.position)
        return self.head(h)

    @torch.jit.export
    def loss(self, x, y):
        return nn.functional.cross_entropy(self.forward(x), y, reduction="none")


# 33.6 MB of parameters, every one in a declared unit: a rank building it
# deferred reads none of their values while it loads.
class BigUnits(nn.Module):
    dtactor_units: List[str]

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 1024)
        self.blocks = nn.ModuleList([nn.Linear(1024, 1024) for _ in range(8)])
        self.head = nn.Linear(1024, 10)
        self.dtactor_units = ["inp"] + [f"blocks.{i}" for i in range(8)] + ["head"]

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


# Units returning a tuple of tensors (a gated block's two branches).
class PairBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 20))
        self.b = nn.Linear(20, 20)

    def forward(self, x):
        return self.a(x), self.b(x)


class DeclaredTuple(nn.Module):
    dtactor_units: List[str]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([PairBlock() for _ in range(2)])
        self.head = nn.Linear(20, 10)
        self.dtactor_units = ["blocks.0", "blocks.1", "head"]

    def forward(self, x):
        for b in self.blocks:
            h, g = b(x)
            x = h * torch.sigmoid(g)
        return self.head(x)


# Reads a unit's parameter outside the unit's call: its gathered values are
# gone by then, so it cannot be trained with that unit.
class DeclaredReads(Declared):
    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.norm.weight.mean()


# nanoGPT's .bin: flat uint16 token ids; a pattern a bigram model can learn
np.tile(np.arange(50, dtype=np.uint16), 400).tofile(os.path.join(out, "tokens.bin"))
np.array([1, 2, 3, 70, 5] * 20, dtype=np.uint16).tofile(os.path.join(out, "tokens_bad.bin"))

# The same classifier data as shards: WebDataset-style tar shards (an .npy
# input and a .cls class id per sample, as webdataset's ShardWriter writes
# them) and .npy shard pairs, 256 samples a shard.
import io
import tarfile


def member(tar, name, payload):
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def npy_bytes(a):
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


for split, (xs, ys) in {"train": (x, y), "eval": (xe, ye)}.items():
    os.makedirs(os.path.join(out, "tar"), exist_ok=True)
    os.makedirs(os.path.join(out, "npyshards"), exist_ok=True)
    for s in range(len(xs) // 256):
        rows = range(s * 256, (s + 1) * 256)
        with tarfile.open(os.path.join(out, "tar", f"{split}-{s:03d}.tar"), "w") as tar:
            for i in rows:
                member(tar, f"{i:06d}.npy", npy_bytes(xs[i]))
                member(tar, f"{i:06d}.cls", str(int(ys[i])).encode())
        np.save(os.path.join(out, "npyshards", f"{split}-x-{s:03d}.npy"), xs[rows.start:rows.stop])
        np.save(os.path.join(out, "npyshards", f"{split}-y-{s:03d}.npy"), ys[rows.start:rows.stop])

torch.manual_seed(0)
torch.jit.script(Bigram()).save(os.path.join(out, "bigram.pt"))
torch.jit.script(BigramWithBias()).save(os.path.join(out, "bigram2.pt"))
torch.jit.script(WithBatchNorm()).save(os.path.join(out, "bn.pt"))
torch.jit.script(MLP()).save(os.path.join(out, "mlp.pt"))
torch.jit.script(WithLoss()).save(os.path.join(out, "mlp_loss.pt"))
torch.jit.script(BadShape()).save(os.path.join(out, "bad_shape.pt"))
torch.jit.script(ScalarLoss()).save(os.path.join(out, "scalar_loss.pt"))
# A plain nn.Sequential: at train.zero = 3 each child with parameters is
# gathered on its own.
torch.jit.script(nn.Sequential(nn.LayerNorm(20), nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                               nn.Linear(64, 10))).save(os.path.join(out, "seq.pt"))
torch.jit.script(Declared()).save(os.path.join(out, "declared.pt"))
# Its forward adds each block's input back around the units.
torch.jit.script(Declared(residual=True)).save(os.path.join(out, "declared_residual.pt"))
torch.jit.script(DeclaredDeep()).save(os.path.join(out, "declared_deep.pt"))
torch.jit.script(DeclaredReads()).save(os.path.join(out, "declared_reads.pt"))
torch.jit.script(BigUnits()).save(os.path.join(out, "big_units.pt"))
torch.jit.script(DeclaredTuple()).save(os.path.join(out, "declared_tuple.pt"))
torch.jit.script(Declared(units=("norm", "blocks.0", "blocks.1", "head", "unused"), unused=True)).save(os.path.join(out, "declared_unused.pt"))
torch.jit.script(Declared(units=("norm", "blocks.0", "blocks.9", "head"))).save(os.path.join(out, "declared_missing.pt"))
torch.jit.script(Declared(units=("norm", "blocks.0", "blocks.0.0", "head"))).save(os.path.join(out, "declared_nested.pt"))
with open(os.path.join(out, "not_a_module.pt"), "wb") as f:
    f.write(b"this is not a zip archive")

# What the modules with units give on the first 8 held-out samples in
# evaluation mode (mean per-sample loss, through their loss method where
# they have one): dtactor's forward with the units' calls gated must give
# the same.
with torch.no_grad():
    expected = {}
    for name in ("declared_residual.pt", "declared_deep.pt", "declared_tuple.pt", "seq.pt"):
        m = torch.jit.load(os.path.join(out, name)).eval()
        xs, ys = torch.from_numpy(xe[:8]), torch.from_numpy(ye[:8])
        losses = m.loss(xs, ys) if hasattr(m, "loss") else nn.functional.cross_entropy(m(xs), ys, reduction="none")
        expected[name] = float(losses.double().mean())
with open(os.path.join(out, "gated_expected.json"), "w") as f:
    json.dump(expected, f)
