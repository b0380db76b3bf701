"""Planner at scale, in one process: simulated ranks x 1000 tensors, the coordinator's whole job.

    python benchmarks/bench_planner.py [--quick] [--ranks 64 1024 4096] [--large-ranks 16384 65536]
                                       [--lean-above 16384] [--tensors 1000] [--layouts fsdp hsdp replicated]

(~4 minutes; ~4.5 GB of memory at 16384 ranks, most of it the simulated per-chunk checksums of the
general path; rows above --lean-above ranks skip that path: ~10 GB at 65536 ranks.
--quick: 64 and 1024 ranks only.)

What a real save does on the coordinator, step by step, each timed:
  gather    every rank pickles its manifest (bytes per rank are reported), the coordinator
            unpickles all of them (what gather_object does);
  plan      plan_save(gathered);
  metadata  metadata.json built as commit.write_metadata builds it (paths rooted in the data
            directory, the crc32s of every stored chunk's blocks) and serialised;
and what a load does: parse (Metadata.from_json, the validating parser), then plan_load for one
rank, same layout and resharded. "cached check" is what a repeated save with an unchanged layout
does instead of gather + plan (a fingerprint of one rank's manifest, then one all-reduce).

Layouts: fsdp (every tensor row-sharded over all ranks the DTensor way, Shard(0), uneven
ceil-div split), hsdp (mesh 2 x W/2, Replicate x Shard(0)), replicated (plain tensors on every
rank, DDP); then fsdp at 16384 ranks. Ends with the targets, met or missed, also as FIGURE lines
for benchmarks/run_all.py (the limit as the peer: a ratio <= 1 is met).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import os
import pickle
import random
import sys
import time

import json

from bytecheckpoint.planning import planner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import figure  # noqa: E402  (benchmarks/figures.py: the FIGURE lines run_all.py collects)
from bytecheckpoint.format.metadata import Metadata, ObjectFileMeta
from bytecheckpoint.storage.chunks import chunk_name, chunks_in_box
from bytecheckpoint.planning.planner import TargetSpec, TensorManifest, plan_load, plan_save

# compact manifests (regular layouts described once per tensor); None: the planner before them,
# where ranks send their box lists
pack_manifest = getattr(planner, "pack_manifest", None)

DATA_DIR = "data-bench"


def shapes(tensors: int, scale: int = 1):
    """The simulated tensors (scale: every dim divided by it, for real runs of the same layout:
    tests/dist/test_metadata_ranks.py)."""
    return [((4096 + 8 * t % 4096) // scale, (1024 if t % 3 else 4096) // scale) for t in range(tensors)]


def split(n: int, parts: int, i: int):
    """torch.chunk / DTensor Shard: ceil-div sized parts, trailing parts possibly empty."""
    step = -(-n // parts)
    lo = min(n, i * step)
    return lo, min(n, lo + step) - lo


def rank_manifest(world: int, tensors: int, layout: str, rank: int, scale: int = 1):
    out = []
    for t, shape in enumerate(shapes(tensors, scale)):
        key = f"layers.{t}.w"
        if layout == "replicated":
            out.append(TensorManifest(key, "bfloat16", shape, "replicated", (((0, 0), shape),)))
            continue
        if layout == "fsdp":
            mesh, dims, coord, (parts, i) = (world,), (0,), (rank,), (world, rank)
        else:  # hsdp: 2 replicas x world/2 shards
            half = world // 2
            mesh, dims, coord, (parts, i) = (2, half), (-1, 0), (rank // half, rank % half), (half, rank % half)
        lo, n = split(shape[0], parts, i)
        boxes = (((lo, 0), (n, shape[1])),) if n else ()
        if pack_manifest is None:
            out.append(TensorManifest(key, "bfloat16", shape, "sharded", boxes))
        else:
            out.append(TensorManifest(key, "bfloat16", shape, "sharded", boxes, grid=(mesh, dims, coord)))
    return tuple(out)


def payloads(world: int, tensors: int, layout: str):
    """What each rank sends to the coordinator (pickled), as save_plan.plan sends it."""
    if pack_manifest is None:
        return [pickle.dumps(rank_manifest(world, tensors, layout, r)) for r in range(world)]
    first = pack_manifest(rank_manifest(world, tensors, layout, 0), None)
    sample = {r: pack_manifest(rank_manifest(world, tensors, layout, r), first.digest)
              for r in sorted({1 % world, world // 2, world - 1})}
    other = sample[1 % world]
    # Other ranks differ from the sampled ones only in their mesh coordinates: build them by
    # replacing those (checked against the real packing on the sampled ranks).
    coords = lambda r: tuple((r,) if layout == "fsdp" else (r // (world // 2), r % (world // 2))
                             for _ in other.coords) if layout != "replicated" else other.coords
    for r, packed in sample.items():
        assert dataclasses.replace(other, coords=coords(r)) == packed, "bench shortcut != pack_manifest"
    out = [pickle.dumps(first)]
    out += [pickle.dumps(sample[r] if r in sample else dataclasses.replace(other, coords=coords(r)))
            for r in range(1, world)]
    return out


def blocks_of(a) -> int:
    """Checksums per chunk the writers report: one per BLOCK_BYTES block (format 2+), else one."""
    try:
        from bytecheckpoint.format.metadata import blocks_per_chunk
        from bytecheckpoint.storage.chunks import BLOCK_BYTES
    except ImportError:  # format 1: one crc32 per chunk, as an int
        return 0
    return blocks_per_chunk(a.chunks, a.dtype, BLOCK_BYTES)


def with_checksums(plan, rng):
    """The checksums commit.write_metadata gets from the ranks: per chunk, its crc32 (format 1)
    or the crc32 of each of its blocks."""
    import itertools
    arrays = {}
    for path, a in plan.arrays.items():
        ranges = [range(-(-s // c) if s else 1) for s, c in zip(a.shape, a.chunks)]
        n = blocks_of(a)
        value = (lambda: tuple(rng.getrandbits(32) for _ in range(n))) if n else (lambda: rng.getrandbits(32))
        arrays[path] = (a, {chunk_name(i): value() for i in itertools.product(*ranges)})
    return arrays


def build_metadata(plan, world: int, sums):
    from bytecheckpoint.pipeline import commit
    from bytecheckpoint.format.metadata import FORMAT_VERSION
    tensors = {k: _rooted_tensor(t) for k, t in plan.tensors.items()}
    if FORMAT_VERSION >= 5:  # every chunk's (pack, offset): one pack per rank, chunks back to back
        packs = tuple(f"{DATA_DIR}/pack/{r}-0.bin" for r in range(world))
        arrays, offset = {}, 0
        for i, (p, (a, s)) in enumerate(sums.items()):
            where = {}
            for j, name in enumerate(s):
                where[name] = ((i + j) % world, offset & 0xFFFFFFFF, offset >> 32)
                offset += 1 << 20
            arrays[f"{DATA_DIR}/{p}"] = commit.rooted(a, DATA_DIR, s, where, packs)
        extra = {"packs": packs}
    else:
        arrays = {f"{DATA_DIR}/{p}": commit.rooted(a, DATA_DIR, s) for p, (a, s) in sums.items()}
        extra = {}
    objects = tuple(ObjectFileMeta(r, f"{DATA_DIR}/objects/rank_{r}.json", 2, 0) for r in range(world))
    return Metadata(FORMAT_VERSION, "bench", world, tensors, arrays, objects, {"dict": []},
                    {"data_dir": DATA_DIR, "bytes_per_rank": list(plan.bytes_per_rank)}, **extra)


def chunk_arrays(plan, rng):
    """Every chunk's block crc32s in the plan's chunk order (arrays in order, chunks row-major), as
    numpy arrays: (chunks per array, block crc32s per chunk, the crc32s). Random values: the
    coordinator's work does not depend on them."""
    import numpy as np
    from bytecheckpoint.format.chunk_tables import chunk_count
    counts = np.asarray([chunk_count(a) for a in plan.arrays.values()], dtype=np.int64)
    per_chunk = np.asarray([max(1, blocks_of(a)) for a in plan.arrays.values()], dtype=np.int64)
    nblocks = np.repeat(per_chunk, counts)
    crcs = np.random.default_rng(rng.getrandbits(32)).integers(0, 2**32, int(nblocks.sum()), dtype=np.uint32)
    return counts, nblocks, crcs


