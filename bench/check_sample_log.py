#!/usr/bin/python3.11
"""Checks a data.sample_log directory: was every sample trained exactly once?

    check_sample_log.py DIR --samples N --batch B --steps S [--expected FILE] [--diloco]

DIR holds the samples-*.tsv files the training processes appended to, one
line per step whose update a process applied (docs/data.md, "Auditing the
order: data.sample_log"):

    step \t generation \t global rank \t world size \t i0,i1,...

For every step t < S the record that counts is the newest generation's
(after a loss, a join or a resume, a step may have been computed more than
once: the last computation is the one the model holds). Its lines, one per
rank of that generation's world, concatenate in rank order to the step's
global batch: B indices, rank r holding the r-th slice as
data_order::rank_slice cuts it. Then, over the global positions
t*B .. t*B + B - 1, each epoch (N positions) holds every index of [0, N)
exactly once.

A rank's line may be missing only where nothing could have written it: at
the last step of a generation that a newer one replaced, when its process
died (or its allreduce failed) after the step's allreduce had completed on
another rank. A completed allreduce carries every rank's gradient, so that
slice was trained: its positions count as inferred. With --expected (one
line per step, "step \t i0,i1,...": data_order::global_batch) the inferred
slices are taken from it and every line is compared with its exact slice;
without it, the indices never seen in an epoch must be exactly as many as
its inferred positions.

With --diloco (a train.sync = diloco job of one fragment), the ranks also
write "b \t generation \t rank \t world \t synced" when an outer step
lands at step b, and a line counts only once an outer step covers it: a
later "synced" line of its own file with a step above its own, or any
"synced" line of its generation with a step above its own (that exchange
took every member's pseudo-gradient). A worker's lines that nothing covers
went with it when it was lost (`lines_lost_with_worker`), and the
survivors must have trained those slices again (replay). A step's slices
may then come from several generations (a survivor catching up, a replay):
for each step, the world of its newest counting line, and one counting
line per rank of that world; two counting lines of one slice are an error
unless the newer generation recorded the whole step again (a resume).

Prints one JSON object; exit status 0 when everything holds, 1 when not, 2
on a usage or I/O error.
"""

import argparse
import json
import os
import sys
from collections import defaultdict


def split_range(total, rank, world):
    """[begin, end) of rank's part of `total` items (model/data_order.cpp)."""
    base, extra = divmod(total, world)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)


# A position whose sample no line records (a step or a slice in error: the
# error is reported where it was found).
UNRECORDED = object()


class Report:
    def __init__(self, max_errors):
        self.errors = []
        self.error_count = 0
        self.max_errors = max_errors

    def error(self, msg):
        self.error_count += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(msg)


def parse_indices(text):
    if text == "":
        return []
    return [int(x) for x in text.split(",")]


def parse_synced(text):
    """(fragment, fragments) of a "synced" field ("synced": (0, 1); "synced 2/5": (2, 5)); None if it is not one."""
    if text == "synced":
        return 0, 1
    if not text.startswith("synced "):
        return None
    f, _, n = text[len("synced "):].partition("/")
    f, n = int(f), int(n)
    if n < 1 or not 0 <= f < n:
        raise ValueError(f"fragment {f} of {n}")
    return f, n


