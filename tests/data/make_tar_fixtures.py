#!/usr/bin/python3.11
"""Writes what tests/webdataset_test.cpp reads: tar shards as Python's
tarfile writes them (ustar, GNU long names, pax), images as PIL writes them,
and what each should read back as (expected.json). Usage: make_tar_fixtures.py OUTDIR"""
import base64
import io
import json
import os
import sys
import tarfile

import numpy as np
from PIL import Image

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(11)
long_dir = "d" * 90 + "/" + "e" * 40  # > 100 characters: GNU and pax need their long names


def png(a, mode):
    b = io.BytesIO()
    Image.fromarray(a, mode).save(b, format="PNG")
    return b.getvalue()


def jpg(a, mode):
    b = io.BytesIO()
    Image.fromarray(a, mode).save(b, format="JPEG", quality=90)
    return b.getvalue()


def npy(a):
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


gray = rng.integers(0, 256, size=(5, 7), dtype=np.uint8)
rgb = rng.integers(0, 256, size=(6, 4, 3), dtype=np.uint8)
rgba = rng.integers(0, 256, size=(3, 3, 4), dtype=np.uint8)
smooth = np.stack([np.add.outer(np.arange(16), np.arange(16)) * 8 % 256] * 3, axis=2).astype(np.uint8)
images = {
    "gray.png": (png(gray, "L"), gray[:, :, None]),
    "rgb.png": (png(rgb, "RGB"), rgb),
    # the alpha channel dropped, as PIL's convert("RGB") does
    "rgba.png": (png(rgba, "RGBA"), rgba[:, :, :3]),
    "rgb.jpg": (jpg(smooth, "RGB"), None),
    "gray.jpg": (jpg(smooth[:, :, 0], "L"), None),
}
expected_images = {}
for name, (data, pixels) in images.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
    if pixels is None:  # what PIL (libjpeg-turbo too) decodes
        pixels = np.asarray(Image.open(io.BytesIO(data)))
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
    expected_images[name] = {"shape": list(pixels.shape), "pixels": pixels.reshape(-1).tolist()}

samples = [
    ("000", {"png": images["gray.png"][0], "cls": b"3"}),
    ("001", {"jpg": images["rgb.jpg"][0], "cls": b"7\n"}),
    ("002", {"npy": npy(np.arange(6, dtype=np.float32).reshape(2, 3)), "cls": b" 1 "}),
    ("003", {"seg.png": images["rgb.png"][0], "cls": b"0", "json": b'{"a": 1}'}),
]


def add(tar, name, payload):
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(payload))


expected = {}
for fmt, name, prefix in [(tarfile.USTAR_FORMAT, "ustar.tar", "./"), (tarfile.USTAR_FORMAT, "ustar_prefix.tar", long_dir + "/"),
                          (tarfile.GNU_FORMAT, "gnu.tar", long_dir + "/"),
                          (tarfile.PAX_FORMAT, "pax.tar", long_dir + "/\u00e9t\u00e9-")]:
    with tarfile.open(os.path.join(out, name), "w", format=fmt) as tar:
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        add(tar, "README", b"no extension: in no sample")
        for key, members in samples:
            for ext, payload in members.items():
                add(tar, prefix + key + "." + ext, payload)
    keys = [(prefix[2:] if prefix == "./" else prefix) + k for k, _ in samples]
    expected[name] = [{"key": keys[i], "members": {ext: base64.b64encode(p).decode() for ext, p in m.items()}}
                      for i, (_, m) in enumerate(samples)]

with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump({"tars": expected, "images": expected_images}, f)
