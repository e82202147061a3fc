#!/usr/bin/python3
"""Checks that no `#include` of the product code points to a higher room.

Each top-level folder of the product is a room and one CMake target
(ARCHITECTURE.md, "Folders"); a room includes only rooms below it, and a
torch-free target includes nothing of a target that links LibTorch. Read
from every .hpp/.cpp/.h of the rooms (tests/, bench/, fuzz/ and examples/
are not product code and may include anything). The public headers
(include/dtactor/*.hpp) are the C++ API: any room may include them (their
implementations are spread over the rooms: config.hpp in base/, shards.hpp
in job/, task.hpp in model/, main.hpp in app/), and they include only each
other, so they add no edge between rooms.

Prints one line per violation (file:line: includes X, a higher room) and
exits 1 if there is any. Usage: scripts/check_layers.py [REPO_ROOT]
(--self-test: the check against a small tree of known violations).
"""
import os
import re
import sys

# The order, lowest first; rooms of one level are siblings and include
# neither each other. It is the CMake graph (each folder's
# target_link_libraries) read as layers:
#   base: config, processes, hashing, the job key; every room stands on it.
#   net (ZeroMQ, wire, rendezvous store) and storage (object stores, the
#     checkpoint store and its planners) stand on base only.
#   data (shards and their cache) reads through storage.
#   job: the job's reading of its config, and the journal's schema, which
#     the coordinator's actors, the ranks and monitoring all speak.
#   comm: communicators and exchanges (LibTorch, Gloo), over net.
#   actors (CAF, torch-free), monitoring (Prometheus, the journal, the
#     report; torch-free) and model (LibTorch) each stand on the runtime
#     and on none of the others.
#   rank: the training thread; it implements the rank actor's `rank_work`
#     (actors/rank_work.hpp) over model/ and comm/.
#   app: entry points, wiring only.
LEVELS = {
    "base": 0,
    "net": 1,
    "storage": 1,
    "data": 2,
    "job": 3,
    "comm": 4,
    "actors": 5,
    "monitoring": 5,
    "model": 5,
    "rank": 6,
    "app": 7,
}
# Rooms whose targets link LibTorch: torch-free code (every other room, and
# app's dtactor_cli, which the `dtactor` binary is) includes nothing of them.
TORCH_ROOMS = {"comm", "model", "rank"}
# Includes the check lets pass although the order forbids them, each with
# why. Keep it empty; an entry is (including file, included file).
ALLOWED = set()

