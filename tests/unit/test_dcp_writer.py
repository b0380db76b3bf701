"""core/tools/dcp_writer.py: the torch.save archive built directly is the one torch.save writes
(same data.pkl, loadable by torch.load with weights_only, every crc32 right), and a directory written
by several writers is one dcp.load and bcp.load both read, every tensor and value in place."""
import io
import os
import struct
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import bytecheckpoint as bcp
from bytecheckpoint.tools import dcp_writer


@pytest.mark.parametrize("tensor", [torch.randn(5, 7), torch.randn(3, 4).to(torch.bfloat16), torch.tensor(2.5),
                                    torch.zeros(0, 3), torch.arange(10), torch.tensor([True, False])],
                         ids=["f32", "bf16", "scalar", "empty", "int64", "bool"])
def test_archive_is_torch_saves(tensor):
    buf = io.BytesIO()
    torch.save(tensor, buf)
    parts = dcp_writer.tensor_archive(tensor)
    blob = b"".join(bytes(p) for p in parts)
    ours, theirs = zipfile.ZipFile(io.BytesIO(blob)), zipfile.ZipFile(buf)
    assert ours.testzip() is None
    assert ours.read("archive/data.pkl") == theirs.read("archive/data.pkl")
    assert sorted(ours.namelist()) == sorted(theirs.namelist())
    back = torch.load(io.BytesIO(blob), weights_only=True)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    at = next(i for i in ours.infolist() if i.filename == "archive/data/0").header_offset
    name_len, extra_len = struct.unpack_from("<HH", blob, at + 26)   # the local header's own lengths
    start = at + 30 + name_len + extra_len
    assert start % dcp_writer.ALIGN == 0 and blob[start:start + tensor.numel() * tensor.element_size()] == \
        tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_several_writers_make_one_directory(tmp_path):
    tensors = {f"t{i}": torch.randn(i + 1, 3) for i in range(9)}
    leaves = [dcp_writer.Leaf((k,), True, (lambda v=v: v), None, v.numel() * 4) for k, v in tensors.items()]
    leaves.append(dcp_writer.Leaf(("step",), False, lambda: 7))
    n_t, n_v, nbytes, files = dcp_writer.write(leaves, str(tmp_path), writers=3)
    assert (n_t, n_v) == (9, 1) and nbytes == sum(v.numel() * 4 for v in tensors.values())
    assert sorted(os.listdir(tmp_path)) == sorted(files) and ".metadata" in files
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    target["step"] = 0
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert target["step"] == 7 and all(torch.equal(target[k], v) for k, v in tensors.items())
    full = bcp.load_full(str(tmp_path))
    assert full["step"] == 7 and all(torch.equal(full[k], v) for k, v in tensors.items())
    assert bcp.verify(str(tmp_path)).ok


def test_a_failing_read_leaves_no_metadata(tmp_path):
    def boom():
        raise OSError("source gone")
    with pytest.raises(OSError, match="source gone"):
        dcp_writer.write([dcp_writer.Leaf(("a",), True, boom)], str(tmp_path), writers=2)
    assert not os.path.exists(tmp_path / ".metadata")
