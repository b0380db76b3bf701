"""core/foreign/torch_pickle.py: a torch.save archive's values read without running it: tensors
as references to their bytes (views, parameters, ordered state dicts), other classes as inert
stand-ins, a forged reduce executes nothing."""
import io
import os
from collections import OrderedDict

import pytest
import torch

from bytecheckpoint.common.errors import CorruptCheckpointError
from bytecheckpoint.foreign import torch_pickle, torch_zip


class _Forged:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Custom:
    def __init__(self):
        self.x = 5


def _blob(data: bytes) -> torch_zip.Blob:
    return torch_zip.Blob(len(data), {len(data) - 100: data[-100:]}, lambda a, b: data[a:b], "test.pt")


def _bytes_of(data: bytes, ref: torch_pickle.TensorRef) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[ref.start:ref.start + ref.nbytes]), dtype=ref.dtype).reshape(ref.shape)


def test_tensors_become_references_to_their_bytes(tmp_path):
    flat = torch.arange(40, dtype=torch.float32)
    sd = OrderedDict(w=torch.nn.Parameter(torch.randn(3, 4)), b=torch.ones(2, dtype=torch.bfloat16))
    sd._metadata = {"": {"version": 1}}
    state = {"sd": sd, "view": flat[10:30].view(4, 5), "flats": [flat], "shape": torch.Size([3, 4]),
             "n": 7, "set": {1, 2}, "obj": _Custom(), "empty": torch.empty(0)}
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    got = torch_pickle.load(_blob(data))
    assert torch.equal(_bytes_of(data, got["sd"]["w"]), sd["w"].detach())
    assert torch.equal(_bytes_of(data, got["sd"]["b"]), sd["b"])
    assert torch.equal(_bytes_of(data, got["view"]), flat[10:30].view(4, 5))   # a view: offset into the storage
    assert torch.equal(_bytes_of(data, got["flats"][0]), flat)
    assert got["shape"] == (3, 4) and got["n"] == 7 and got["set"] == {1, 2}
    assert isinstance(got["obj"], torch_pickle.Opaque) and got["obj"].name.endswith("_Custom")
    assert got["obj"].state == {"x": 5}
    assert got["empty"].nbytes == 0


def test_a_forged_reduce_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"evil": _Forged(str(marker)), "t": torch.ones(3)}, buf)
    got = torch_pickle.load(_blob(buf.getvalue()))
    assert not marker.exists()
    assert isinstance(got["evil"], torch_pickle.Opaque) and got["evil"].name == "posix.system"


def test_a_transposed_tensor_is_refused_not_misread():
    buf = io.BytesIO()
    torch.save({"t": torch.randn(3, 4).t()}, buf)
    with pytest.raises(CorruptCheckpointError, match="not C order"):
        torch_pickle.load(_blob(buf.getvalue()))


def test_garbage_is_a_clear_error():
    buf = io.BytesIO()
    torch.save({"t": torch.ones(3)}, buf)
    data = bytearray(buf.getvalue())
    with pytest.raises(CorruptCheckpointError):
        torch_pickle.load(_blob(bytes(data[: len(data) // 2])))
