#!/usr/bin/python3.11
"""A cloud instance metadata service for the preemption notice tests, speaking
each API's documented shape:

  aws   IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds)
        -> token; GET /latest/meta-data/spot/instance-action with
        X-aws-ec2-metadata-token: 401 without a valid token, 404 until the
        notice, then {"action": "terminate", "time": "...Z"} (two minutes on).
  gcp   GET /computeMetadata/v1/instance/preempted with Metadata-Flavor:
        Google (403 without): "FALSE", then "TRUE".
  azure GET /metadata/scheduledevents?api-version=2020-07-01 with Metadata:
        true (400 without): {"DocumentIncarnation", "Events": []}, then one
        Preempt event for this VM with NotBefore 30 s on (RFC 1123);
        GET /metadata/instance/compute/name -> the VM name.

Control (the tests): GET /__control/notice turns the notice on;
GET /__control/stats -> JSON request counts. Binds 127.0.0.1:0 and writes its
port to --port-file once listening.
"""
import argparse
import email.utils
import json
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

state = {"notice": False, "notice_at": 0.0, "tokens": set(), "stats": {}}
lock = threading.Lock()
VM = "dtactor-vm-b"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def reply(self, code, body="", ctype="text/plain"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def count(self, key):
        with lock:
            state["stats"][key] = state["stats"].get(key, 0) + 1

    def do_PUT(self):
        path = self.path.split("?")[0]
        self.count("PUT " + path)
        if self.server.cloud == "aws" and path == "/latest/api/token":
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.reply(400)
            tok = secrets.token_urlsafe(24)
            with lock:
                state["tokens"].add(tok)
            return self.reply(200, tok)
        self.reply(404 if self.server.cloud == "aws" else 405)

    def do_GET(self):
        path, _, query = self.path.partition("?")
        self.count("GET " + path)
        if path == "/__control/notice":
            with lock:
                state["notice"] = True
                state["notice_at"] = time.time()
            return self.reply(200, "ok")
        if path == "/__control/stats":
            with lock:
                return self.reply(200, json.dumps(state["stats"]), "application/json")
        with lock:
            notice, at = state["notice"], state["notice_at"]
        cloud = self.server.cloud
        if cloud == "aws" and path == "/latest/meta-data/spot/instance-action":
            with lock:
                ok = self.headers.get("X-aws-ec2-metadata-token") in state["tokens"]
            if not ok:
                return self.reply(401)
            if not notice:
                return self.reply(404, "Not Found")
            t = datetime.fromtimestamp(at, timezone.utc) + timedelta(minutes=2)
            return self.reply(200, json.dumps({"action": "terminate", "time": t.strftime("%Y-%m-%dT%H:%M:%SZ")}), "text/plain")
        if cloud == "gcp" and path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self.reply(403)
            return self.reply(200, "TRUE" if notice else "FALSE")
        if cloud == "azure" and path.startswith("/metadata/"):
            if self.headers.get("Metadata") != "true":
                return self.reply(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
            if path == "/metadata/instance/compute/name":
                return self.reply(200, VM)
            if path == "/metadata/scheduledevents" and "api-version=" in query:
                events = []
                if notice:
                    events = [{"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                               "Resources": [VM], "EventStatus": "Scheduled",
                               "NotBefore": email.utils.formatdate(at + 30, usegmt=True), "Description": "", "EventSource": "Platform",
                               "DurationInSeconds": -1}]
                return self.reply(200, json.dumps({"DocumentIncarnation": 2 if notice else 1, "Events": events}), "application/json")
        self.reply(404, "Not Found")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cloud", choices=["aws", "gcp", "azure"], required=True)
    ap.add_argument("--port-file", required=True)
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.cloud = a.cloud
    srv.daemon_threads = True
    tmp = a.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.server_address[1]))
    import os
    os.replace(tmp, a.port_file)
    srv.serve_forever()


if __name__ == "__main__":
    main()
