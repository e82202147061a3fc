#!/usr/bin/python3.11
"""An endpoint that answers like a broken (or hostile) S3 server, for the
S3 store's tests: every request gets one of

  repeat-token  200, a ListObjectsV2 page with one object, IsTruncated true
                and the same NextContinuationToken every time (a client that
                trusts it pages forever);
  huge          200 with a body of --mb MiB (streamed, never buffered here);
  unconditional 200 to everything, an empty listing to a list: a PUT with
                If-None-Match: * succeeds though the object exists.

Binds 127.0.0.1:0 and writes its port to --port-file once listening.
Counts requests; GET /__control/stats -> JSON {"requests": N}.
"""
import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

count = {"requests": 0}
lock = threading.Lock()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["repeat-token", "huge", "unconditional"], required=True)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--port-file", required=True)
    a = ap.parse_args()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def answer(self):
            if self.path.startswith("/__control/stats"):
                with lock:
                    body = json.dumps(count).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            with lock:
                count["requests"] += 1
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            if a.mode == "repeat-token":
                body = ("<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>true</IsTruncated>"
                        "<Contents><Key>p/x</Key><Size>1</Size></Contents>"
                        "<NextContinuationToken>same-token</NextContinuationToken></ListBucketResult>").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if a.mode == "unconditional":
                body = b""
                if self.command == "GET" and "list-type=2" in self.path:
                    body = b"<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            total = a.mb << 20
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            chunk = b"<" * (1 << 20)
            try:
                for _ in range(a.mb):
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    with open(a.port_file + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    import os
    os.rename(a.port_file + ".tmp", a.port_file)
    srv.serve_forever()


if __name__ == "__main__":
    main()
