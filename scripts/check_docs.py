#!/usr/bin/python3
"""Checks what README.md and docs/**/*.md name against the source tree.

  (a) `dtactor` command lines in code spans and code blocks: the command
      (train, local, data index, ...) and every --flag against the CLI11
      definitions in app/cli.cpp; on a line that names dtactor, a code span
      that is a lone --flag against every flag dtactor has;
  (b) config keys (`train.max_steps`, `--set key=value`, keys under a
      [section] of a TOML block) against the schema in base/config.cpp (and
      the keys examples/custom_task registers);
  (c) relative links, and repository paths in code spans (`rank/state_io.cpp`),
      against the file system; anchors of links to Markdown pages against
      their headings.

Prints one line per problem (file:line: what) and exits 1 if there is any.
Usage: scripts/check_docs.py [REPO_ROOT] [FILE.md ...]
"""
import glob
import os
import subprocess
import re
import sys

# Flags that lines naming dtactor mention but that belong to other tools
# (torchrun, srun/sbatch, kubectl, podman, cmake, ctest, the bench scripts).
FOREIGN_FLAGS = {
    "--nnodes", "--nproc_per_node", "--node_rank", "--rdzv_endpoint", "--rdzv-endpoint", "--rdzv_backend",
    "--max_restarts", "--master_addr", "--master_port", "--standalone",
    "--signal", "--requeue", "--array", "--ntasks-per-node", "--nodes=N", "--kill-on-bad-exit", "--overlap",
    "--entrypoint", "--rm", "--target", "--build", "--output-on-failure", "--test-dir",
    "--from-file", "--dry-run", "--runs", "--check", "--test",
}
# Words after `dtactor` that are not a command: a placeholder or prose in a
# code span.
NOT_COMMANDS = {"mode", "command", "binary", "binaries", "process", "processes", "job", "jobs", "dtactor-train"}
# Paths in code spans that stand for the user's files, not the repository's.
EXAMPLE_PATHS = re.compile(r"(data|shards)/(train|eval|val)[-_]")

SHELL_STOPS = {"|", "||", "&&", ";", "&", "\\|"}
FILE_EXTENSIONS = {
    "bin", "npy", "npz", "tar", "pt", "pth", "toml", "json", "jsonl", "md", "hpp", "cpp", "h", "py", "txt",
    "yaml", "yml", "svg", "png", "jpg", "gz", "csv", "sh", "tsv", "idx", "log", "key", "proto", "cls", "dz",
    "index", "manifest", "zip", "ts", "js", "html", "sbatch",
}


class Cli:
    """Subcommands and flags as app/cli.cpp declares them (CLI11)."""

    def __init__(self, text):
        self.var_to_cmd = {"app": ""}  # C++ variable -> command path ("" = the top level)
        self.flags = {}  # command path -> set of flags
        self.shown = {}  # command path -> flags `--help` shows (not in the hidden group(""))
        self.commands = set()
        for m in re.finditer(r'(?:auto\*\s+)?(\w+)\s*=\s*(\w+)(?:->|\.)add_subcommand\(\s*"([\w-]+)"', text):
            var, parent, name = m.groups()
            base = self.var_to_cmd.get(parent, "")
            path = (base + " " + name).strip()
            self.var_to_cmd[var] = path
            self.commands.add(path)
        # The role options are declared on a CLI::App& parameter (app).
        for m in re.finditer(r'\b(\w+)(?:->|\.)add_(?:option|flag)\(\s*"([^"]+)"', text):
            var, names = m.groups()
            if var not in self.var_to_cmd:
                continue
            self._add(self.var_to_cmd[var], names)
            statement = text[m.end():text.find(";", m.end())]
            if '->group("")' not in statement:
                self._add(self.var_to_cmd[var], names, self.shown)
        for m in re.finditer(r'for\s*\(\s*auto\*\s*(\w+)\s*:\s*\{([^}]*)\}\s*\)\s*\1->add_(?:option|flag)\(\s*"([^"]+)"', text):
            _, subs, names = m.groups()
            for var in re.findall(r"\w+", subs):
                if var in self.var_to_cmd:
                    self._add(self.var_to_cmd[var], names)
                    self._add(self.var_to_cmd[var], names, self.shown)
        for path in list(self.flags) + [""] + list(self.commands):
            self.flags.setdefault(path, set()).update({"--help", "-h"})
        self.all_flags = set().union(*self.flags.values())

    def _add(self, path, names, into=None):
        for n in names.split(","):
            n = n.strip()
            if n.startswith("-"):
                (self.flags if into is None else into).setdefault(path, set()).add(n)


