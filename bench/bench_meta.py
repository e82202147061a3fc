"""The standard header of every bench result (bench/*.json), which
scripts/bench_page.py turns into docs/benchmarks.md.

A result is one JSON object per measurement target; a new run of the same
target overwrites it (the page keeps no history). Beside the measurement's own
keys it holds:

  "meta": {
    "title":   what this run measures, a line,
    "group":   the page's section (one of bench_page.GROUPS),
    "command": the command line that wrote the file, from the repository root,
    "machine": {"cores", "mem_total_bytes", "cpu", "kernel", "os",
               "load_average_1m"} read from /proc and
               /etc/os-release when the header is made, plus
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
    build/bench/bench_runtime --steps 400 --repeats 5 | python3 bench/bench_meta.py stamp \\
        bench/runtime_results.json --kind runtime --command "build/bench/bench_runtime --steps 400 --repeats 5"
    build/bench/bench_curve_link --repeats 5 --out bench/curve_link_results.json && python3 bench/bench_meta.py \\
        stamp bench/curve_link_results.json --in bench/curve_link_results.json --kind curve_link \\
        --command "build/bench/bench_curve_link --repeats 5"

which takes the title, group and figures of that kind from KINDS below
(scripts/fuzz.sh --json, bench/torchscript_vs_builtin.sh and
bench/wire_accuracy.sh call it themselves).
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
    load = _read("/proc/loadavg").split()
    # The load as the header is made (the end of the run): on a shared
    # machine, a sign of what else ran beside it.
    return {"cores": os.cpu_count(), "mem_total_bytes": mem, "cpu": cpu or platform.processor(),
            "kernel": platform.release(), "os": os_name, "load_average_1m": float(load[0]) if load else None}


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
# shell): `bench_meta.py stamp --kind K` applies them to the JSON they print,
# keeping the figures that the run produced (a bench's --modes or --kinds
# choose what it measures).
F = figure
KINDS = {
    "inflate": {
        "title": "The default job's data at a rank's start: Fashion-MNIST's four .gz files inflated, libdeflate (what ranks use) against zlib, alternating in one run",
        "group": "Data",
        "figures": [
            F("the four files inflated by libdeflate, whole (median)", ["libdeflate_s_median"], "s",
              "zlib's streaming read", ["zlib_s_median"]),
            F("zlib's time over libdeflate's, paired by repeat (median)", ["zlib_over_libdeflate_paired_median"], "x"),
        ],
    },
    "peer_moves": {
        "title": "The point-to-point state path on one host: the 202M GPT's 2.42 GB from one rank process to another, read from the sender's memory against over Gloo's loopback TCP, alternating in one run",
        "group": "Recovery from faults",
        "figures": [
            F("into pages already in (a rank that held the state): through memory (median)", ["memory_touched", "gb_per_s_median"], "GB/s",
              "over Gloo, two TCP streams", ["group_touched", "gb_per_s_median"]),
            F("into fresh pages (a joining rank's new windows): through memory (median)", ["memory_fresh", "gb_per_s_median"], "GB/s",
              "over Gloo, two TCP streams", ["group_fresh", "gb_per_s_median"]),
            F("into pages already in: Gloo's time over memory's, paired by round (median)", ["group_s_over_memory_s_touched_paired_median"], "x"),
            F("into fresh pages: Gloo's time over memory's, paired by round (median)", ["group_s_over_memory_s_fresh_paired_median"], "x"),
        ],
    },
    "page_pool": {
        "title": "A train.zero = 3 gather's writes into the pages of a released unit (64 MiB units, 8 of them): pages given back to the kernel against kept in the gate's page pool, in turn in one run",
        "group": "Sharded state (ZeRO)",
        "figures": [
            F("gather into pooled pages (median)", ["pooled", "gather_gb_per_s_median"], "GB/s",
              "into pages given back (MADV_DONTNEED)", ["given_back", "gather_gb_per_s_median"]),
            F("given back's gather time over pooled's, paired by round (median)", ["given_back_over_pooled_gather_s_paired_median"], "x"),
            F("a unit's release into the pool (median)", ["pooled", "release_s_median"], "s",
              "given back", ["given_back", "release_s_median"]),
        ],
    },
    "chaos": {
        "title": "Faults on one machine: coordinator + 2 nodes x 1 rank, the default ViT job, real processes",
        "group": "Recovery from faults",
        "figures": [
            F("a node killed -9: the first step at the new world size after the kill (median)",
              ["kill9", "first_step_at_new_world_s", "median"], "s"),
            F("a node killed -9: the loss detected (median)", ["kill9", "detected_s", "median"], "s"),
            F("a node killed -9: completed steps lost (worst trial)", ["kill9", "lost_steps", "max"], "steps"),
            F("a node stopped (SIGSTOP, a hung machine): the first step at the new world size (median)",
              ["sigstop", "first_step_at_new_world_s", "median"], "s"),
            F("a node leaving (SIGTERM): the survivor's pause beyond one step (median)",
              ["sigterm", "pause_beyond_one_step_s", "median"], "s"),
            F("a replacement node (cold, started after a member was killed -9): from its registration to its first step in the job (median)",
              ["replace", "contributing_after_register_s", "median"], "s"),
            F("a replacement node (cold, after a kill -9): the others' pause beyond one step while it joins (median)",
              ["replace", "others_paused_beyond_one_step_s", "median"], "s"),
            F("the coordinator killed -9 and restarted 3 s later: steps trained while it was down (median)",
              ["coordinator", "steps_completed_while_down_3s", "median"], "steps"),
            F("the coordinator killed -9: completed steps lost (worst trial)", ["coordinator", "lost_steps", "max"], "steps"),
            # --soak
            F("soak: faults injected", ["soak", "with_faults", "faults"], "count"),
            F("soak: recoveries", ["soak", "with_faults", "recoveries"], "count"),
            F("soak: completed steps lost", ["soak", "with_faults", "lost_steps"], "steps"),
            F("soak: test accuracy at the end, with faults", ["soak", "with_faults", "accuracy"], "accuracy",
              "the same job fault-free", ["soak", "fault_free", "accuracy"]),
        ],
    },
    "runtime": {
        "title": "The runtime against one process: the ViT, global batch 128",
        "group": "Throughput",
        "figures": [
            F("dtactor local, 2 ranks: samples/s", ["modes", "local2", "samples_per_s_median"], "samples/s",
              "dtactor train, one process", ["modes", "train", "samples_per_s_median"]),
            F("2 ranks over one process (median of the per-repeat ratios)", ["ratio_2_ranks_vs_1_process_paired_median"], "x"),
            F("dtactor local, 1 rank: samples/s", ["modes", "local1", "samples_per_s_median"], "samples/s",
              "dtactor train, one process", ["modes", "train", "samples_per_s_median"]),
            F("dtactor local, 2 ranks, default settings: samples/s", ["modes", "local2_default", "samples_per_s_median"], "samples/s",
              "dtactor train, default settings", ["modes", "train_default", "samples_per_s_median"]),
            F("2 ranks over one process, default settings (median of the per-repeat ratios)",
              ["ratio_2_ranks_vs_1_process_default_settings_paired_median"], "x"),
            F("dtactor local, 2 ranks: samples/s", ["modes", "local2", "samples_per_s_median"], "samples/s",
              "the baseline build (--baseline-bin)", ["modes", "base_local2", "samples_per_s_median"]),
            F("dtactor local, 1 rank over dtactor train side by side (median of the ratios)", ["ratio_local1_vs_train_median"], "x"),
        ],
    },
    "curve_link": {
        "title": "CURVE's cost per control-plane message (one link, round trips)",
        "group": "Control plane and security",
        "figures": [
            F("tcp, a heartbeat (70 B): extra CPU per message with CURVE (median of the pairs)",
              ["tcp", "heartbeat", "extra_cpu_us_per_message_paired_median"], "us"),
            F("tcp, a step report (198 B): extra CPU per message with CURVE", ["tcp", "step_report", "extra_cpu_us_per_message_paired_median"], "us"),
            F("tcp, a 4 KiB frame: round trip with CURVE", ["tcp", "4KiB", "keyed", "us_per_round_trip"], "us",
              "open link", ["tcp", "4KiB", "open", "us_per_round_trip"]),
            F("tcp: the handshake with CURVE", ["tcp", "heartbeat", "keyed", "handshake_ms"], "ms",
              "open link", ["tcp", "heartbeat", "open", "handshake_ms"]),
            F("at the default settings: CURVE's extra CPU of a rank process, as a share of a core",
              ["default_settings_bound", "rank_process_extra_cpu_fraction_of_a_core"], "fraction"),
        ],
    },
    "torchscript_vs_builtin": {
        "title": "The ViT written in PyTorch and scripted against the built-in ViT: dtactor train, default settings",
        "group": "Throughput",
        "figures": [F("TorchScript over built-in, samples/s (ratio of the medians)", ["ratio_of_medians"], "x")],
    },
    "wire_accuracy": {
        "title": "The bf16 wire's effect on accuracy: 2 namespace hosts x 1 rank",
        "group": "DiLoCo and thin links",
        "figures": [
            F("test accuracy with the bf16 wire", ["bf16", "accuracy"], "accuracy", "fp32 wire", ["fp32", "accuracy"]),
            F("validation loss with the bf16 wire", ["bf16", "val_loss"], "loss", "fp32 wire", ["fp32", "val_loss"]),
        ],
    },
    "fuzz": {
        "title": "Every fuzz target (libFuzzer, ASan, UBSan)",
        "group": "Fuzzing",
        "figures": [
            F("targets that failed (crash, leak, out of memory, timeout)", ["failed"], "count"),
            F("wall time of the run", ["total_s"], "s"),
        ],
    },
}
del F


def main():
    ap = argparse.ArgumentParser(description="stamp a bench's JSON with meta and the figures of its kind")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stamp")
    s.add_argument("out", help="the bench/*.json to write, or - for stdout")
    s.add_argument("--in", dest="src", default="-", help="the bench's JSON (default: stdin)")
    s.add_argument("--kind", required=True, choices=sorted(KINDS))
    s.add_argument("--command", required=True, help="the bench's command line, as typed")
    s.add_argument("--title", help="instead of the kind's title")
    s.add_argument("--notes")
    a = ap.parse_args()
    if a.src == "-":
        result = json.load(sys.stdin)
    else:
        with open(a.src) as f:
            result = json.load(f)
    k = KINDS[a.kind]
    figures = []
    for f in k["figures"]:
        try:
            lookup(result, f["at"])
            if "anchor_at" in f:
                lookup(result, f["anchor_at"])
        except (KeyError, IndexError, TypeError):
            continue
        figures.append(f)
    if not figures:
        sys.exit("bench_meta: none of the %s figures is in this JSON" % a.kind)
    title = a.title or k["title"]
    if a.out == "-":
        json.dump(stamped(result, title, k["group"], figures, a.command, a.notes), sys.stdout, indent=1)
        print()
    else:
        write(a.out, result, title, k["group"], figures, a.command, a.notes)
        print("bench_meta: wrote " + a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
