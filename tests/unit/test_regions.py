import math
import random

import pytest

from bytecheckpoint.geometry.regions import (chunk_count, chunk_grid, find_layout_problem, flat_range_to_boxes, intersect,
                                    volume)


def test_intersect():
    assert intersect(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert intersect(((0,), (2,)), ((2,), (2,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())


@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 5), (2, 1, 3, 4)])
def test_flat_range_boxes_cover_exactly_and_in_order(shape):
    total = math.prod(shape)
    rng = random.Random(0)
    for _ in range(200):
        a, b = sorted(rng.randrange(total + 1) for _ in range(2))
        boxes = flat_range_to_boxes(shape, a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        flat = []
        for offs, lens in boxes:
            # enumerate the box's elements in row-major order
            idx = [[]]
            for o, l in zip(offs, lens):
                idx = [i + [o + k] for i in idx for k in range(l)]
            for i in idx:
                flat.append(sum(x * math.prod(shape[d + 1:]) for d, x in enumerate(i)))
        assert flat == list(range(a, b))


def test_flat_range_rejects_out_of_bounds():
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((2, 3), 4, 7)


def test_chunk_grid_aligns_with_every_box():
    shape = (10, 6)
    boxes = [((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (2, 6))]
    # the tensor's end needs no chunk boundary: the last chunk (rows 8..12) is cut to 8..10 by zarr
    assert chunk_grid(shape, boxes) == (4, 6)
    assert chunk_count(shape, (4, 6)) == 3
    assert chunk_grid((9, 7), [((0, 0), (9, 7))]) == (9, 7)
    # an interior edge that is not a multiple of the others still forces its gcd
    assert chunk_grid((10, 6), [((0, 0), (4, 6)), ((4, 0), (3, 6)), ((7, 0), (3, 6))]) == (1, 6)
    # every chunk lies inside one box
    for shp, bxs in (((10, 6), boxes), ((4104, 8), [((i * 257, 0), (min(257, 4104 - i * 257), 8)) for i in range(16)])):
        c = chunk_grid(shp, bxs)
        for i in range(-(-shp[0] // c[0])):
            lo, hi = i * c[0], min(shp[0], (i + 1) * c[0])
            assert sum(1 for (o, l) in bxs if o[0] <= lo and hi <= o[0] + l[0]) == 1
    assert chunk_grid((4104, 8), [((i * 257, 0), (min(257, 4104 - i * 257), 8)) for i in range(16)]) == (257, 8)


def test_layout_problems_named():
    assert find_layout_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    msg, idx = find_layout_problem((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])
    assert "overlaps" in msg and sorted(idx) == [0, 1]
    msg, _ = find_layout_problem((4, 4), [((0, 0), (2, 4))])
    assert "cover 8 of 16" in msg
    msg, _ = find_layout_problem((4, 4), [((3, 0), (2, 4))])
    assert "outside" in msg
    assert volume(()) == 1


def test_chunks_are_refined_towards_the_target_without_one_row_chunks():
    from bytecheckpoint.geometry.regions import refine_chunks
    mib16, row = 16 << 20, 4096 * 4
    # the whole dim in one chunk row: ceil-divided, one short edge chunk (1367 is prime)
    assert refine_chunks((1367, 4096), (1367, 4096), 4, mib16) == (684, 4096)
    # box edges every 2734 rows: a divisor of 2734 = 2 x 1367, the one nearest 16 MiB (not 2 rows)
    assert refine_chunks((2734, 4096), (5468, 4096), 4, mib16) == (1367, 4096)
    assert refine_chunks((4096, 4096), (16384, 4096), 4, mib16) == (1024, 4096)
    assert refine_chunks((100, 4096), (100, 4096), 4, mib16) == (100, 4096)  # already small
    assert 1367 * row > mib16
