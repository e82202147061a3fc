#!/usr/bin/env python3
"""Writes docs/benchmarks.md from bench/*.json (the header bench/bench_meta.py
describes: "meta" and "figures").

  python3 scripts/bench_page.py           regenerate docs/benchmarks.md
  python3 scripts/bench_page.py --check   exit 1 if docs/benchmarks.md is not
                                          what the JSON files make (CI)

Every file in bench/ ending in .json must carry a meta header: either a page
section ("group") and figures, or "off_page" (the reason it is not shown).
A figure's value is read from the file at its path ("at"), never copied, so
the page always says what the bench wrote. Stdlib only.
"""
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")

# The page's sections, in this order; a group not listed here is an error.
GROUPS = [
    ("Recovery from faults", "A machine lost, hung, leaving or joining while the job trains."),
    ("Throughput", "Samples per second against one process, PyTorch DDP, and across hosts."),
    ("Sharded state (ZeRO)", "Bytes a rank holds, the largest model that fits, step time and recovery with `train.zero`."),
    ("DiLoCo and thin links", "Throughput over capped links and quality at equal samples with `train.sync = diloco`."),
    ("Checkpoints and the state path", "Writing checkpoints, moving state to a joining rank, resuming."),
    ("Data", "Sharded data sets from a directory or S3, exactly-once sample order through faults."),
    ("Control plane and security", "The coordinator's footprint, CURVE's cost, floods of garbage frames."),
    ("Fuzzing", "Every decoder of outside bytes under libFuzzer."),
    ("Install and documentation", "What `scripts/install-deps.sh` installs on a bare machine, and how much there is to read."),
]


# Units whose ratio says nothing (a ratio of ratios, of accuracies, of
# losses, of counts that are often 0).
RATIO_FREE_UNITS = ("x", "accuracy", "loss", "%", "fraction", "steps", "count")


# Shown first in their sections, in this order (the figures the README
# quotes); the other files follow by name.
LEAD = ["torchrun_recovery_results.json", "chaos_results.json", "ddp_local_results.json", "hosts_results.json",
        "install_cost_results.json"]


class PageError(Exception):
    pass


def lookup(data, at, where):
    v = data
    try:
        for k in at:
            v = v[k]
    except (KeyError, IndexError, TypeError):
        raise PageError("%s: no value at %s" % (where, json.dumps(at)))
    if isinstance(v, (dict, list)):
        raise PageError("%s: %s is not a single value" % (where, json.dumps(at)))
    return v


def group_digits(n):
    return "{:,}".format(n)


def fmt_number(v, digits):
    """Grouped thousands from 1,000 on, no decimals from 100, one from 10,
    `digits` from 1, two significant digits below 1."""
    a = abs(v)
    if a >= 1000:
        return group_digits(round(v))
    if a >= 100:
        return "%.0f" % v
    if a >= 10:
        return "%.*f" % (min(digits, 1), v)
    if a >= 1 or a == 0:
        return "%.*f" % (digits, v)
    return "%.*f" % (max(digits, 1 - math.floor(math.log10(a))), v)