def rank_tables(counts, nblocks, crcs, world: int):
    """Each rank's ChunkTables (format/chunk_tables.py: what a rank reports since issue 48): chunk j of
    array i written by rank (i + j) % world into its one pack, chunks back to back (build_metadata's
    locations above), with the checksums of chunk_arrays."""
    import numpy as np
    from bytecheckpoint.format.chunk_tables import ChunkTables
    total = int(counts.sum())
    pos = np.arange(total, dtype=np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    ranks = (np.repeat(np.arange(len(counts)), counts) + pos - first) % world
    del first
    crc_start = np.cumsum(nblocks) - nblocks
    order = np.argsort(ranks, kind="stable")
    bounds = np.cumsum(np.bincount(ranks, minlength=world))
    del ranks
    out = []
    for r, mine in enumerate(np.split(order, bounds[:-1])):
        lens = nblocks[mine]
        idx = np.repeat(crc_start[mine] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        out.append(ChunkTables(pos[mine], lens, crcs[idx], (f"{DATA_DIR}/pack/{r}-0.bin",),
                               np.zeros(len(mine), dtype=np.int64), pos[mine] << 20))
    return out


def metadata_per_save(plan, world: int, tables, repeats: int = 5):
    """A repeated save of an unchanged layout (issues 40, 48): metadata.json (+ table file) as
    commit.metadata_files makes it from every rank's ChunkTables, after a first save serialized the
    layout (pipeline/commit.py LAYOUTS). Returns (first save s, repeated save s (best of `repeats`),
    of which placing the ranks' tables s, metadata.json bytes, unpickling every rank's result s (the
    gather's receiving end), one rank's pickled result bytes (the largest), the coordinator's memory
    GiB, (metadata.json, table file))."""
    from bytecheckpoint.format import chunk_tables
    from bytecheckpoint.pipeline import commit
    from bytecheckpoint.state.structure_union import SavedStructure
    results = [((ObjectFileMeta(r, f"{DATA_DIR}/objects/rank_{r}.json", 2, 0), t, None), None)
               for r, t in enumerate(tables)]
    sent = [pickle.dumps(res) for res in results]
    t0 = time.perf_counter()
    ranks = [pickle.loads(b) for b in sent]
    unpickle = time.perf_counter() - t0
    sent_max = max(map(len, sent))
    del sent, results, tables
    structure = SavedStructure({"dict": []})

    def once():
        return commit.metadata_files("bench://", plan, "bench", DATA_DIR, world, structure, ranks, {},
                                     f"{DATA_DIR}/checksums.bin")
    t0 = time.perf_counter()
    raw, _ = once()
    first = time.perf_counter() - t0
    best = merge = float("inf")
    layout = commit.LAYOUTS.get(plan, structure)
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        chunk_tables.merge([res[0][1] for res in ranks], layout.blocks)
        merge = min(merge, time.perf_counter() - t0)
    gc.collect()
    held = sum(sum(a.nbytes for a in (t.positions, t.nblocks, t.crcs, t.packs, t.offsets))
               for t in (res[0][1] for res in ranks))
    del raw
    files, extra = peak_rss_during(once)
    return first, best, merge, len(files[0]), unpickle, sent_max, (held + extra) / 2**30, files


def peak_rss_during(fn):
    """(fn(), bytes the process's resident set grew by at its peak while fn() ran, sampled every 5 ms)."""
    import threading

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.005)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        value = fn()
    finally:
        done.set()
        thread.join()
    return value, max(0, max(peak[0], rss()) - before)


def _rooted_tensor(t):
    if hasattr(t, "rooted"):
        return t.rooted(DATA_DIR)
    from bytecheckpoint.format.metadata import RegionMeta, TensorMeta
    return TensorMeta(t.key, t.dtype, t.shape, t.layout, t.holders,
                      tuple(RegionMeta(r.offsets, r.lengths, f"{DATA_DIR}/{r.array}", r.array_offsets, r.writer)
                            for r in t.regions))


def crc_table_bytes(raw: bytes) -> int:
    """How much of metadata.json is per-chunk crc32 tables (v2 packed, or v1 objects)."""
    body = json.loads(raw)
    return sum(len(a["crc32"]) if "crc32" in a else len(json.dumps(a.get("checksums", {}), separators=(",", ":")))
               for a in body["arrays"].values() if "crc32_at" not in a)


def commit_payload(plan, rank: int) -> int:
    """Bytes rank `rank` sends the coordinator at commit today: its object-file entry and the
    crc32 of every chunk it wrote (write.write_local -> commit.collect_by_collective)."""
    writes = planner.rank_part(plan, rank).writes if hasattr(planner, "rank_part") else plan.writes[rank]
    sums = {}
    for w in writes:
        a = plan.arrays[w.array]
        names = sums.setdefault(f"{DATA_DIR}/{w.array}", {})
        for index, _ in chunks_in_box(a, (w.array_offsets, w.lengths)):
            names[chunk_name(index)] = (0xDEADBEEF,) * blocks_of(a) if blocks_of(a) else 0xDEADBEEF
    result = ((ObjectFileMeta(rank, f"{DATA_DIR}/objects/rank_{rank}.json", 2, 0), sums), None)
    return len(pickle.dumps(result))


def load_targets(world: int, tensors: int, layout: str, resharded: bool):
    """One rank's pieces: same layout (rank world/2), or resharded to world/2 ranks (FSDP split)."""
    out = []
    load_world = max(1, world // 2) if resharded else world
    rank = load_world // 2
    for t, shape in enumerate(shapes(tensors)):
        if layout == "replicated" and not resharded:
            pieces = (((0, 0), shape),)
        else:
            parts = load_world if layout != "hsdp" or resharded else max(1, world // 2)
            lo, n = split(shape[0], parts, rank % parts)
            pieces = (((lo, 0), (n, shape[1])),) if n else ()
        out.append(TargetSpec(f"layers.{t}.w", "bfloat16", shape, pieces))
    return out


def objects_per_save(plan, with_table: bool) -> int:
    """Objects a (sync) save of this plan writes in format 5: each rank's pack files (storage/packs.py:
    one per 64 MiB, at most 4 until a pack would pass 1 GiB) and its plain-values file, then metadata.json (+ the table file)."""
    from bytecheckpoint.storage import packs
    per_rank = [0 if b == 0 else packs.pack_count(b, b) for b in plan.bytes_per_rank]
    return sum(per_rank) + len(per_rank) + 1 + int(with_table)


def run(layout: str, world: int, tensors: int, rng, lean: bool = False) -> dict:
    """One row. lean: only the coordinator's path of today (every rank's ChunkTables placed by
    index), not the general per-chunk path beside it (metadata build+json and its sizes)."""
    row = {"layout": layout, "ranks": world, "tensors": tensors}
    sent = payloads(world, tensors, layout)
    row["gather_bytes_rank0"] = len(sent[0])
    row["gather_bytes_other"] = max(len(p) for p in sent[1:]) if world > 1 else 0
    gc.collect()
    t0 = time.perf_counter()
    gathered = [pickle.loads(p) for p in sent]
    row["gather_s"] = time.perf_counter() - t0
    del sent
    t0 = time.perf_counter()
    plan = plan_save(gathered)
    row["plan_s"] = time.perf_counter() - t0
    if hasattr(planner, "split_for_ranks"):  # what every rank receives, and its own part of the plan
        shared, extras = planner.split_for_ranks(plan)
        row["broadcast_bytes"] = len(pickle.dumps(shared)) + (max(len(pickle.dumps(e)) for e in extras) if extras else 0)
        best = {}
        for _ in range(3):  # best of 3 per rank, the slower of rank 0 and rank W/2
            for r in (0, world // 2):
                t0 = time.perf_counter()
                planner.local_plan(shared, extras[r] if extras else None, r)
                best[r] = min(best.get(r, float("inf")), time.perf_counter() - t0)
        row["local_s"] = max(best.values())
    else:
        row["broadcast_bytes"], row["local_s"] = "n/a", float("nan")
    if not lean:  # the general metadata path (per-chunk dicts): ~17 GiB of Python objects at 65,536 ranks
        sums = with_checksums(plan, rng)
        t0 = time.perf_counter()
        built = build_metadata(plan, world, sums)
        if hasattr(built, "to_files"):  # format 4: large checksum tables in a binary file beside the data
            raw, table = built.to_files(f"{DATA_DIR}/checksums.bin")
        else:
            raw, table = built.to_json(), None
        row["metadata_s"] = time.perf_counter() - t0
        row["metadata_mib"] = len(raw) / 2**20
        row["crc_mib"] = crc_table_bytes(raw) / 2**20  # inside metadata.json
        row["inline_mib"] = len(built.to_json()) / 2**20 if table else row["metadata_mib"]  # format 3: tables inline
        del sums, built
    if hasattr(planner, "rank_part"):  # issue 40: a repeated save renders metadata.json from its cached layout
        counts, nblocks, crcs = chunk_arrays(plan, rng)
        row["chunks"] = int(counts.sum())
        tables = rank_tables(counts, nblocks, crcs, world)
        del counts, nblocks, crcs
        (row["metadata_first_s"], row["metadata_repeat_s"], row["merge_s"], size, row["tables_unpickle_s"],
         row["tables_bytes"], row["coordinator_gib"], files) = metadata_per_save(plan, world, tables,
                                                                                 repeats=2 if world > 4096 else 5)
        del tables
        row["metadata_repeat_mib"] = size / 2**20
        if lean:  # what a load reads: the files this path wrote (byte for byte the general path's)
            raw, table = files
            row["metadata_mib"] = len(raw) / 2**20
        del files
    row["table_mib"] = len(table or b"") / 2**20   # the checksum table file
    row["commit_bytes"] = max(commit_payload(plan, 0), commit_payload(plan, world // 2))
    row["objects"] = objects_per_save(plan, table is not None)
    gc.collect()
    t0 = time.perf_counter()
    md = Metadata.from_json(raw, fetch=lambda path: table)  # parse includes the table file's check
    row["parse_s"] = time.perf_counter() - t0
    # what the other ranks get: the coordinator's parsed metadata, broadcast (the tables as raw numpy bytes)
    blob = pickle.dumps(md)
    row["md_bcast_mib"] = len(blob) / 2**20
    t0 = time.perf_counter()
    pickle.loads(blob)
    row["md_unpickle_s"] = time.perf_counter() - t0
    del blob
    for name, resharded in (("load_s", False), ("reshard_load_s", True)):
        targets = load_targets(world, tensors, layout, resharded)
        row[name] = float("inf")
        for _ in range(3):  # best of 3: these are short, and the machine is shared
            t0 = time.perf_counter()
            reads = plan_load(md.tensors, targets)
            row[name] = min(row[name], time.perf_counter() - t0)
        want = sum(p[1][0] * p[1][1] for t in targets for p in t.pieces)
        assert sum(r.global_box[1][0] * r.global_box[1][1] for r in reads) == want, "load plan does not cover"
    mine = rank_manifest(world, tensors, layout, world // 2)
    row["cached_s"] = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        hashlib.sha1(pickle.dumps((world, mine))).hexdigest()
        row["cached_s"] = min(row["cached_s"], time.perf_counter() - t0)
    if "metadata_s" in row:
        row["coordinator_s"] = row["gather_s"] + row["plan_s"] + row["metadata_s"]
    import resource
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return row


COLUMNS = [("layout", "layout", "{}"), ("ranks", "ranks", "{}"), ("tensors", "tensors", "{}"),
           ("gather B/rank (rank 0 / others)", None, None),
           ("gather unpickle (s)", "gather_s", "{:.2f}"), ("plan_save (s)", "plan_s", "{:.2f}"),
           ("plan to ranks (B)", "broadcast_bytes", "{}"), ("local plan, 1 rank (s)", "local_s", "{:.3f}"),
           ("metadata build+json (s)", "metadata_s", "{:.2f}"),
           ("metadata, first save through commit (s)", "metadata_first_s", "{:.3f}"),
           ("metadata, repeated save (s)", "metadata_repeat_s", "{:.3f}"),
           ("of which placing the ranks' tables (s)", "merge_s", "{:.3f}"),
           ("ranks' tables: unpickle all (s)", "tables_unpickle_s", "{:.3f}"),
           ("ranks' tables: B/rank (max)", "tables_bytes", "{}"),
           ("coordinator memory for metadata (GiB)", "coordinator_gib", "{:.2f}"),
           ("coordinator total (s)", "coordinator_s", "{:.2f}"),
           ("metadata.json (MiB)", "metadata_mib", "{:.1f}"), ("of which chunk crc32 (MiB)", "crc_mib", "{:.1f}"),
           ("checksum table file (MiB)", "table_mib", "{:.1f}"),
           ("chunks", "chunks", "{}"), ("objects per save", "objects", "{}"),
           ("commit payload B/rank", "commit_bytes", "{}"),
           ("parse (s)", "parse_s", "{:.2f}"), ("metadata broadcast (MiB)", "md_bcast_mib", "{:.1f}"),
           ("its unpickle, each other rank (s)", "md_unpickle_s", "{:.3f}"), ("plan_load 1 rank (s)", "load_s", "{:.3f}"),
           ("plan_load resharded (s)", "reshard_load_s", "{:.3f}"), ("cached check (s)", "cached_s", "{:.4f}")]


def fmt_row(row: dict) -> str:
    cells = []
    for _, key, f in COLUMNS:
        cells.append(f"{row['gather_bytes_rank0']} / {row['gather_bytes_other']}" if key is None
                     else f.format(row[key]) if key in row else "-")
    return "| " + " | ".join(cells) + " |"


def targets(rows) -> list:
    """(target, measured, limit, unit, peer): each is met when measured <= limit."""
    by = {(r["layout"], r["ranks"]): r for r in rows}
    out = []
    r = by.get(("fsdp", 4096))
    if r:
        out.append(("planner, fsdp 4096 ranks x 1000 tensors: coordinator (gather + plan + metadata)",
                    r["coordinator_s"], 5.0, "s", "the 5 s budget"))
        out.append(("planner, fsdp 4096 ranks: metadata.json", r["metadata_mib"], 10.0, "MiB", "the 10 MiB budget"))
        out.append(("planner, fsdp 4096 ranks x 1000 tensors: objects per save (format 5)", r["objects"],
                    2 * 4096 + 4, "objects", "the 2 x ranks + 4 budget"))
        out.append(("planner, fsdp 4096 ranks: metadata.json + checksum table file (all a load reads before data)",
                    r["metadata_mib"] + r["table_mib"], r["inline_mib"], "MiB",
                    "metadata.json with the tables inline (format 3), same plan"))
    r = by.get(("fsdp", 1))
    if r and "metadata_repeat_s" in r:
        out.append(("planner, 1 rank x 1000 tensors: metadata.json of a repeated save (unchanged layout)",
                    r["metadata_repeat_s"], 0.005, "s", "the 5 ms budget"))
    for world in (4096, 16384):
        r = by.get(("fsdp", world))
        if r and "metadata_repeat_s" in r:
            out.append((f"planner, fsdp {world} ranks x 1000 tensors: metadata of a repeated save "
                        f"({r['metadata_repeat_mib']:.1f} MiB metadata.json + {r['table_mib']:.1f} MiB table; "
                        f"{r['merge_s']:.2f} s of it placing the ranks' tables)",
                        r["metadata_repeat_s"], r["metadata_first_s"], "s",
                        "the first save's metadata, same path (merge + build + json)"))
    for world in (16384, 65536):  # issue 48's budgets
        r = by.get(("fsdp", world))
        if not r or "metadata_repeat_s" not in r:
            continue
        first = r["gather_s"] + r["plan_s"] + r["tables_unpickle_s"] + r["metadata_first_s"]
        if world == 16384:
            out.append((f"planner, fsdp {world} ranks x 1000 tensors: repeated save, coordinator's metadata "
                        f"(receiving every rank's tables + metadata.json and table)",
                        r["tables_unpickle_s"] + r["metadata_repeat_s"], 1.0, "s", "the 1 s budget"))
            out.append((f"planner, fsdp {world} ranks x 1000 tensors: first save, coordinator "
                        f"(gather + plan + every rank's tables + metadata)", first, 5.0, "s", "the 5 s budget"))
            out.append((f"planner, fsdp {world} ranks: a loading rank's metadata work (parse + plan_load)",
                        r["parse_s"] + max(r["load_s"], r["reshard_load_s"]), 0.5, "s", "the 0.5 s budget"))
            out.append((f"planner, fsdp {world} ranks: coordinator's memory for a save's metadata (every rank's "
                        f"tables received + the peak growth while placing them and writing metadata; the bench "
                        f"process itself peaked at {r['peak_rss_gib']:.1f} GiB with the simulated ranks' data)",
                        r["coordinator_gib"], 2.0, "GiB", "the 2 GiB budget"))
        else:
            out.append((f"planner, fsdp {world} ranks x 1000 tensors: first save, coordinator", first, 20.0, "s",
                        "the 20 s budget"))
    r = by.get(("fsdp", 16384))
    if r:
        out.append(("planner, fsdp 16384 ranks: coordinator", r["coordinator_s"], 20.0, "s", "the 20 s budget"))
    for (layout, world), r in sorted(by.items()):
        if layout == "replicated" and world in (64, 1024):
            # the planner before compact layouts (docs/results.md, earlier table): plan_save alone
            out.append((f"planner, replicated {world} ranks: plan_save", r["plan_s"], {64: 1.80, 1024: 2.32}[world],
                        "s", "the planner before regular layouts"))
    t = max(max(r["load_s"], r["reshard_load_s"]) for r in rows)
    out.append(("planner: plan_load for one rank (worst row)", t, 0.5, "s", "the 0.5 s budget"))
    out.append(("planner: cached re-plan check (worst row)", max(r["cached_s"] for r in rows), 0.1, "s",
                "the 0.1 s budget"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--large-ranks", type=int, nargs="*", default=[16384, 65536],
                    help="fsdp runs at these many ranks (none: --large-ranks with no value)")
    ap.add_argument("--lean-above", type=int, default=16384,
                    help="rows above this many ranks measure only today's path (65,536 ranks: ~10 GiB)")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "replicated"])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BCP_BENCH_QUICK") == "1",
                    help="64 and 1024 ranks only (what run_all.py --quick passes)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.large_ranks = [64, 1024], []
    rng = random.Random(0)
    print("| " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    rows = []
    runs = [("fsdp", 1)] + [(layout, w) for layout in args.layouts for w in args.ranks]
    runs += [("fsdp", w) for w in args.large_ranks]
    for layout, world in runs:
        rows.append(run(layout, world, args.tensors, rng, lean=world > args.lean_above))
        print(fmt_row(rows[-1]), flush=True)
    print("\n| target | measured | limit | |\n|---|---|---|---|")
    for name, value, limit, unit, peer in targets(rows):
        verdict = "" if "first save" in peer else "met" if value <= limit else "MISSED"
        print(f"| {name} | {value:.4g} {unit} | {limit:g} {unit} | {verdict} |")
    for name, value, limit, unit, peer in targets(rows):  # for benchmarks/run_all.py
        figure(name, value, limit, "" if "format 3" in peer or "first save" in peer else "<= 1", unit=unit,
               peer_name=peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
