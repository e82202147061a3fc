"""The standard header of every bench result (bench/*.json), which
scripts/bench_page.py turns into docs/benchmarks.md.

A result is one JSON object per measurement target; a new run of the same
target overwrites it (the page keeps no history). Beside the measurement's own
keys it holds:

  "meta": {
    "title":   what this run measures, a line,
    "group":   the page's section (one of bench_page.GROUPS),
    "command": the command line that wrote the file, from the repository root,
    "machine": {"cores", "mem_total_bytes", "cpu", "kernel", "os"} read from
               /proc and /etc/os-release at the time of the run, plus
               "description" where a person described it,
    "date":    the UTC time of the run (ISO 8601), and
    "date_is": "run" (stamped by the bench) or "committed" (a file written
               before benches stamped their date: the date its last version
               was committed),
    "notes":   optional, a line the page prints under the run
  },
  "figures": [
    {"what": what is measured, a short line,
     "at": the path of keys (and list indices) to our figure in this file,
     "unit": "s", "ms", "us", "samples/s", "x", "%", "bytes", "B/param",
             "steps", "count", "loss", "MB/s", ... (bench_page.format_value),
     "anchor": optional, what the figure is compared against (torchrun,
             PyTorch DDP, zero=0, the build before, ...), measured in the same
             run,
     "anchor_at": the path to the anchor's figure in this file}
  ]

Figures point into the measurement rather than copy it, so the page shows
exactly what the bench wrote. Python benches import this module:

    import bench_meta
    bench_meta.write(path, result, title=..., group=..., figures=[
        bench_meta.figure("kill -9 to the first step", ["kill9", "median_s"], "s")])

Benches written in C++ or shell pipe their JSON through the command line:

    build/bench/bench_chaos --trials 5 | python3 bench/bench_meta.py stamp \\
        bench/chaos_results.json --kind chaos --command "build/bench/bench_chaos --trials 5"

which takes the title, group and figures of that kind from KINDS below.
Stdlib only.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine():
    """The machine this process runs on, from /proc (Linux)."""
    mem = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    cpu = ""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    os_name = ""
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            os_name = line.split("=", 1)[1].strip().strip('"')
    return {"cores": os.cpu_count(), "mem_total_bytes": mem, "cpu": cpu or platform.processor(),
            "kernel": platform.release(), "os": os_name}


def command(argv=None):
    """The command line as typed from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.isabs(argv[0]) and argv[0].startswith(ROOT + os.sep):
        argv[0] = os.path.relpath(argv[0], ROOT)
    return shlex.join(argv)


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(title, group, cmd=None, notes=None):
    m = {"title": title, "group": group, "command": cmd if cmd is not None else command(),
         "machine": machine(), "date": now(), "date_is": "run"}
    if notes:
        m["notes"] = notes
    return m


def figure(what, at, unit, anchor=None, anchor_at=None):
    f = {"what": what, "at": list(at), "unit": unit}
    if anchor is not None:
        f["anchor"] = anchor
        f["anchor_at"] = list(anchor_at)
    return f


def lookup(data, at):
    """The value at a path of keys and list indices; KeyError/IndexError if absent."""
    v = data
    for k in at:
        v = v[k]
    return v


def stamped(result, title, group, figures, cmd=None, notes=None):
    """result with meta and figures in front; every figure must resolve."""
    out = {"meta": meta(title, group, cmd, notes), "figures": figures}
    out.update({k: v for k, v in result.items() if k not in ("meta", "figures")})
    for f in figures:
        lookup(out, f["at"])
        if "anchor_at" in f:
            lookup(out, f["anchor_at"])
    return out


def write(path, result, title, group, figures, cmd=None, notes=None):
    """Writes result, stamped, to path (one file per target: it replaces the
    previous run's) and returns what it wrote."""
    out = stamped(result, title, group, figures, cmd, notes)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return out


# Title, group and figures of the benches that are not Python (C++ and
# shell): `bench_meta.py stamp --kind K` applies them to the JSON they print.
KINDS = {
    "chaos": {
        "title": "Recovery from faults: coordinator + 2 nodes x 1 rank, default ViT, real processes",
        "group": "Recovery from faults",
        "figures": [
            figure("a node killed -9: the first step at the new world size after the kill (median)",
                   ["kill9", "first_step_at_new_world_s", "median"], "s"),
            figure("a node killed -9: the loss detected (median)", ["kill9", "detected_s", "median"], "s"),
            figure("a node killed -9: completed steps lost (worst trial)", ["kill9", "lost_steps", "max"], "steps"),
            figure("a node stopped (SIGSTOP, a hung machine): the first step at the new world size (median)",
                   ["sigstop", "first_step_at_new_world_s", "median"], "s"),
            figure("a node leaving (SIGTERM): the survivor's pause beyond one step (median)",
                   ["sigterm", "pause_beyond_one_step_s", "median"], "s"),
            figure("a replacement node: from its registration to its first step in the job (median)",
                   ["replace", "contributing_after_register_s", "median"], "s"),
            figure("a replacement node: the others' pause beyond one step while it joins (median)",
                   ["replace", "others_paused_beyond_one_step_s", "median"], "s"),
            figure("the coordinator killed -9 and restarted 3 s later: steps trained while it was down (median)",
                   ["coordinator", "steps_completed_while_down_3s", "median"], "steps"),
            figure("the coordinator killed -9: completed steps lost (worst trial)", ["coordinator", "lost_steps", "max"], "steps"),
        ],
    },
}


def main():
    ap = argparse.ArgumentParser(description="stamp a bench's JSON (stdin) with meta and figures")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stamp")
    s.add_argument("out", help="the bench/*.json to write")
    s.add_argument("--kind", required=True, choices=sorted(KINDS))
    s.add_argument("--command", required=True, help="the bench's command line, as typed")
    s.add_argument("--notes")
    a = ap.parse_args()
    result = json.load(sys.stdin)
    k = KINDS[a.kind]
    write(a.out, result, k["title"], k["group"], k["figures"], a.command, a.notes)
    print("bench_meta: wrote " + a.out)


if __name__ == "__main__":
    main()
