"""Which chunks a rank shares in a zero-redundancy load (pure planning, no process group)."""
from types import SimpleNamespace

from bytecheckpoint.format.metadata import ArrayMeta
from bytecheckpoint.collectives.zero_redundancy import whole_chunks


def test_an_edge_chunk_needed_whole_is_shared_and_a_partial_one_is_not():
    # 1365 rows in chunks of 683: the edge chunk holds 682 rows (its padding row is nobody's need)
    md = SimpleNamespace(arrays={"w": ArrayMeta("w", (1365, 8), (683, 8), "float32"),
                                 "s": ArrayMeta("s", (), (), "int64")})
    whole = {("w", (0, 0)): [(((0, 0), (683, 8)), None)],
             ("w", (1, 0)): [(((683, 0), (682, 8)), None)],
             ("s", ()): [(((), ()), None)]}
    assert sorted(whole_chunks(md, whole)) == [("s", ()), ("w", (0, 0)), ("w", (1, 0))]
    halves = {("w", (1, 0)): [(((683, 0), (341, 8)), None)]}  # a resharding boundary: read, not shared
    assert whole_chunks(md, halves) == []