def read_logs(directory, rep, diloco=False):
    """(records, files, lines, torn, extra): records[(step, gen, rank)] = list of (where, world, indices).

    With `diloco`, records[f][(step, gen, rank, world)] for each fragment f
    of the job's outer steps: the lines an outer step of fragment f covers;
    extra holds the counts of "synced" lines and of lines nothing covers."""
    records = defaultdict(list)
    files = lines = torn = 0
    per_file = []  # diloco: (name, [(where, step, gen, rank, world, indices or None for synced, fragments)])
    names = sorted(n for n in os.listdir(directory) if n.startswith("samples-") and n.endswith(".tsv"))
    for name in names:
        files += 1
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            data = f.read().decode("utf-8", errors="replace")
        parts = data.split("\n")
        # The text after the last newline is a line whose write the process
        # did not finish (it died in it): not a record.
        if parts[-1] != "":
            torn += 1
        entries = []
        for no, line in enumerate(parts[:-1], start=1):
            where = f"{name}:{no}"
            fields = line.split("\t")
            frags = None
            try:
                synced = None
                if diloco and len(fields) == 6 and fields[5].startswith("fragments "):
                    frags = frozenset(int(x) for x in fields[5][len("fragments "):].split(","))
                    fields = fields[:5]
                if len(fields) != 5:
                    raise ValueError(f"{len(fields)} fields, not 5")
                step, gen, rank, world = (int(x) for x in fields[:4])
                if diloco:
                    synced = parse_synced(fields[4])
                if synced is not None:
                    indices = None
                    frags = synced
                else:
                    indices = parse_indices(fields[4])
                if step < 0 or world < 1 or not 0 <= rank < world:
                    raise ValueError("step, rank or world size out of range")
            except ValueError as e:
                rep.error(f"{where}: malformed line ({e}): {line[:120]!r}")
                continue
            if indices is not None:
                lines += 1
            if diloco:
                entries.append((where, step, gen, rank, world, indices, frags))
            else:
                records[(step, gen, rank)].append((where, world, indices))
        per_file.append((name, entries))
    extra = {}
    if diloco:
        # Fragment f's newest "synced" step of each generation, and a line
        # counts for f when a synced-f line after it in its file, or of its
        # generation anywhere, is at a later step.
        gen_synced = defaultdict(lambda: -1)
        synced_world = {}  # generation -> its world size (its synced lines')
        synced_lines = 0
        fragment_counts = set()
        for _, entries in per_file:
            for where, step, gen, rank, world, indices, frags in entries:
                if indices is None:
                    synced_lines += 1
                    fragment_counts.add(frags[1])
                    gen_synced[(gen, frags[0])] = max(gen_synced[(gen, frags[0])], step)
                    synced_world.setdefault(gen, world)
        if len(fragment_counts) > 1:
            rep.error(f"synced lines name different fragment counts: {sorted(fragment_counts)}")
        n_frags = max(fragment_counts) if fragment_counts else 1
        records = [defaultdict(list) for _ in range(n_frags)]
        lost = pairs_lost = 0
        lost_at = []
        for _, entries in per_file:
            later = defaultdict(lambda: -1)  # fragment -> the largest synced step after this line in its file
            covered = []
            for where, step, gen, rank, world, indices, frags in reversed(entries):
                if indices is None:
                    later[frags[0]] = max(later[frags[0]], step)
                    continue
                mine = range(n_frags) if frags is None else sorted(frags)
                bad = [f for f in mine if not 0 <= f < n_frags]
                if bad:
                    rep.error(f"{where}: fragments {bad} of a job of {n_frags}")
                took = [f for f in mine if 0 <= f < n_frags and (later[f] > step or gen_synced[(gen, f)] > step)]
                pairs_lost += len(mine) - len(took)
                if not took:
                    lost += 1
                    if len(lost_at) < 20:
                        lost_at.append({"where": where, "step": step, "generation": gen, "rank": rank, "world_size": world})
                covered.append((took, step, gen, rank, where, world, indices))
            for took, step, gen, rank, where, world, indices in reversed(covered):
                for f in took:
                    records[f][(step, gen, rank, world)].append((where, world, indices))
        extra = {"synced_world": synced_world, "synced_lines": synced_lines, "fragments": n_frags, "lines_lost_with_worker": lost,
                 "fragment_slices_lost_with_worker": pairs_lost, "lines_lost_at": lost_at}
    return records, files, lines, torn, extra


def read_expected(path):
    out = {}
    with open(path) as f:
        for no, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line:
                continue
            step, _, idx = line.partition("\t")
            out[int(step)] = parse_indices(idx)
    return out