PUBLIC = "dtactor"  # include/dtactor/: the C++ API
SOURCE = re.compile(r"\.(hpp|cpp|h)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([A-Za-z0-9_]+)/([^">]+)[">]')


def sources(root, folder):
    """The C++ files under root/folder, as paths relative to root."""
    out = []
    for base, dirs, files in os.walk(os.path.join(root, folder)):
        dirs.sort()
        for name in sorted(files):
            if SOURCE.search(name):
                out.append(os.path.relpath(os.path.join(base, name), root))
    return out


def includes(root, path):
    """(line number, room, rest) of each project-style include in a file."""
    out = []
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                out.append((n, m.group(1), m.group(1) + "/" + m.group(2)))
    return out


def torch_free_app_files(root):
    """app/'s files in the torch-free dtactor_cli: the sources its
    add_library lists, and the app/ headers they include (transitively)."""
    text = open(os.path.join(root, "app", "CMakeLists.txt"), encoding="utf-8").read()
    m = re.search(r"add_library\(\s*dtactor_cli\s+STATIC\s+([^)]*)\)", text)
    if not m:
        raise SystemExit("app/CMakeLists.txt: no add_library(dtactor_cli STATIC ...) to read")
    todo = ["app/" + name for name in m.group(1).split()]
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen or not os.path.exists(os.path.join(root, path)):
            continue
        seen.add(path)
        todo += [target for _, room, target in includes(root, path) if room == "app"]
    return seen


def torch_public_headers(root):
    """The public headers that include LibTorch, directly or through another."""
    headers = sources(root, os.path.join("include", PUBLIC))
    torch = set()
    changed = True
    while changed:
        changed = False
        for path in headers:
            target = path[len("include/"):]
            text = open(os.path.join(root, path), encoding="utf-8").read()
            if target not in torch and ("<torch/" in text or any(t for _, _, t in includes(root, path) if t in torch)):
                torch.add(target)
                changed = True
    return torch


def violation(path, room, target_room, torch_free):
    """Why `path` (in `room`) may not include a file of `target_room`, or None."""
    if target_room == room or target_room not in LEVELS:
        return None
    if LEVELS[target_room] >= LEVELS[room]:
        return "a higher room" if LEVELS[target_room] > LEVELS[room] else "a sibling room"
    if torch_free and target_room in TORCH_ROOMS:
        return "a room that links LibTorch, from torch-free code"
    return None


def check(root):
    """One line per violation under root."""
    problems = []
    for path in sources(root, os.path.join("include", PUBLIC)):
        for n, room, target in includes(root, path):
            if room in LEVELS:
                problems.append(f"{path}:{n}: includes {target}: the public headers include only each other")
    cli = torch_free_app_files(root)
    torch_api = torch_public_headers(root)
    for room in sorted(LEVELS):
        for path in sources(root, room):
            torch_free = room not in TORCH_ROOMS and (room != "app" or path in cli)
            for n, target_room, target in includes(root, path):
                why = violation(path, room, target_room, torch_free)
                if torch_free and target in torch_api:
                    why = "a public header that includes LibTorch, from torch-free code"
                if why and (path, target) not in ALLOWED:
                    problems.append(f"{path}:{n}: includes {target}, {why}")
    return problems


def self_test():
    """The check on a small tree with one include of each kind it refuses
    (and some it allows): it must name exactly those."""
    import tempfile

    tree = {
        "app/CMakeLists.txt": "add_library(dtactor_cli STATIC cli.cpp)\nadd_library(dtactor_app STATIC run.cpp)\n",
        "app/cli.cpp": '#include "app/cli.hpp"\n#include "monitoring/m.hpp"\n',
        "app/cli.hpp": '#include "rank/r.hpp"\n',  # torch-free through a header of dtactor_cli
        "app/run.cpp": '#include "rank/r.hpp"\n#include "dtactor/task.hpp"\n',
        "base/b.hpp": '#include "job/j.hpp"\n#include "dtactor/result.hpp"\n',  # higher
        "job/j.hpp": '#include "base/b.hpp"\n#include <vector>\n',
        "actors/a.cpp": '#  include "monitoring/m.hpp"\n#include "job/j.hpp"\n',  # sibling
        "monitoring/m.hpp": '#include "comm/c.hpp"\n',  # torch room from torch-free code
        "monitoring/n.cpp": '#include "dtactor/dtactor.hpp"\n',  # torch through the public API
        "comm/c.hpp": '#include "net/w.hpp"\n',
        "rank/r.hpp": '#include "actors/a.hpp"\n#include "model/t.hpp"\n',
        "include/dtactor/task.hpp": "#include <torch/torch.h>\n",
        "include/dtactor/dtactor.hpp": '#include "dtactor/task.hpp"\n',
        "include/dtactor/result.hpp": '#include "base/b.hpp"\n',  # the API includes a room
        "tests/t.cpp": '#include "app/cli.hpp"\n',
    }
    want = {"app/cli.hpp:1", "base/b.hpp:1", "actors/a.cpp:1", "monitoring/m.hpp:1", "monitoring/n.cpp:1",
            "include/dtactor/result.hpp:1"}
    with tempfile.TemporaryDirectory() as root:
        for path, text in tree.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)
        got = {p.split(": ")[0] for p in check(root)}
    if got != want:
        print(f"self-test: refused {sorted(got)}, expected {sorted(want)}")
        return 1
    print("self-test: ok")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} include(s) against the layers (scripts/check_layers.py, docs/architecture.md)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
