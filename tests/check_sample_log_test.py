#!/usr/bin/python3.11
"""bench/check_sample_log.py on logs written here: a clean history (a loss
with a lost line, a join, a resume that redoes steps) passes; each kind of
doctored log (a doubled line, a missing index, a sample trained twice, a
slice from the wrong step, a missing step, a line missing mid-generation)
fails, naming what is wrong. Usage: check_sample_log_test.py SOURCE_DIR"""

import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

SOURCE = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
CHECKER = os.path.join(SOURCE, "bench", "check_sample_log.py")
sys.path.insert(0, os.path.join(SOURCE, "bench"))
import check_sample_log as csl  # noqa: E402

N, B = 50, 8  # 50 samples, 8 a step: epoch 0 ends inside step 6
STEPS = 13


def order(seed=7):
    """A stand-in for data_order: one permutation per epoch."""
    out = []
    for e in range((STEPS * B) // N + 1):
        p = list(range(N))
        random.Random(seed * 1000 + e).shuffle(p)
        out += p
    return {t: out[t * B:(t + 1) * B] for t in range(STEPS)}


def line(step, gen, rank, world, idx):
    return f"{step}\t{gen}\t{rank}\t{world}\t{','.join(map(str, idx))}\n"


def history(batches):
    """Files (name -> text) of a job: generation 1 at world 2 for steps 0-4,
    rank 1 killed after step 4's allreduce completed on rank 0 (its line
    lost); generation 2 at world 1 for 5-6; generation 3 (a join) at world
    3 for 7-9; everything killed after a checkpoint at step 8; the resumed
    run, generation 4 at world 2, redoes 8-9 and finishes 10-12."""
    files = {"samples-a-r0-1.tsv": "", "samples-b-r0-2.tsv": "", "samples-c-r0-3.tsv": "",
             "samples-a-r0-4.tsv": "", "samples-d-r0-5.tsv": ""}

    def put(name, t, gen, r, w):
        lo, hi = csl.split_range(B, r, w)
        files[name] += line(t, gen, r, w, batches[t][lo:hi])

    for t in range(5):
        put("samples-a-r0-1.tsv", t, 1, 0, 2)
        if t < 4:
            put("samples-b-r0-2.tsv", t, 1, 1, 2)
    for t in (5, 6):
        put("samples-a-r0-1.tsv", t, 2, 0, 1)
    for t in (7, 8, 9):
        put("samples-a-r0-1.tsv", t, 3, 0, 3)
        put("samples-c-r0-3.tsv", t, 3, 1, 3)
        put("samples-b-r0-2.tsv", t, 3, 2, 3)
    files["samples-b-r0-2.tsv"] += "10\t3\t2\t3\t4,5"  # torn: killed in its write
    for t in range(8, STEPS):
        put("samples-a-r0-4.tsv", t, 4, 0, 2)
        put("samples-d-r0-5.tsv", t, 4, 1, 2)
    return files


class CheckerCase(unittest.TestCase):
    """A history (`make_history`) written to files, and the checker run on them."""
    make_history = staticmethod(history)
    diloco = False

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.batches = order()
        self.files = self.make_history(self.batches)
        self.expected = os.path.join(self.tmp.name, "expected.tsv")
        with open(self.expected, "w") as f:
            for t in range(STEPS):
                f.write(f"{t}\t{','.join(map(str, self.batches[t]))}\n")

    def tearDown(self):
        self.tmp.cleanup()

    def run_checker(self, files, expected=True, diloco=None):
        d = tempfile.mkdtemp(dir=self.tmp.name)
        for name, text in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        args = [sys.executable, CHECKER, d, "--samples", str(N), "--batch", str(B), "--steps", str(STEPS)]
        if expected:
            args += ["--expected", self.expected]
        if self.diloco if diloco is None else diloco:
            args.append("--diloco")
        p = subprocess.run(args, capture_output=True, text=True)
        self.assertIn(p.returncode, (0, 1), p.stderr)
        return p.returncode, json.loads(p.stdout)


class CheckSampleLog(CheckerCase):
    def doctored(self, name, edit):
        files = dict(self.files)
        files[name] = edit(files[name])
        return files

    def test_a_clean_history_passes(self):
        for expected in (True, False):
            code, s = self.run_checker(self.files, expected)
            self.assertEqual(code, 0, s)
            self.assertTrue(s["ok"])
            self.assertEqual(s["steps_redone"], 2)  # 8 and 9
            self.assertEqual(s["rank_lines_inferred"], 1)  # step 4, rank 1
            self.assertEqual(s["torn_lines"], 1)
            self.assertEqual(s["generations"], [1, 2, 3, 4])
            self.assertEqual(s["epoch0_indices_seen_once"] + s["epoch0_positions_inferred"], N)
            self.assertEqual(s["epoch0_indices_seen_more"], 0)
        code, s = self.run_checker(self.files, True)
        self.assertEqual(s["epoch0_indices_seen_once"], N)

    def test_a_doubled_line_fails(self):
        files = self.doctored("samples-a-r0-4.tsv", lambda text: text + text.splitlines(True)[2])
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertEqual(s["doubled_lines"], 1)
        self.assertTrue(any("2 lines" in e for e in s["errors"]), s["errors"])

    def test_a_missing_index_fails(self):
        def drop_one(text):
            lines = text.splitlines(True)
            step, gen, rank, world, idx = lines[1].rstrip("\n").split("\t")
            lines[1] = "\t".join([step, gen, rank, world, idx.rsplit(",", 1)[0]]) + "\n"
            return "".join(lines)
        for expected in (True, False):
            code, s = self.run_checker(self.doctored("samples-a-r0-1.tsv", drop_one), expected)
            self.assertEqual(code, 1)
            self.assertEqual(s["wrong_slices"], 1, s["errors"])
            self.assertTrue(any("never trained" in e for e in s["errors"]), s["errors"])

    def test_a_sample_trained_twice_fails(self):
        # Rank 0's slice of step 2 replaced by step 1's: its samples twice in
        # the epoch, step 2's never (without --expected too).
        def reuse(text):
            lines = text.splitlines(True)
            lines[2] = lines[1].replace("1\t", "2\t", 1)
            return "".join(lines)
        for expected in (True, False):
            code, s = self.run_checker(self.doctored("samples-a-r0-1.tsv", reuse), expected)
            self.assertEqual(code, 1)
            self.assertGreater(s["epoch0_indices_seen_more"], 0)
            self.assertTrue(any("more than once" in e for e in s["errors"]), s["errors"])

    def test_a_batch_other_than_data_orders_fails(self):
        # A consistent, exactly-once history, but not data_order's: step 0
        # and 1 swapped. Only --expected can tell.
        b = dict(self.batches)
        b[0], b[1] = b[1], b[0]
        files = history(b)
        code, s = self.run_checker(files, expected=False)
        self.assertEqual(code, 0, s["errors"])
        code, s = self.run_checker(files, expected=True)
        self.assertEqual(code, 1)
        self.assertGreater(s["wrong_slices"], 0)

    def test_a_missing_step_fails(self):
        files = {k: "".join(l for l in v.splitlines(True) if not l.startswith("12\t")) for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertEqual(s["steps_missing"], 1)

    def test_a_line_missing_mid_generation_fails(self):
        # Rank 1 of generation 1 skipped step 2 but went on: not a loss.
        files = self.doctored("samples-b-r0-2.tsv", lambda text: "".join(l for l in text.splitlines(True) if not l.startswith("2\t1\t")))
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertTrue(any("step 2 generation 1: rank 1 of 2 recorded nothing" in e for e in s["errors"]), s["errors"])

    def test_a_redo_with_another_batch_fails(self):
        # Generation 3's step 8 (redone by 4) trained something else.
        def change(text):
            return "".join(l.replace("\t", "\t", 1) if not l.startswith("8\t3\t") else line(8, 3, 0, 3, self.batches[9][:3])
                           for l in text.splitlines(True))
        code, s = self.run_checker(self.doctored("samples-a-r0-1.tsv", change))
        self.assertEqual(code, 1)
        self.assertEqual(s["redone_batches_differ"], 1, s["errors"])


def synced(step, gen, rank, world):
    return f"{step}\t{gen}\t{rank}\t{world}\tsynced\n"


def diloco_history(batches):
    """Files of a DiLoCo job (train.sync_every = 4, 13 steps): generation 1
    at world 3 (a, b, c) synchronises at 4; in the next window a trains 4-6,
    b 4, c 4-5 and is killed. Generation 2 at world 2 (a, b): b catches up on
    5 and 6 as rank 1 of 3; the slices no survivor holds (rank 2 of 3 at 4, 5,
    6) are dealt round-robin and trained again (a: 4 and 6, b: 5); then 7-12
    at world 2, synchronised at 8, 12 and 13."""
    files = {"samples-a-r0-1.tsv": "", "samples-b-r0-2.tsv": "", "samples-c-r0-3.tsv": ""}

    def put(name, t, gen, r, w):
        lo, hi = csl.split_range(B, r, w)
        files[name] += line(t, gen, r, w, batches[t][lo:hi])

    names = ["samples-a-r0-1.tsv", "samples-b-r0-2.tsv", "samples-c-r0-3.tsv"]
    for t in range(4):
        for r, name in enumerate(names):
            put(name, t, 1, r, 3)
    for r, name in enumerate(names):
        files[name] += synced(4, 1, r, 3)
    for t in (4, 5, 6):
        put(names[0], t, 1, 0, 3)
    put(names[1], 4, 1, 1, 3)
    for t in (4, 5):
        put(names[2], t, 1, 2, 3)  # lost with c
    put(names[0], 4, 2, 2, 3)  # replays
    put(names[0], 6, 2, 2, 3)
    put(names[1], 5, 2, 2, 3)
    for t in (5, 6):
        put(names[1], t, 2, 1, 3)  # catching up
    for t in range(7, STEPS):
        put(names[0], t, 2, 0, 2)
        put(names[1], t, 2, 1, 2)
        if t + 1 in (8, 12, 13):
            files[names[0]] += synced(t + 1, 2, 0, 2)
            files[names[1]] += synced(t + 1, 2, 1, 2)
    return files


class CheckSampleLogDiLoCo(CheckerCase):
    make_history = staticmethod(diloco_history)
    diloco = True

    def test_a_window_with_a_lost_worker_replayed_passes(self):
        code, s = self.run_checker(self.files)
        self.assertEqual(code, 0, s["errors"])
        self.assertTrue(s["diloco"])
        self.assertEqual(s["lines_lost_with_worker"], 2)  # c's 4 and 5
        self.assertEqual(s["slices_trained_twice"], 0)
        self.assertEqual(s["synced_lines"], 3 + 2 * 3)
        self.assertEqual(s["epoch0_indices_seen_once"], N)
        self.assertEqual(s["epochs"][1]["indices_seen_once"], N)

    def test_without_the_replay_the_lost_slices_fail(self):
        # The lost worker's lines are there, but no outer step took them.
        files = {k: "".join(l for l in v.splitlines(True) if not (l.split("\t")[1] == "2" and l.split("\t")[2:4] == ["2", "3"]))
                 for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertTrue(any("slice 2 of 3 is in no outer step" in e for e in s["errors"]), s["errors"])
        self.assertTrue(any("never trained" in e for e in s["errors"]), s["errors"])

    def test_a_slice_replayed_that_an_outer_step_already_took_fails(self):
        files = dict(self.files)
        lo, hi = csl.split_range(B, 0, 3)
        files["samples-b-r0-2.tsv"] += line(4, 2, 0, 3, self.batches[4][lo:hi])
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertEqual(s["slices_trained_twice"], 1, s["errors"])

    def test_a_worker_that_never_synchronised_again_loses_its_lines(self):
        # b's lines of generation 2 without any synced line of generation 2
        # after them: gone with b (a's too: the generation never synchronised).
        files = {k: "".join(l for l in v.splitlines(True) if not (l.endswith("synced\n") and l.split("\t")[1] == "2"))
                 for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertGreater(s["lines_lost_with_worker"], 2)

    def test_without_diloco_the_synced_lines_are_malformed(self):
        code, s = self.run_checker(self.files, diloco=False)
        self.assertEqual(code, 1)
        self.assertTrue(any("malformed" in e for e in s["errors"]), s["errors"])


def streaming_history(batches):
    """Files of a streaming DiLoCo job of 2 fragments, 13 steps: fragment 0
    takes its pseudo-gradient at 2, 6, 10 (and 13), fragment 1 at 4, 8, 12
    (and 13). Generation 1 at world 3 (a, b, c): all train 0-5; then a 6-7,
    b 6, c 6-7, and c is lost. c's 4 and 5 are in fragment 0 (its exchange
    at 6 took them) but not in fragment 1; its 6 and 7 in neither.
    Generation 2 at world 2: b catches up on 7 as rank 1 of 3; the owed
    slices are dealt round-robin: a replays 4 (fragment 1 only) and 6, b 5
    (fragment 1 only) and 7; then 8-12 at world 2."""
    names = ["samples-a-r0-1.tsv", "samples-b-r0-2.tsv", "samples-c-r0-3.tsv"]
    files = {n: "" for n in names}

    def put(name, t, gen, r, w, frags=None):
        lo, hi = csl.split_range(B, r, w)
        text = line(t, gen, r, w, batches[t][lo:hi])
        if frags is not None:
            text = text[:-1] + "\tfragments " + ",".join(map(str, frags)) + "\n"
        files[name] += text

    def sync(name, b, gen, r, w, f):
        files[name] += f"{b}\t{gen}\t{r}\t{w}\tsynced {f}/2\n"

    for t in range(6):
        for r, n in enumerate(names):
            put(n, t, 1, r, 3)
            if t + 1 in (2, 6):
                sync(n, t + 1, 1, r, 3, 0)
            if t + 1 == 4:
                sync(n, 4, 1, r, 3, 1)
    for t in (6, 7):
        put(names[0], t, 1, 0, 3)
        put(names[2], t, 1, 2, 3)  # lost with c
    put(names[1], 6, 1, 1, 3)
    put(names[0], 4, 2, 2, 3, [1])  # replays
    put(names[0], 6, 2, 2, 3)
    put(names[1], 5, 2, 2, 3, [1])
    put(names[1], 7, 2, 2, 3)
    put(names[1], 7, 2, 1, 3)  # catching up
    for t in range(8, STEPS):
        for r, n in enumerate(names[:2]):
            if t == 8:
                sync(n, 8, 2, r, 2, 1)
            put(n, t, 2, r, 2)
            if t + 1 == 10:
                sync(n, 10, 2, r, 2, 0)
            if t + 1 == 12:
                sync(n, 12, 2, r, 2, 1)
            if t + 1 == 13:
                sync(n, 13, 2, r, 2, 0)
                sync(n, 13, 2, r, 2, 1)
    return files


class CheckSampleLogStreaming(CheckSampleLogDiLoCo):
    """The same checks on a streaming job: a lost worker's slice owed to the fragments that had not taken it."""
    make_history = staticmethod(streaming_history)

    def test_a_window_with_a_lost_worker_replayed_passes(self):
        code, s = self.run_checker(self.files)
        self.assertEqual(code, 0, s["errors"])
        self.assertEqual(s["fragments"], 2)
        self.assertEqual(s["lines_lost_with_worker"], 2)  # c's 6 and 7: in no fragment
        self.assertEqual(s["fragment_slices_lost_with_worker"], 6)  # and 4, 5 in fragment 1
        self.assertEqual(s["slices_trained_twice"], 0)
        self.assertEqual(s["epoch0_indices_seen_once"], N)

    def test_without_the_replay_the_lost_slices_fail(self):
        files = {k: "".join(l for l in v.splitlines(True) if "fragments 1" not in l) for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertTrue(any("slice 2 of 3 is in no outer step (fragment 1 of 2)" in e for e in s["errors"]), s["errors"])

    def test_a_slice_replayed_that_an_outer_step_already_took_fails(self):
        # The replay of c's step 4 sent to both fragments: fragment 0 had it.
        files = {k: v.replace("\tfragments 1\n", "\n", 1) if k.startswith("samples-a-") else v for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertEqual(s["slices_trained_twice"], 1, s["errors"])
        self.assertTrue(any("(fragment 0 of 2)" in e for e in s["errors"]), s["errors"])

    def test_a_worker_that_never_synchronised_again_loses_its_lines(self):
        files = {k: "".join(l for l in v.splitlines(True) if not ("synced" in l and l.split("\t")[1] == "2")) for k, v in self.files.items()}
        code, s = self.run_checker(files)
        self.assertEqual(code, 1)
        self.assertGreater(s["lines_lost_with_worker"], 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
