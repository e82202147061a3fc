#!/usr/bin/env bash
# Regenerates the pictures in docs/images/ from their Graphviz sources:
# docs/images/NAME.dot -> docs/images/NAME.svg. Needs Graphviz
# (apt-get install -y graphviz). Commit the .svg beside its .dot.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v dot >/dev/null || { echo "gen-diagrams: needs Graphviz's dot (apt-get install -y graphviz)" >&2; exit 1; }
for src in docs/images/*.dot; do
  dot -Tsvg "$src" -o "${src%.dot}.svg"
  echo "gen-diagrams: ${src%.dot}.svg"
done
