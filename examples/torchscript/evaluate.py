#!/usr/bin/python3.11
"""Loads what `dtactor export` wrote in PyTorch and measures its test accuracy.
Usage: evaluate.py EXPORTED.pt [DATADIR]   (DATADIR default: runs/cnn-data)"""
import sys

import numpy as np
import torch

model = torch.jit.load(sys.argv[1])
data = sys.argv[2] if len(sys.argv) > 2 else "runs/cnn-data"
x = torch.from_numpy(np.load(f"{data}/test_images.npy"))
y = torch.from_numpy(np.load(f"{data}/test_labels.npy"))
model.eval()
with torch.no_grad():
    correct = sum((model(x[i:i + 500]).argmax(1) == y[i:i + 500]).sum().item() for i in range(0, len(y), 500))
print(f"test accuracy {correct / len(y):.4f} ({correct} of {len(y)})")