def check(directory, n, b, steps, expected=None, max_errors=20, diloco=False):
    rep = Report(max_errors)
    records, files, lines, torn, extra = read_logs(directory, rep, diloco)

    # Doubled lines: the same (step, generation, rank) written twice.
    # by_step: step -> gen -> rank -> (where, world, indices); with diloco,
    # by_frag[f]: step -> gen -> (rank, world) -> ... for each fragment f.
    by_step = defaultdict(lambda: defaultdict(dict))
    by_frag = []
    doubled = 0
    if diloco:
        seen_doubled = set()
        for f, recs_f in enumerate(records):
            bf = defaultdict(lambda: defaultdict(dict))
            for key, recs in recs_f.items():
                step, gen, rank, world = key
                wheres = tuple(sorted(r[0] for r in recs))
                if len(recs) > 1 and wheres not in seen_doubled:
                    seen_doubled.add(wheres)
                    doubled += len(recs) - 1
                    rep.error(f"step {step} generation {gen} rank {rank}: {len(recs)} lines ({', '.join(wheres)})")
                bf[step][gen][(rank, world)] = recs[0]
                by_step[step][gen][(rank, world)] = recs[0]
            by_frag.append(bf)
    else:
        for key, recs in records.items():
            step, gen, rank = key
            if len(recs) > 1:
                doubled += len(recs) - 1
                rep.error(f"step {step} generation {gen} rank {rank}: {len(recs)} lines ({', '.join(r[0] for r in recs)})")
            by_step[step][gen][rank] = recs[0]

    gen_last_step = {}
    gen_world = {}
    for step, gens in by_step.items():
        for gen, ranks in gens.items():
            gen_last_step[gen] = max(gen_last_step.get(gen, -1), step)
            for rank, (where, world, _) in ranks.items():
                # DiLoCo: a generation's catch-up and replayed lines keep
                # the world of the generation their step was taken in; its
                # own world is its synced lines'.
                if diloco:
                    gen_world.setdefault(gen, extra["synced_world"].get(gen, world))
                    continue
                if gen_world.setdefault(gen, world) != world:
                    rep.error(f"{where}: generation {gen} has world size {gen_world[gen]} elsewhere, {world} here")
    newest_gen = max(gen_last_step) if gen_last_step else None

    batches = {}  # step -> B entries: an index, None (inferred, unknown) or UNRECORDED
    steps_missing = []
    steps_redone = 0
    redone_differ = 0
    inferred_lines = 0
    inferred_at = []  # (step, generation, rank) of the lines inferred
    overflow = defaultdict(list)  # epoch -> indices of over-long slices
    inferred_positions = 0
    wrong_slices = 0
    twice = 0  # diloco: slices two counting lines trained

    def fill(batch, t, r, world, where, idx):
        """The slice r of `world` at step t as a line recorded it; False when it is wrong."""
        nonlocal wrong_slices
        begin, end = split_range(b, r, world)
        if len(idx) != end - begin:
            wrong_slices += 1
            rep.error(f"{where}: step {t} rank {r} of {world} trained {len(idx)} samples, its slice holds {end - begin}")
            # What it says it trained still counts in the epoch: in its
            # slice's positions, any beyond them at the slice's end.
            batch[begin:begin + min(len(idx), end - begin)] = idx[:end - begin]
            overflow[(t * b + end - 1) // n].extend(idx[end - begin:])
            return
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            rep.error(f"{where}: indices outside [0, {n}): {bad[:5]}")
        if expected is not None and t in expected and idx != expected[t][begin:end]:
            wrong_slices += 1
            rep.error(f"{where}: step {t} rank {r} of {world} trained other samples than data_order's slice")
        batch[begin:end] = idx

    def diloco_step(t, gens, frag, n_frags):
        """A DiLoCo step's batch from the lines fragment `frag`'s outer steps took, whatever generations wrote them."""
        nonlocal twice
        of = f" (fragment {frag} of {n_frags})" if n_frags > 1 else ""
        g = max(gens)
        worlds = {w for (_, w) in gens[g]}
        if len(worlds) > 1:
            rep.error(f"step {t} generation {g}: lines of world sizes {sorted(worlds)}{of}")
        world = max(worlds)
        batch = [UNRECORDED] * b
        redone = False
        for r in range(world):
            holders = sorted((gen for gen, rs in gens.items() if (r, world) in rs), reverse=True)
            if not holders:
                rep.error(f"step {t}: slice {r} of {world} is in no outer step{of} (a lost worker's, never trained again)")
                continue
            if len(holders) > 1:
                newest = holders[0]
                if all((q, world) in gens[newest] for q in range(world)):
                    redone = True
                else:
                    twice += 1
                    rep.error(f"step {t}: slice {r} of {world} trained in generations {holders[::-1]} and an outer step{of} took each "
                              f"({', '.join(gens[x][(r, world)][0] for x in holders[::-1])})")
            where, _, idx = gens[holders[0]][(r, world)]
            fill(batch, t, r, world, where, idx)
        return batch, redone or any(w != world for rs in gens.values() for (_, w) in rs)

    for t in range(steps):
        gens = by_step.get(t)
        if not gens:
            steps_missing.append(t)
            rep.error(f"step {t}: no process recorded it" + (" in an outer step" if diloco else ""))
            continue
        if diloco:
            batch = None
            redone = False
            for f, bf in enumerate(by_frag):
                gf = bf.get(t)
                if not gf:
                    rep.error(f"step {t}: no process recorded it in an outer step" + (f" of fragment {f}" if len(by_frag) > 1 else ""))
                    continue
                bt, rd = diloco_step(t, gf, f, len(by_frag))
                redone = redone or rd
                if batch is None:
                    batch = bt
                elif bt != batch and UNRECORDED not in bt and UNRECORDED not in batch:
                    rep.error(f"step {t}: fragment {f}'s outer steps took other samples than fragment 0's")
            if batch is None:
                steps_missing.append(t)
                continue
            steps_redone += 1 if redone else 0
            known = [i for i in batch if i is not None and i is not UNRECORDED]
            if len(set(known)) != len(known):
                rep.error(f"step {t}: an index appears twice in its batch")
            batches[t] = batch
            continue
        if len(gens) > 1:
            steps_redone += 1
        g = max(gens)
        ranks = gens[g]
        world = next(iter(ranks.values()))[1]
        batch = [UNRECORDED] * b
        full = {}  # the complete records of this step, by generation (for the redo comparison)
        for gen, rs in gens.items():
            w = next(iter(rs.values()))[1]
            if len(rs) == w and all(len(rs[r][2]) == split_range(b, r, w)[1] - split_range(b, r, w)[0] for r in rs):
                full[gen] = [i for r in range(w) for i in rs[r][2]]
        if len(full) > 1:
            first = next(iter(full.values()))
            if any(v != first for v in full.values()):
                redone_differ += 1
                rep.error(f"step {t}: generations {sorted(full)} trained different batches (the order must not depend on who computes it)")
        for r in range(world):
            begin, end = split_range(b, r, world)
            if r not in ranks:
                superseded = g != newest_gen and t == gen_last_step[g]
                if not superseded:
                    rep.error(f"step {t} generation {g}: rank {r} of {world} recorded nothing"
                              + ("" if g != newest_gen else " (the newest generation)")
                              + ("" if t == gen_last_step[g] else f" (generation {g} went on to step {gen_last_step[g]})"))
                    continue
                inferred_lines += 1
                inferred_at.append({"step": t, "generation": g, "rank": r, "world_size": world})
                inferred_positions += end - begin
                batch[begin:end] = expected[t][begin:end] if expected is not None and t in expected else [None] * (end - begin)
                continue
            where, w, idx = ranks[r]
            fill(batch, t, r, world, where, idx)
        known = [i for i in batch if i is not None and i is not UNRECORDED]
        if len(set(known)) != len(known):
            rep.error(f"step {t}: an index appears twice in its batch")
        batches[t] = batch
    if expected is not None:
        for t in range(steps):
            if t not in expected:
                rep.error(f"--expected has no batch for step {t}")
                break

    # Epochs: positions p = t*B + j; epoch p // N.
    epochs = {}
    total_positions = steps * b
    for e in range((total_positions + n - 1) // n):
        lo, hi = e * n, min((e + 1) * n, total_positions)
        count = defaultdict(int)
        unknown = 0
        for p in range(lo, hi):
            t, j = divmod(p, b)
            i = batches.get(t, [UNRECORDED] * b)[j]
            if i is None:
                unknown += 1
            elif i is not UNRECORDED:
                count[i] += 1
        for i in overflow.get(e, []):
            count[i] += 1
        complete = hi - lo == n
        seen_once = sum(1 for c in count.values() if c == 1)
        seen_more = sum(1 for c in count.values() if c > 1)
        seen_0 = n - len(count)
        ep = {
            "epoch": e,
            "positions": hi - lo,
            "complete": complete,
            "indices_seen_0": seen_0,
            "indices_seen_once": seen_once,
            "indices_seen_more": seen_more,
            "positions_inferred": unknown,
        }
        if seen_more:
            dup = sorted(i for i, c in count.items() if c > 1)[:5]
            rep.error(f"epoch {e}: {seen_more} indices trained more than once (e.g. {dup})")
        # Complete epochs: every index once, those never seen accounted for
        # by the positions whose lines were lost with their process.
        if complete and seen_0 != unknown:
            missing = sorted(set(range(n)) - set(count))[:5]
            rep.error(f"epoch {e}: {seen_0} indices never trained (e.g. {missing}), "
                      f"{unknown} positions inferred")
        epochs[e] = ep

    first = epochs.get(0, {})
    summary = {
        "ok": rep.error_count == 0,
        "samples_in_epoch": n,
        "global_batch": b,
        "steps": steps,
        "files": files,
        "lines": lines,
        "torn_lines": torn,
        "generations": sorted(gen_world),
        "world_sizes": {str(g): gen_world[g] for g in sorted(gen_world)},
        "steps_missing": len(steps_missing),
        "steps_redone": steps_redone,
        "redone_batches_differ": redone_differ,
        "doubled_lines": doubled,
        "wrong_slices": wrong_slices,
        "rank_lines_inferred": inferred_lines,
        "rank_lines_inferred_at": inferred_at[:max_errors],
        "exact_batches_checked": expected is not None,
        "epoch0_indices_seen_0": first.get("indices_seen_0"),
        "epoch0_indices_seen_once": first.get("indices_seen_once"),
        "epoch0_indices_seen_more": first.get("indices_seen_more"),
        "epoch0_positions_inferred": first.get("positions_inferred"),
        "epochs": [epochs[e] for e in sorted(epochs)],
        "diloco": diloco,
        **({"slices_trained_twice": twice, **{k: v for k, v in extra.items() if k != "synced_world"}} if diloco else {}),
        "error_count": rep.error_count,
        "errors": rep.errors,
    }
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the data.sample_log directory")
    ap.add_argument("--samples", type=int, required=True, help="N: samples in the training set (an epoch)")
    ap.add_argument("--batch", type=int, required=True, help="B: train.global_batch_size")
    ap.add_argument("--steps", type=int, required=True, help="S: steps 0..S-1 must all be recorded (train.max_steps of a finished job)")
    ap.add_argument("--expected", help="data_order's global batches, one line per step: step<TAB>i0,i1,...")
    ap.add_argument("--diloco", action="store_true",
                    help="a train.sync = diloco job (one fragment): only lines an outer step covers count (\"synced\" lines)")
    ap.add_argument("--max-errors", type=int, default=20)
    a = ap.parse_args(argv)
    if a.samples < 1 or a.batch < 1 or a.steps < 0:
        print("check_sample_log: --samples and --batch must be at least 1, --steps at least 0", file=sys.stderr)
        return 2
    try:
        expected = read_expected(a.expected) if a.expected else None
        summary = check(a.dir, a.samples, a.batch, a.steps, expected, a.max_errors, a.diloco)
    except (OSError, ValueError) as e:
        print(f"check_sample_log: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
