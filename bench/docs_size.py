#!/usr/bin/env python3
"""How much there is to read: README.md's size, and docs/ (the Markdown
pages, their count and bytes; docs/benchmarks.md, which scripts/bench_page.py
generates, counted apart). Writes bench/docs_size_results.json.

Usage: bench/docs_size.py [--out bench/docs_size_results.json]"""
import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "docs_size_results.json"))
    a = ap.parse_args()
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    written = [p for p in pages if os.path.basename(p) != "benchmarks.md"]
    result = {"readme_bytes": os.path.getsize(os.path.join(ROOT, "README.md")),
              "docs_pages": len(written), "docs_bytes": sum(os.path.getsize(p) for p in written),
              "generated_pages": {os.path.relpath(p, ROOT): os.path.getsize(p) for p in pages if p not in written},
              "largest_pages": sorted(({"page": os.path.relpath(p, ROOT), "bytes": os.path.getsize(p)} for p in written),
                                      key=lambda x: -x["bytes"])[:5]}
    F = bench_meta.figure
    bench_meta.write(a.out, result, "How much there is to read: README.md and the pages of docs/", "Install and documentation", [
        F("README.md", ["readme_bytes"], "bytes"),
        F("docs/: Markdown pages written by hand (docs/benchmarks.md, generated, apart)", ["docs_pages"], "count"),
        F("docs/: their size", ["docs_bytes"], "bytes"),
    ])
    print("docs_size: README %d bytes, docs %d pages, %d bytes" % (result["readme_bytes"], result["docs_pages"], result["docs_bytes"]))


if __name__ == "__main__":
    main()
