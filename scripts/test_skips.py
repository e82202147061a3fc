#!/usr/bin/env python3
"""The skipped tests of a ctest run, from its JUnit file (ctest --output-junit).

Usage: test_skips.py JUNIT_XML   (run in the build directory: the tests'
labels come from `ctest --show-only=json-v1` there)

Prints how many tests skipped and, for each, its labels and why. Under
CI=true a skip in a group this machine must run fails: exit 1. The groups
are DTACTOR_CI_GROUPS, by default "s3 slurm hosts prometheus k8s etcd" (a
gateway, Slurm, network namespaces, Prometheus, Node.js or etcd that did not
start or is missing: scripts/install-deps.sh --test installs them all).
Outside CI a skip stays a skip: exit 0.
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def labels_by_test():
    out = subprocess.run(["ctest", "--show-only=json-v1"], capture_output=True, text=True, check=True).stdout
    labels = {}
    for t in json.loads(out).get("tests", []):
        for p in t.get("properties", []):
            if p.get("name") == "LABELS":
                labels[t["name"]] = list(p.get("value", []))
    return labels


def reason(case):
    """The skip's reason: gtest's message after "Skipped", else the output's last line."""
    text = (case.findtext("system-out") or "").splitlines()
    lines = [l.strip() for l in text if l.strip()]
    for i, l in enumerate(lines):
        if l.endswith("Skipped") and i + 1 < len(lines):
            msg = [m for m in lines[i + 1:] if not m.startswith("[")]
            # The first line says what; a fixture's last line, its own error.
            return msg[0][:200] + (" ... " + msg[-1][:200] if len(msg) > 1 else "")
    skipped = case.find("skipped")
    useful = [l for l in lines if not l.startswith("[")]
    if useful:
        return useful[-1][:200]
    return skipped.get("message", "") if skipped is not None else ""


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path = sys.argv[1]
    if not os.path.exists(path):
        print(f"test_skips: no {path} (ctest did not run)", file=sys.stderr)
        return 0
    root = ET.parse(path).getroot()
    skipped = [c for c in root.iter("testcase") if c.find("skipped") is not None or c.get("status") == "notrun"]
    total = int(root.get("tests", "0"))
    labels = labels_by_test() if skipped else {}
    print(f"== {len(skipped)} of {total} tests skipped")
    for c in skipped:
        name = c.get("name")
        print(f"  {name} [{', '.join(labels.get(name, []))}]: {reason(c)}")
    if os.environ.get("CI") != "true":
        return 0
    groups = os.environ.get("DTACTOR_CI_GROUPS", "s3 slurm hosts prometheus k8s etcd").split()
    bad = [c for c in skipped if set(labels.get(c.get("name"), [])) & set(groups)]
    if not bad:
        return 0
    for c in bad:
        # ctest --output-on-failure prints nothing of a skipped test: its own words here.
        out = (c.findtext("system-out") or "").rstrip().splitlines()
        print(f"---- {c.get('name')} (the end of its output)")
        print("\n".join(out[-30:]))
    names = ", ".join(c.get("name") for c in bad)
    print(f"CI=true: {len(bad)} tests of the groups this machine must run ({', '.join(groups)}) skipped: {names}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
