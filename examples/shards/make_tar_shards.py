#!/usr/bin/python3.11
"""Writes an image data set as WebDataset-style tar shards (docs/data.md,
"Tar shards"): one sample per key, `<key>.png` (or .jpg, or .npy) and
`<key>.cls`, the files of a sample consecutive, as webdataset's ShardWriter
writes them.

The built-in source is Debian's Fashion-MNIST (dataset-fashion-mnist); any
data set with a NumPy array of images [N, H, W] or [N, H, W, C] (uint8) and
one of class ids [N] works with --images/--labels.

  make_tar_shards.py --out shards/train --split train --per-shard 2000
  make_tar_shards.py --out shards/test --split test --per-shard 2000
  dtactor data index 'shards/train/train-*.tar'     # sample counts, digests
  dtactor train --set model.name=vit --set "data.train_shards=shards/train/train-*.tar" \\
                --set "data.eval_shards=shards/test/test-*.tar"

Needs python3-numpy and, for png/jpg, python3-pil (Debian packages).
"""
import argparse
import gzip
import io
import os
import struct
import sys
import tarfile

import numpy as np


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise SystemExit(f"{path}: not an IDX file of unsigned bytes")
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(directory, split):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"))
    return images, labels


def encode(image, fmt):
    if fmt == "npy":
        out = io.BytesIO()
        np.save(out, image)
        return out.getvalue()
    from PIL import Image  # python3-pil

    out = io.BytesIO()
    mode = "L" if image.ndim == 2 or image.shape[2] == 1 else "RGB"
    Image.fromarray(image.reshape(image.shape[:2]) if mode == "L" else image, mode).save(
        out, format="PNG" if fmt == "png" else "JPEG", **({"quality": 95} if fmt == "jpg" else {}))
    return out.getvalue()


def add(tar, name, payload):
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 0  # the same bytes every time: the shard index's digests stay
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(payload))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the shards")
    p.add_argument("--split", default="train", choices=["train", "test"], help="Fashion-MNIST split (default train)")
    p.add_argument("--fashion-mnist-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--images", help="a .npy array of uint8 images [N, H, W(, C)] instead of Fashion-MNIST")
    p.add_argument("--labels", help="a .npy array of class ids [N] (with --images)")
    p.add_argument("--per-shard", type=int, default=2000, help="samples per shard (default 2000)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N samples (0 = all)")
    p.add_argument("--format", default="png", choices=["png", "jpg", "npy"], help="image member (default png)")
    p.add_argument("--prefix", help="shard file name prefix (default: the split)")
    a = p.parse_args()
    if a.images:
        if not a.labels:
            p.error("--images needs --labels")
        images, labels = np.load(a.images), np.load(a.labels)
    else:
        images, labels = fashion_mnist(a.fashion_mnist_dir, a.split)
    if a.limit:
        images, labels = images[:a.limit], labels[:a.limit]
    if len(images) != len(labels):
        raise SystemExit(f"{len(images)} images but {len(labels)} labels")
    os.makedirs(a.out, exist_ok=True)
    prefix = a.prefix or a.split
    shards = (len(images) + a.per_shard - 1) // a.per_shard
    width = max(6, len(str(shards - 1)))
    for s in range(shards):
        path = os.path.join(a.out, f"{prefix}-{s:0{width}d}.tar")
        tmp = path + ".tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * a.per_shard, min(len(images), (s + 1) * a.per_shard)):
                key = f"{i:08d}"
                add(tar, f"{key}.{a.format}", encode(images[i], a.format))
                add(tar, f"{key}.cls", str(int(labels[i])).encode())
        os.replace(tmp, path)
    print(f"{len(images)} samples in {shards} shard(s): {a.out}/{prefix}-{0:0{width}d}.tar .. {prefix}-{shards - 1:0{width}d}.tar",
          file=sys.stderr)


if __name__ == "__main__":
    main()