def format_value(v, unit):
    """A value as the page prints it, with its unit."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    if unit == "bytes":
        for step, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(v) >= step:
                return "%s %s" % (fmt_number(v / step, 2), name)
        return "%d B" % v
    if unit == "parameters":
        if abs(v) >= 1e9:
            return "%sB parameters" % fmt_number(v / 1e9, 2)
        if abs(v) >= 1e6:
            return "%sM parameters" % fmt_number(v / 1e6, 1)
        return "%s parameters" % group_digits(int(v))
    if unit == "accuracy":
        return "%.2f%%" % (100 * v)
    if unit == "fraction":
        return "%s%%" % fmt_number(100 * v, 2)
    if unit == "%":
        return "%s%%" % fmt_number(v, 2)
    if unit == "x":
        return "%sx" % fmt_number(v, 2)
    if unit in ("count", "steps", "samples/s", "messages/s", "execs/s"):
        n = round(v) if abs(v) >= 100 or float(v).is_integer() else None
        text = group_digits(n) if n is not None else fmt_number(v, 1)
        return text if unit == "count" else "%s %s" % (text, unit)
    if unit == "loss":
        return "%.3f" % v
    return "%s %s" % (fmt_number(v, 2), unit)


def machine_text(m):
    if not isinstance(m, dict):
        return str(m)
    parts = []
    if m.get("cores"):
        parts.append("%d cores" % m["cores"])
    if m.get("mem_total_bytes"):
        parts.append("%.0f GiB" % (m["mem_total_bytes"] / 2 ** 30))
    if m.get("cpu"):
        parts.append(m["cpu"])
    text = ", ".join(parts)
    if m.get("description"):
        text = m["description"] + (" (%s)" % text if text else "")
    return text


def cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def load():
    runs, off = [], []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.json"))):
        name = os.path.basename(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as e:
            raise PageError("bench/%s: not JSON (%s)" % (name, e))
        meta = data.get("meta") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise PageError("bench/%s: no \"meta\" header (bench/bench_meta.py says what it holds)" % name)
        if "off_page" in meta:
            off.append((name, meta))
            continue
        for key in ("title", "group", "command", "machine", "date"):
            if not meta.get(key):
                raise PageError("bench/%s: meta has no %s" % (name, key))
        if meta["group"] not in [g for g, _ in GROUPS]:
            raise PageError("bench/%s: unknown group %r (scripts/bench_page.py GROUPS)" % (name, meta["group"]))
        figures = data.get("figures")
        if not figures:
            raise PageError("bench/%s: no figures" % name)
        rows = []
        for i, f in enumerate(figures):
            where = "bench/%s figure %d" % (name, i + 1)
            for key in ("what", "at", "unit"):
                if key not in f:
                    raise PageError("%s: no %s" % (where, key))
            ours = lookup(data, f["at"], where)
            anchor = None
            if "anchor" in f:
                anchor = (f["anchor"], lookup(data, f["anchor_at"], where))
            rows.append((f, ours, anchor))
        runs.append((name, meta, rows))
    return runs, off


def render(runs, off):
    out = []
    w = out.append
    w("# Benchmarks")
    w("")
    w("<!-- Generated by scripts/bench_page.py from bench/*.json; edit those, not this page. -->")
    w("")
    w("Every figure on this page is read from a JSON file in [`bench/`](../bench/) that a bench script wrote; "
      "the row names the command that wrote it and the machine (the JSON also records when it ran). Where a figure is compared with "
      "something (torchrun, PyTorch DDP, `train.zero=0`, a setting's other value), that anchor was measured "
      "in the same run, and *ratio* is ours over the anchor. Running a bench again replaces its file; "
      "`python3 scripts/bench_page.py` then rewrites this page, and CI fails while the page is out of date.")
    w("")
    w("Machines are as the bench read them from `/proc`, or as described where the run did not record them.")
    w("")
    by_group = {}
    for name, meta, rows in runs:
        by_group.setdefault(meta["group"], []).append((name, meta, rows))
    w("Sections: " + " · ".join("[%s](#%s)" % (g, anchor_id(g)) for g, _ in GROUPS if g in by_group))
    w("")
    for g, blurb in GROUPS:
        if g not in by_group:
            continue
        w("## " + g)
        w("")
        w(blurb)
        w("")
        w("| What is measured | dtactor | Anchor, same run | Ratio | Command | Machine |")
        w("|---|---|---|---|---|---|")
        for name, meta, rows in sorted(by_group[g], key=lambda r: (LEAD.index(r[0]) if r[0] in LEAD else len(LEAD), r[0])):
            w("| **%s** ([%s](../bench/%s)) | | | | | |" % (cell(meta["title"]), name, name))
            for f, ours, anchor in rows:
                anchor_text, ratio = "", ""
                if anchor:
                    anchor_text = "%s: %s" % (anchor[0], format_value(anchor[1], f["unit"]))
                    if isinstance(ours, (int, float)) and isinstance(anchor[1], (int, float)) \
                            and not isinstance(ours, bool) and anchor[1] and f["unit"] not in RATIO_FREE_UNITS:
                        ratio = "%.2fx" % (ours / anchor[1])
                w("| %s | **%s** | %s | %s | `%s` | %s |" % (
                    cell(f["what"]), cell(format_value(ours, f["unit"])), cell(anchor_text), ratio,
                    cell(meta["command"]), cell(machine_text(meta["machine"]))))
        notes = [(name, meta["notes"]) for name, meta, _ in sorted(by_group[g], key=lambda r: r[0]) if meta.get("notes")]
        if notes:
            w("")
            for name, note in notes:
                w("- `%s`: %s" % (name, note))
        w("")
    if off:
        w("## Not on this page")
        w("")
        w("These files in `bench/` hold measurements that are not shown above, and why:")
        w("")
        for name, meta in off:
            w("- `%s`: %s" % (name, meta["off_page"]))
        w("")
    return "\n".join(out)


def anchor_id(title):
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


def main(argv):
    check = "--check" in argv[1:]
    unknown = [a for a in argv[1:] if a != "--check"]
    if unknown:
        print("usage: scripts/bench_page.py [--check]", file=sys.stderr)
        return 2
    try:
        page = render(*load())
    except PageError as e:
        print("bench_page: " + str(e), file=sys.stderr)
        return 1
    if check:
        try:
            with open(PAGE) as f:
                current = f.read()
        except OSError:
            current = None
        if current != page:
            print("bench_page: docs/benchmarks.md is out of date with bench/*.json; run python3 scripts/bench_page.py")
            return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(page)
    print("bench_page: wrote docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
