"""core/pipeline/plain_values.py: plain values that differ between the saved ranks, merged for a
load on another number of ranks (dict keys united; a differing value taken from the rank the
loading rank stands for, with a note), and a template's dict never losing a key."""
import pytest
import torch

from bytecheckpoint.pipeline import plain_values as pv


def test_stood_for_follows_the_data_stream_rule():
    assert pv.stood_for(0, 1, 2) == [0, 1]
    assert pv.stood_for(1, 2, 4) == [2, 3]
    assert pv.stood_for(2, 4, 2) == []          # a scale-up: new ranks stand for none
    assert pv.stood_for(1, 4, 2) == [1]
    assert pv.stood_for(0, 2, 3) == [0]          # not a multiple: rank for rank


def test_dicts_unite_and_differing_values_name_the_ranks_not_taken():
    values = {0: {"extra": {"only_rank0": 10, "common": 5}, "seen": 0, "t": torch.ones(2)},
              1: {"extra": {"only_rank1": 11, "common": 5}, "seen": 1, "t": torch.ones(2)}}
    notes = []
    got = pv.merged(values, [], [1], notes)
    assert got["extra"] == {"only_rank1": 11, "common": 5, "only_rank0": 10}   # preferred rank's keys first
    assert got["seen"] == 1 and torch.equal(got["t"], torch.ones(2))
    assert len(notes) == 1 and "'seen'" in notes[0] and "took saved rank 1's, not rank 0's" in notes[0]
    notes = []
    assert pv.merged(values, ["seen"], [], notes) == {"seen": 0}   # nobody preferred: the lowest rank
    assert pv.merged({0: {"a": [1, {"b": 2}]}, 1: {"a": [1, {"b": 2}]}}, [], [1], notes) == {"a": [1, {"b": 2}]}
    assert notes == ["plain value 'seen' differs between the saved ranks: took saved rank 0's, not rank 1's "
                     "(load_full(..., per_rank=True) returns every rank's)"]


def test_nested_differences_are_noted_by_path():
    notes = []
    got = pv.merged({0: {"rng": {"torch": 1, "cuda": 5}}, 1: {"rng": {"torch": 2, "cuda": 5}}}, [], [0], notes)
    assert got == {"rng": {"torch": 1, "cuda": 5}} and "'rng/torch'" in notes[0]


def test_a_template_dict_never_loses_a_key():
    template = {"a": 0, "b": {"x": 1, "y": 2}}
    with pytest.raises(KeyError) as err:
        pv.fill(template, {"a": 5, "b": {"x": 7}}, "k", strict=True)
    assert err.value.args[0] == ["k/b/y"]
    assert pv.fill(template, {"a": 5, "b": {"x": 7}, "c": 3}, "k", strict=False) == {"a": 5, "b": {"x": 7, "y": 2},
                                                                                   "c": 3}
    assert pv.fill(None, {"a": 1}, "k", strict=True) == {"a": 1}   # not a dict template: the saved value
