#!/usr/bin/python3.11
"""Messages received on ZeroMQ sockets, recovered from `strace -ff -tt -xx
-s 1048576 -e trace=recvfrom` files of dtactor processes (ZMTP 3: a 64-byte
greeting, then frames: flags, a 1- or 8-byte size, the body; commands such
as READY skipped). Used by capture_real_run.sh. Prints nothing; as a
module: streams(paths) -> [(path, fd, peer socket type, [(unix time, [frames])])]."""
import re
import sys

LINE = re.compile(r'^(\d+:\d+:\d+\.\d+) recvfrom\((\d+), "((?:\\x[0-9a-f]{2})*)".*\) = (\d+)')


def tseconds(s):
    h, m, rest = s.split(":")
    return int(h) * 3600 + int(m) * 60 + float(rest)


def streams(paths):
    out = []
    for path in paths:
        chunks = {}  # fd -> [(t, bytes)]
        for line in open(path, errors="replace"):
            m = LINE.match(line)
            if not m or int(m.group(4)) == 0:
                continue
            data = bytes.fromhex(m.group(3).replace("\\x", ""))[: int(m.group(4))]
            chunks.setdefault(int(m.group(2)), []).append((tseconds(m.group(1)), data))
        for fd, parts in chunks.items():
            buf = b"".join(d for _, d in parts)
            # Where each byte arrived, for the messages' times.
            ends, at = [], 0
            for t, d in parts:
                at += len(d)
                ends.append((at, t))
            if len(buf) < 64 or buf[0] != 0xFF or buf[9] != 0x7F:
                continue  # not ZMTP (Gloo, HTTP, ...)
            pos, peer_type, msgs, frames = 64, "", [], []
            while pos < len(buf):
                flags = buf[pos]
                if flags & 0x02:
                    if pos + 9 > len(buf):
                        break
                    size, head = int.from_bytes(buf[pos + 1:pos + 9], "big"), 9
                else:
                    if pos + 2 > len(buf):
                        break
                    size, head = buf[pos + 1], 2
                body = buf[pos + head:pos + head + size]
                if len(body) < size:
                    break
                pos += head + size
                if flags & 0x04:
                    if body[1:6] == b"READY":
                        i = body.find(b"\x0bSocket-Type")
                        if i >= 0:
                            n = int.from_bytes(body[i + 12:i + 16], "big")
                            peer_type = body[i + 16:i + 16 + n].decode()
                    continue
                frames.append(body)
                if not flags & 0x01:
                    t = next(t for end, t in ends if end >= pos)
                    msgs.append((t, frames))
                    frames = []
            out.append((path, fd, peer_type, msgs))
    return out


if __name__ == "__main__":
    for path, fd, peer, msgs in streams(sys.argv[1:]):
        print(path, fd, peer, len(msgs), "messages")
