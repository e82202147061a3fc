#!/usr/bin/python3.11
"""Seeds of the fuzz targets whose inputs come from outside dtactor's code
(docs/fuzzing.md), written the way those inputs really come about:
.npy files written by NumPy itself, nanoGPT-style .bin token streams,
dictd databases cut from Debian's real dict-freedict-eng-ita and dict-gcide
(with their index offsets recomputed), the first images of Debian's
Fashion-MNIST (IDX), HTTP requests as Prometheus and curl
send them, Slurm host lists as Slurm writes them, and S3 XML responses in
the shapes of AWS's S3 API reference (ListObjectsV2, errors,
InitiateMultipartUpload, ListMultipartUploads; radosgw's own answers come
from capture_s3_seeds.sh). The preemption notices come
from tests/fake_metadata.py in make_corpus.sh. Usage: make_data_seeds.py
CORPUS_DIR (fuzz/make_corpus.sh runs it)."""
import gzip
import io
import os
import struct
import sys

import numpy as np

out = sys.argv[1]


def seed(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def record(tag, payload):
    payload = payload if isinstance(payload, bytes) else payload.encode()
    return bytes([tag]) + struct.pack("<H", len(payload)) + payload


# .npy: every dtype dtactor reads, several shapes, both header versions.
for name, arr in [
    ("f4-images", np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4) / 7),
    ("u1-labels", np.array([3, 1, 4, 1, 5, 9], dtype="u1")),
    ("i8-targets", np.array([[1, -2], [3, -4]], dtype="<i8")),
    ("f2-half", np.array([0.5, -2, 65504, 6e-8], dtype="<f2")),
    ("b1-mask", np.array([True, False, True])),
    ("f8-column", np.linspace(0, 1, 5).reshape(5, 1)),
    ("u2-tokens", np.array([[1, 2, 3], [4, 5, 6]], dtype="<u2")),
]:
    buf = io.BytesIO()
    np.save(buf, arr)
    seed("data_npy", name, buf.getvalue())
buf = io.BytesIO()
np.lib.format.write_array(buf, np.arange(6, dtype="<i4").reshape(3, 2), version=(2, 0))
seed("data_npy", "i4-v2", buf.getvalue())

# .bin: uint16 token ids as nanoGPT's prepare.py writes them (tofile), after
# the target's three bytes: vocabulary (big-endian 16 bits, + 1) and context.
text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
vocab = sorted(set(text))
ids = np.array([vocab.index(c) for c in text], dtype=np.uint16)
seed("data_bin", "shakespeare-char", struct.pack(">H", len(vocab) - 1) + bytes([8]) + ids.tobytes())
seed("data_bin", "gpt2-ids", struct.pack(">H", 50256) + bytes([16]) + np.array([15496, 11, 995, 0, 50256, 318, 257], dtype=np.uint16).tobytes())


# dictd: a few entries of the real databases, their offsets recomputed.
def b64(n):
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    s = ""
    while True:
        s = digits[n % 64] + s
        n //= 64
        if n == 0:
            return s


def dictd_seed(prefix, first, count, name):
    with open(prefix + ".index", encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    with gzip.open(prefix + ".dict.dz") as f:
        text = f.read()

    def num(s):
        v = 0
        for c in s:
            v = v * 64 + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".index(c)
        return v

    index, body = [], b""
    for line in lines[:2] + lines[first:first + count]:
        head, off, ln = line.split("\t")[:3]
        chunk = text[num(off):num(off) + num(ln)]
        index.append(f"{head}\t{b64(len(body))}\t{b64(len(chunk))}")
        body += chunk
    seed("dictd_text", name, record(0, "\n".join(index) + "\n") + record(0, gzip.compress(body)))


dictd_seed("/usr/share/dictd/freedict-eng-ita", 200, 12, "freedict-eng-ita")
dictd_seed("/usr/share/dictd/gcide", 5000, 4, "gcide")

# IDX: the first images of Debian's Fashion-MNIST test set, header recounted.
im = gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz").read()
lb = gzip.open("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz").read()
n = 2
seed("idx_pair", "fashion-mnist-t10k-2",
     record(0, im[:4] + struct.pack(">I", n) + im[8:16] + im[16:16 + n * 28 * 28]) + record(0, lb[:4] + struct.pack(">I", n) + lb[8:8 + n]))

# Slurm: SLURM_JOB_NODELIST, then SLURM_JOB_ID, SLURMD_NODENAME, SLURM_NODEID,
# SLURM_JOB_NUM_NODES, DTACTOR_COORDINATOR_PORT, SLURM_GPUS_ON_NODE,
# SLURM_RESTART_COUNT (records, in that order).
for name, vals in [
    ("job", ["gpu[01-02]", "4321", "gpu02", "1", "2", "", "4", "2"]),
    ("mixed", ["n[1-3,7],gpu-a[01-02]-ib,login", "77", "n7", "3", "6"]),
    ("single", ["localhost", "1", "localhost"]),
]:
    seed("slurm_hostlist", name, b"".join(record(0, v) for v in vals))

# S3 (first byte: 0 list, 1 error, 2 initiate, 3 uploads; 0x10: prefix "ckpt/run-1/").
ns = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
seed("s3_xml", "aws-doc-list-objects-v2", bytes([0x10]) + f"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult {ns}><Name>dtactor</Name><Prefix>ckpt/run-1/</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys>
<IsTruncated>true</IsTruncated><NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
<Contents><Key>ckpt/run-1/ckpt-000000500.manifest</Key><LastModified>2025-01-06T10:00:00.000Z</LastModified><ETag>&quot;9b2cf535f27731c974343645a3985328&quot;</ETag><Size>2211</Size><StorageClass>STANDARD</StorageClass></Contents>
<Contents><Key>ckpt/run-1/ckpt-000000500.g2.r0-of-2.part</Key><LastModified>2025-01-06T09:59:59.000Z</LastModified><ETag>&quot;a1-2&quot;</ETag><Size>1646592</Size><StorageClass>STANDARD</StorageClass></Contents>
<Contents><Key>ckpt/run-1/sub/other</Key><Size>1</Size></Contents>
</ListBucketResult>""".encode())
seed("s3_xml", "aws-doc-error", bytes([1]) + b"""<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the signature you provided.</Message><RequestId>tx000006b5</RequestId><HostId>a0b1-default</HostId></Error>""")
seed("s3_xml", "aws-doc-initiate", bytes([2]) + f"""<?xml version="1.0" encoding="UTF-8"?>
<InitiateMultipartUploadResult {ns}><Bucket>dtactor</Bucket><Key>ckpt/run-1/ckpt-000000500.g2.r1-of-2.part</Key><UploadId>2~ZpL7mC0Wd8wQ1nQ5</UploadId></InitiateMultipartUploadResult>""".encode())
seed("s3_xml", "aws-doc-list-uploads", bytes([0x13]) + f"""<?xml version="1.0" encoding="UTF-8"?>
<ListMultipartUploadsResult {ns}><Bucket>dtactor</Bucket><KeyMarker></KeyMarker><UploadIdMarker></UploadIdMarker><Prefix>ckpt/run-1/</Prefix><MaxUploads>1000</MaxUploads><IsTruncated>false</IsTruncated>
<Upload><Key>ckpt/run-1/ckpt-000000500.g2.r1-of-2.part</Key><UploadId>2~ZpL7mC0Wd8wQ1nQ5</UploadId><Initiator><ID>dtactor</ID></Initiator><StorageClass>STANDARD</StorageClass><Initiated>2025-01-06T09:59:58.000Z</Initiated></Upload>
</ListMultipartUploadsResult>""".encode())