def load_keys(root):
    keys = set()
    with open(os.path.join(root, "base/config.cpp"), encoding="utf-8") as f:
        keys.update(re.findall(r'\{\s*"((?:[a-z]+)\.[a-z0-9_]+)"\s*,\s*vk::', f.read()))
    # Keys a task registers (examples/custom_task): the docs show them.
    for path in glob.glob(os.path.join(root, "examples/**/*.cpp"), recursive=True):
        with open(path, encoding="utf-8") as f:
            keys.update(re.findall(r'\{\s*"((?:model|data)\.[a-z0-9_]+)"\s*,\s*vk::', f.read()))
    return keys


def slug(heading):
    """GitHub's anchor of a heading."""
    h = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors_of(path, cache={}):
    if path not in cache:
        found, seen, fenced = set(), {}, False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                    continue
                m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    s = slug(m.group(1))
                    n = seen.get(s, 0)
                    seen[s] = n + 1
                    found.add(s if n == 0 else "%s-%d" % (s, n))
                for a in re.findall(r'<a\s+(?:name|id)="([^"]+)"', line):
                    found.add(a)
        cache[path] = found
    return cache[path]


class Checker:
    def __init__(self, root):
        self.root = root
        with open(os.path.join(root, "app/cli.cpp"), encoding="utf-8") as f:
            self.cli = Cli(f.read())
        self.keys = load_keys(root)
        self.sections = {k.split(".")[0] for k in self.keys}
        # The repository's own folders: those git tracks (a run directory such
        # as runs/ or a build folder beside them is not the repository's).
        tracked = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True)
        if tracked.returncode == 0 and tracked.stdout:
            self.top_dirs = {f.split("/")[0] for f in tracked.stdout.splitlines() if "/" in f and not f.startswith(".")}
        else:
            self.top_dirs = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")}
            self.top_dirs -= {"build", "runs"}
        self.problems = []

    def problem(self, where, what):
        line = "%s:%d: %s" % (where[0], where[1], what)
        if line not in self.problems:
            self.problems.append(line)

    # (b) config keys
    def check_key(self, where, key):
        if key not in self.keys:
            self.problem(where, "unknown config key '%s' (base/config.cpp's schema)" % key)

    def scan_keys(self, where, code):
        pattern = r"(?<![\w/.$-])(%s)\.([a-z_][a-z0-9_]*)(?![\w/-]|\.\w)" % "|".join(sorted(self.sections))
        for m in re.finditer(pattern, code):
            if m.group(2) in FILE_EXTENSIONS:
                continue
            self.check_key(where, m.group(1) + "." + m.group(2))

    # (a) command lines
    def scan_commands(self, where, code):
        for m in re.finditer(r"(?:^|(?<=[\s`($=\"']))(?:[\w./-]*/)?dtactor(?:-train)?(?=\s|$)", code):
            before = code[:m.start()].split()
            if before and before[-1].startswith("-"):
                continue  # the value of another program's option (--baseline-bin PRE/build/dtactor)
            tokens = code[m.end():].split()
            cmd_tokens = []
            for t in tokens:
                if t in SHELL_STOPS or t.startswith(("#", ">", "<", "2>", "$(", "`")) or t == "\\":
                    break
                cmd_tokens.append(t)
                if t.endswith((";", ")")):
                    break
            self.check_command(where, cmd_tokens)

    def check_command(self, where, tokens):
        if not tokens:
            return
        path = ""
        first = tokens[0].strip("`'\";,.)")
        rest = tokens
        if not first.startswith("-"):
            if not re.fullmatch(r"[a-z][a-z-]*", first) or first in NOT_COMMANDS:
                return  # a placeholder (MODE, ...), not a command
            if first not in self.cli.commands:
                self.problem(where, "unknown dtactor command '%s' (app/cli.cpp)" % first)
                return
            path, rest = first, tokens[1:]
            if rest:
                sub = rest[0].strip("`'\";,.)")
                if path + " " + sub in self.cli.commands:
                    path, rest = path + " " + sub, rest[1:]
                elif any(c.startswith(path + " ") for c in self.cli.commands) and re.fullmatch(r"[a-z][a-z-]*", sub):
                    self.problem(where, "unknown dtactor command '%s %s' (app/cli.cpp)" % (path, sub))
                    return
        allowed = self.cli.flags.get(path, set())
        expect_key = False
        for t in rest:
            t = t.strip("`'\",;)[]")
            if expect_key:
                expect_key = False
                m = re.match(r"([a-z]+\.[a-z0-9_]+)=", t)
                if m:
                    self.check_key(where, m.group(1))
                continue
            if not t.startswith("-") or t in ("-", "--") or re.fullmatch(r"-\d.*", t):
                continue
            flag = t.split("=", 1)[0]
            if flag.endswith("..."):
                continue
            if flag not in allowed:
                where_defined = sorted(p or "--role" for p, fl in self.cli.flags.items() if flag in fl)
                hint = " (it belongs to: %s)" % ", ".join(where_defined) if where_defined else ""
                self.problem(where, "'dtactor %s' has no flag %s%s" % (path or "--role ...", flag, hint))
            if flag == "--set":
                if "=" in t:
                    m = re.match(r"--set=([a-z]+\.[a-z0-9_]+)=", t)
                    if m:
                        self.check_key(where, m.group(1))
                else:
                    expect_key = True

    def check_lone_flags(self, where, spans):
        for s in spans:
            s = s.strip()
            m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S*)?", s)
            if m and m.group(1) not in self.cli.all_flags and m.group(1) not in FOREIGN_FLAGS:
                self.problem(where, "dtactor has no flag %s (app/cli.cpp)" % m.group(1))

    # (c) links and paths
    def check_link(self, where, md_path, target):
        target = target.strip().split()[0] if target.strip() else target
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            return
        file_part, _, anchor = target.partition("#")
        dest = md_path if not file_part else os.path.normpath(os.path.join(os.path.dirname(md_path), file_part))
        if file_part and not os.path.exists(dest):
            self.problem(where, "link to a missing file: %s" % target)
            return
        if anchor and dest.endswith(".md") and os.path.isfile(dest) and anchor not in anchors_of(dest):
            self.problem(where, "link to a missing heading: %s" % target)

    def check_path_span(self, where, span):
        s = span.strip()
        if not re.fullmatch(r"[\w.{},*-]+(?:/[\w.{},*-]+)+/?", s):
            return
        if s.split("/")[0] not in self.top_dirs or EXAMPLE_PATHS.match(s):
            return
        for p in expand_braces(s):
            if not self.path_exists(p.rstrip("/")):
                self.problem(where, "no such file in the repository: %s" % s)
                return

    def path_exists(self, p):
        """p names a file or folder of the repository: from its root, or the
        tail of a longer path (`base/nodes.yaml` in deploy/kubernetes/), or
        without its extension (`rank/rank_worker` for the .hpp/.cpp pair)."""
        if not hasattr(self, "_all_paths"):
            self._all_paths = set()
            for d, dirs, files in os.walk(self.root):
                dirs[:] = [x for x in dirs if not x.startswith(".") and not (d == self.root and x == "build") and x != "node_modules"]
                r = os.path.relpath(d, self.root)
                for name in dirs + files:
                    self._all_paths.add(os.path.normpath(os.path.join(r, name)))
        pat = re.compile("(?:.*/)?" + re.escape(p).replace(r"\*", "[^/]*") + r"(?:\.[\w.]+)?")
        return any(pat.fullmatch(q) for q in self._all_paths)

    def check_file(self, md_path):
        rel = os.path.relpath(md_path, self.root)
        with open(md_path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        fence, lang, section, cont = None, "", None, False
        block_cmd = ""  # a command line continued with a backslash
        for no, line in enumerate(lines, 1):
            where = (rel, no)
            stripped = line.strip()
            m = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if fence is None and m:
                fence, lang, section = m.group(1), m.group(2).lower(), None
                continue
            if fence is not None:
                if stripped.startswith(fence):
                    if block_cmd:
                        self.scan_commands(where, block_cmd)
                    fence, block_cmd = None, ""
                    continue
                self.scan_block_line(where, line, lang)
                continue
            spans = re.findall(r"(`+)(.+?)\1", line)
            spans = [s[1] for s in spans]
            for s in spans:
                self.scan_commands(where, s)
                self.scan_keys(where, s)
                self.check_path_span(where, s)
            if re.search(r"(?<![\w/.-])dtactor(?![\w/:.-])", line) or "dtactor " in line:
                self.check_lone_flags(where, spans)
            prose = re.sub(r"(`+).+?\1", "", line)
            for lm in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
                self.check_link(where, md_path, lm.group(1))
            for lm in re.finditer(r"^\s*\[[^\]]+\]:\s*(\S+)", prose):
                self.check_link(where, md_path, lm.group(1))

    def check_usage_lists_the_cli(self, files):
        """docs/usage.md, the commands' home, names every command and every
        flag `--help` shows in its "Commands" section."""
        home = os.path.join(self.root, "docs/usage.md")
        if home not in files:
            return
        with open(home, encoding="utf-8") as f:
            lines = f.read().split("\n")
        start = next((i for i, l in enumerate(lines) if re.match(r"#+\s+Commands\s*$", l)), None)
        if start is None:
            self.problem(("docs/usage.md", 1), "no section 'Commands' listing dtactor's commands and flags")
            return
        end = next((i for i in range(start + 1, len(lines)) if re.match(r"##?\s", lines[i])), len(lines))
        section = "\n".join(lines[start:end])
        for cmd in sorted(self.cli.commands):
            if not re.search(r"dtactor %s\b" % re.escape(cmd), section):
                self.problem(("docs/usage.md", start + 1), "the command 'dtactor %s' (app/cli.cpp) is not listed" % cmd)
        for path, flags in sorted(self.cli.shown.items()):
            # The rows of that command: `dtactor local ...`, or `dtactor --role ...`.
            lead = r"dtactor %s(?![\w-])" % re.escape(path) if path else r"dtactor --role\b"
            rows = "\n".join(l for l in lines[start:end] if re.search(lead, l))
            for flag in sorted(flags):
                if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(flag), rows):
                    self.problem(("docs/usage.md", start + 1), "the flag %s of 'dtactor %s' (app/cli.cpp) is not listed"
                                 % (flag, path or "--role ..."))

    def check_journal_table(self, files):
        """docs/usage.md, the journal's home, lists every event the journal's
        schema (job/journal_events.hpp) declares, and no other."""
        home = os.path.join(self.root, "docs/usage.md")
        if home not in files:
            return
        with open(os.path.join(self.root, "job/journal_events.hpp"), encoding="utf-8") as f:
            events = set(re.findall(r'std::string_view\s+\w*name\s*=\s*"(\w+)"', f.read()))
        with open(home, encoding="utf-8") as f:
            lines = f.read().split("\n")
        start = next((i for i, l in enumerate(lines) if re.match(r"#+\s+The journal\s*$", l)), None)
        if start is None:
            self.problem(("docs/usage.md", 1), "no section 'The journal' listing the journal's events")
            return
        listed = set()
        for l in lines[start + 1:]:
            if l.startswith("#"):
                break
            m = re.match(r"\|\s*((?:`\w+`(?:,\s*)?)+)\s*\|", l)
            if m:
                listed.update(re.findall(r"`(\w+)`", m.group(1)))
        for e in sorted(events - listed):
            self.problem(("docs/usage.md", start + 1), "the journal event %s (job/journal_events.hpp) is not in the table" % e)
        for e in sorted(listed - events):
            self.problem(("docs/usage.md", start + 1), "the table lists %s, which job/journal_events.hpp does not declare" % e)

    def scan_block_line(self, where, line, lang):
        if not hasattr(self, "_cont"):
            self._cont = ""
        code = line.rstrip()
        if lang in ("toml", ""):
            sm = re.match(r"\s*\[([a-z_]+)\]\s*(#.*)?$", code)
            if sm:
                self._section = sm.group(1)
                return
            km = re.match(r"\s*([a-z_][a-z0-9_]*)\s*=", code)
            if lang == "toml" and km and getattr(self, "_section", None) in self.sections:
                self.check_key(where, self._section + "." + km.group(1))
        text = self._cont + " " + code if self._cont else code
        if text.endswith("\\"):
            self._cont = text[:-1]
            return
        self._cont = ""
        self.scan_commands(where, text)
        if lang not in ("json", "yaml", "yml", "text"):
            self.scan_keys(where, re.sub(r"#.*", "", text) if lang in ("sh", "bash", "console", "") else text)
        else:
            self.scan_keys(where, text)


def expand_braces(s):
    m = re.search(r"\{([^{}]*)\}", s)
    if not m or "," not in m.group(1):
        return [s.replace("{", "").replace("}", "")] if m else [s]
    out = []
    for alt in m.group(1).split(","):
        out.extend(expand_braces(s[: m.start()] + alt + s[m.end():]))
    return out


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = [os.path.abspath(p) for p in argv[2:]]
    if not files:
        files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs/**/*.md"), recursive=True))
    checker = Checker(root)
    if not checker.cli.commands or not checker.keys:
        print("check_docs: found no commands in app/cli.cpp or no keys in base/config.cpp: the parser needs updating")
        return 1
    for path in files:
        checker._section, checker._cont = None, ""
        checker.check_file(path)
    checker.check_journal_table(files)
    checker.check_usage_lists_the_cli(files)
    for p in checker.problems:
        print(p)
    if checker.problems:
        print("check_docs: %d problem(s) in %d file(s)" % (len(checker.problems), len(files)))
        return 1
    print("check_docs: %d file(s), no problems (%d commands, %d flags, %d config keys known)"
          % (len(files), len(checker.cli.commands), len(checker.cli.all_flags), len(checker.keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
