"""format/chunk_tables.py: ranks' chunk reports as arrays, placed by global position (issue 48)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from bytecheckpoint.format import chunk_tables as ct
from bytecheckpoint.format.checksums import chunk_names, grid_counts
from bytecheckpoint.format.records import ArrayMeta


def _arrays():
    shapes = {"a": ((10, 4), (3, 4)), "b": ((7,), (7,)), "empty": ((0, 3), (1, 3)), "s": ((), ()),
              "c": ((4, 6, 2), (2, 3, 2))}
    return {p: ArrayMeta(p, shape, chunks, "float32", {}, 1 << 20) for p, (shape, chunks) in shapes.items()}


def _reports(arrays, world, seed=0):
    """Every chunk given to a random rank, with random block crc32s (the array's count) and places."""
    rng = random.Random(seed)
    bases = ct.chunk_bases(arrays)
    per_rank = [([], [], []) for _ in range(world)]
    want_sums, want_where = {}, {}
    for path, a in arrays.items():
        counts = grid_counts(a.shape, a.chunks)
        if 0 in counts:
            continue
        blocks = 1 + len(path) % 3
        for linear, name in enumerate(chunk_names(counts)):
            index = np.unravel_index(linear, counts) if counts else ()
            r = rng.randrange(world)
            sums = tuple(rng.getrandbits(32) for _ in range(blocks))
            where = (f"pack/{r}-{rng.randrange(2)}.bin", rng.getrandbits(40))
            per_rank[r][0].append(ct.position(bases[path], a, [int(i) for i in index]))
            per_rank[r][1].append(sums)
            per_rank[r][2].append(where)
            want_sums.setdefault(path, {})[name] = sums
            want_where.setdefault(path, {})[name] = where
    for lists in per_rank:  # a rank reports in its own order
        order = list(range(len(lists[0])))
        rng.shuffle(order)
        for lst in lists:
            lst[:] = [lst[i] for i in order]
    return [ct.ChunkTables.build(*lists) for lists in per_rank], want_sums, want_where


def _blocks(arrays, want_sums):
    return np.asarray([len(want_sums[p][n]) for p, a in arrays.items() if 0 not in grid_counts(a.shape, a.chunks)
                       for n in chunk_names(grid_counts(a.shape, a.chunks))], dtype=np.int64)


def test_merge_places_every_ranks_chunks_in_the_plans_order():
    arrays = _arrays()
    tables, want_sums, want_where = _reports(arrays, world=3)
    crcs, packs, where = ct.merge(tables, _blocks(arrays, want_sums))
    order = [(p, n) for p, a in arrays.items() if 0 not in grid_counts(a.shape, a.chunks)
             for n in chunk_names(grid_counts(a.shape, a.chunks))]
    assert crcs.tolist() == [c for p, n in order for c in want_sums[p][n]]
    rows = where.reshape(-1, 3).tolist()
    assert [(packs[k], lo | (hi << 32)) for k, lo, hi in rows] == [want_where[p][n] for p, n in order]
    assert ct.as_dicts(tables, arrays) == (want_sums, want_where)


def test_json_round_trip():
    tables, _, _ = _reports(_arrays(), world=2)
    for t in tables:
        back = ct.ChunkTables.from_json(t.to_json())
        for name in ("positions", "nblocks", "crcs", "packs", "offsets"):
            assert np.array_equal(getattr(back, name), getattr(t, name)) and \
                getattr(back, name).dtype == getattr(t, name).dtype, name
        assert back.pack_keys == t.pack_keys


@pytest.mark.parametrize("damage", ["missing", "twice", "blocks"])
def test_a_chunk_missing_twice_or_miscounted_is_refused(damage):
    arrays = _arrays()
    tables, want_sums, _ = _reports(arrays, world=2, seed=1)
    t = tables[0]
    if damage == "missing":
        tables[0] = ct.ChunkTables(t.positions[1:], t.nblocks[1:], t.crcs[int(t.nblocks[0]):], t.pack_keys,
                                   t.packs[1:], t.offsets[1:])
    elif damage == "twice":
        tables.append(t)
    else:
        tables[0] = ct.ChunkTables(t.positions, t.nblocks + 1, np.concatenate([t.crcs, t.crcs[:len(t.nblocks)]]),
                                   t.pack_keys, t.packs, t.offsets)
    with pytest.raises(ValueError):
        ct.merge(tables, _blocks(arrays, want_sums))


def test_positions_are_row_major_after_the_arrays_before():
    arrays = _arrays()
    bases = ct.chunk_bases(arrays)
    assert bases == {"a": 0, "b": 4, "empty": 5, "s": 5, "c": 6}
    assert ct.position(bases["c"], arrays["c"], (1, 0, 0)) == 6 + 2
    assert ct.position(bases["s"], arrays["s"], ()) == 5
