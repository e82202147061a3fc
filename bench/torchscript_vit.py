#!/usr/bin/python3.11
"""The built-in ViT (model/vit, model/layers: dim 64, 4 pre-norm blocks, 4
heads, MLP x4, 7x7 patches of 28x28 images) written in PyTorch and scripted,
for bench/torchscript_vs_builtin.sh (and bench/ddp_vit.py imports it).
Usage: torchscript_vit.py OUT.pt"""
import math
import sys

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        kv = self.kv(x).view(b, t, 2, self.heads, hd).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, kv[0].transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        ctx = torch.matmul(torch.softmax(scores, -1), kv[1]).transpose(1, 2).reshape(b, t, d)
        return self.out(ctx)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 4, heads: int = 4, patch: int = 7, classes: int = 10):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Linear(patch * patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (28 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        b = x.shape[0]
        p = self.patch
        g = 28 // p
        patches = x.reshape(b, g, p, g, p).permute(0, 1, 3, 2, 4).reshape(b, g * g, p * p)
        h = torch.cat([self.cls_token.expand(b, -1, -1), self.patch_embed(patches)], 1) + self.pos_embed
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h[:, 0]))


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.jit.script(ViT()).save(sys.argv[1])
