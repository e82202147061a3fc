#!/usr/bin/python3.11
"""A PyTorch user's side of dtactor: a small CNN for Fashion-MNIST written in
PyTorch, scripted and saved, and the data as NumPy .npy arrays.

  /usr/bin/python3.11 examples/torchscript/prepare.py [OUTDIR]   (default: runs/cnn-data)

writes OUTDIR/cnn.pt (torch.jit.script(CNN()).save) and
OUTDIR/{train,test}_{images,labels}.npy from Debian's dataset-fashion-mnist.
Then train it with dtactor (examples/torchscript/cnn.toml names these files):

  ./build/dtactor local --nodes 2 --config examples/torchscript/cnn.toml
  ./build/dtactor export runs/local --out runs/cnn-trained.pt
  /usr/bin/python3.11 examples/torchscript/evaluate.py runs/cnn-trained.pt
"""
import gzip
import os
import sys

import numpy as np
import torch
from torch import nn

out = sys.argv[1] if len(sys.argv) > 1 else "runs/cnn-data"
src = "/usr/share/datasets/fashion-mnist"
os.makedirs(out, exist_ok=True)


def idx(name, offset):
    with gzip.open(os.path.join(src, name), "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


for split, prefix in (("train", "train"), ("test", "t10k")):
    images = idx(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
    labels = idx(f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    # float32, normalised as a PyTorch user's transforms.Normalize would
    np.save(os.path.join(out, f"{split}_images.npy"), ((images.astype(np.float32) / 255.0 - 0.2860) / 0.3530))
    np.save(os.path.join(out, f"{split}_labels.npy"), labels)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


torch.manual_seed(0)
torch.jit.script(CNN()).save(os.path.join(out, "cnn.pt"))
print(f"wrote {out}/cnn.pt and {out}/{{train,test}}_{{images,labels}}.npy")
