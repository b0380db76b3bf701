"""The engine on a real GPU (skipped without CUDA): every case a user relies on, on one device.

Round trips between GPU and CPU for every dtype kind; loads into GPU tensors through the pinned,
overlapped path (plain tensors, resharded and strided destinations, big tensors over several
slabs, optimizer state, DTensor / FSDP2 local shards, FSDP1 flat parameters) ordered before the
caller's next kernel; async saves whose sources change right after save() returns; warm-up.
Run on a lent GPU by benchmarks/gpu_session.sh (CI has none)."""
from __future__ import annotations

import glob
import os
import socket

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.common.errors import CorruptCheckpointError

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]

MiB = 1 << 20
CUDA = torch.device("cuda", 0)


def _rand(shape, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif not dtype.is_floating_point:
        t = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    else:
        t = torch.randn(shape, generator=g).to(dtype)
    return t.to(device)


def _mixed_state(device, seed=0):
    return {
        "bf16": _rand((257, 129), torch.bfloat16, device, seed),
        "fp16": _rand((1000,), torch.float16, device, seed + 1),
        "f8": _rand((64, 64), torch.float8_e4m3fn, device, seed + 2),
        "bool": _rand((333,), torch.bool, device, seed + 3),
        "i64": _rand((12, 7), torch.int64, device, seed + 4),
        "noncontig": _rand((64, 48), torch.float32, device, seed + 5).t(),
        "zero_d": torch.tensor(3.25, device=device),
        "big": _rand((3 * MiB,), torch.float32, device, seed + 6),   # 12 MiB: several slabs
        "plain": {"step": 7, "name": "run"},
    }


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu().view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a.cpu(),
                           b.cpu().view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b.cpu())
    else:
        assert a == b


def _zeros(state, device):
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            z = torch.zeros(v.shape, dtype=v.dtype, device=device)
            out[k] = z.t().contiguous().t() if not v.is_contiguous() else z   # the same strides as saved
        else:
            out[k] = {kk: None for kk in v}
    return out


@pytest.mark.parametrize("src,dst", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_round_trip_between_devices(tmp_path, src, dst):
    state = _mixed_state(src)
    with bcp.Checkpointer() as ckpt:
        ckpt.save(tmp_path / "c", state)
        target = _zeros(state, dst)
        ckpt.load(tmp_path / "c", target)
        _same(target, state)
        stats = ckpt.last_load_stats
        if dst == "cuda":
            assert stats.pinned_bytes > 0 and stats.device_bytes > 12 * MiB, stats
        else:
            assert stats.device_bytes == 0, stats


def test_async_save_from_gpu_is_a_snapshot_at_return(tmp_path):
    """Sources overwritten in place on the GPU right after save() returns (first save, and later
    ones whose copies start during the walk) are saved as they were at the call."""
    x = _rand((4 * MiB,), torch.float32, CUDA)
    with bcp.Checkpointer(async_save=True) as ckpt:
        for i in range(3):
            want = x.clone()
            h = ckpt.save(tmp_path / f"c{i}", {"x": x})
            x.mul_(-1.5).add_(1.0)  # queued at once on the current stream
            h.wait()
            assert h.stats.get("copies_started_early") == (i > 0)
            got = {"x": torch.empty_like(x)}
            ckpt.load(tmp_path / f"c{i}", got)
            assert torch.equal(got["x"], want)


def test_tensor_written_on_a_side_stream(tmp_path):
    side = torch.cuda.Stream()
    y = _rand((2 * MiB,), torch.float32, CUDA)
    x = torch.zeros_like(y)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.copy_(y * 2)
    torch.cuda.current_stream().wait_stream(side)  # what any consumer of x on the main stream does
    bcp.save(tmp_path / "c", {"x": x}, async_save=True).wait()
    got = {"x": torch.zeros_like(x)}
    bcp.load(tmp_path / "c", got)
    assert torch.equal(got["x"], y * 2)


def test_load_is_ordered_before_the_callers_next_kernel(tmp_path):
    """No synchronize between load() and the caller's next kernel, on the default stream and on a
    stream of the caller's own."""
    x = _rand((16 * MiB,), torch.float32, CUDA)
    bcp.save(tmp_path / "c", {"x": x})
    want = x.double().sum().item()
    got = {}
    for name, stream in (("default stream", torch.cuda.current_stream()), ("own stream", torch.cuda.Stream())):
        dest = torch.zeros_like(x)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            bcp.load(tmp_path / "c", {"x": dest})
            total = dest.double().sum()  # queued right away on the caller's stream
            got[name] = total.item()     # read on that stream too (after the sum)
    assert got == {"default stream": want, "own stream": want}


def test_resharded_and_strided_gpu_destinations(tmp_path):
    full = _rand((2048, 1024), torch.float32, "cpu")   # 8 MiB, one chunk
    bcp.save(tmp_path / "c", {"w": full, "t": full[:300, :200].clone()})
    rows = torch.zeros(700, 1024, device=CUDA)          # a contiguous part of the chunk: straight in
    cols = torch.zeros(2048, 100, device=CUDA)          # a strided part: device scratch + scatter
    t = torch.zeros(200, 300, device=CUDA).t()          # a strided destination
    with bcp.Checkpointer(pinned_load_bytes=4 * MiB) as ckpt:   # 2 MiB slabs: the chunk spans several
        ckpt.load(tmp_path / "c", {"w": bcp.Shard(rows, (2048, 1024), (1000, 0)), "t": t}, strict=False)
        ckpt.load(tmp_path / "c", {"w": bcp.Shard(cols, (2048, 1024), (0, 512))}, strict=False)
        assert ckpt.last_load_stats.pinned_bytes == 4 * MiB
    assert torch.equal(rows.cpu(), full[1000:1700]) and torch.equal(cols.cpu(), full[:, 512:612])
    assert torch.equal(t.cpu(), full[:300, :200])


def test_a_damaged_chunk_in_flight_is_a_clear_error(tmp_path):
    x = _rand((8 * MiB,), torch.float32, "cpu")
    bcp.save(tmp_path / "c", {"x": x})
    pack = max(glob.glob(str(tmp_path / "c" / "data-*" / "pack" / "*.bin")), key=os.path.getsize)
    with open(pack, "r+b") as f:
        f.seek(20 * MiB)
        f.write(b"\xff\x00\xff")
    with bcp.Checkpointer(pinned_load_bytes=8 * MiB) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="checksum.*partly overwritten"):
            ckpt.load(tmp_path / "c", {"x": torch.zeros(8 * MiB, device=CUDA)})
        assert ckpt._slabs.in_use == 0


class Net(nn.Module):
    def __init__(self, width=256, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def _trained(device, dtype=torch.float32, seed=0, **opt):
    torch.manual_seed(seed)
    model = Net().to(device, dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(8, 256, device=device, dtype=dtype)).float().pow(2).mean().backward()
        optim.step()
    return model, optim


@pytest.mark.parametrize("opt", [{}, {"fused": True}, {"capturable": True}])
def test_fresh_optimizer_resume_on_gpu_creates_state_without_a_step(tmp_path, opt):
    model, optim = _trained(CUDA, **opt)
    bcp.save(tmp_path / "c", {"model": model, "optimizer": optim})
    fresh_model = Net().to(CUDA)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3, **opt)
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": fresh_model, "optimizer": fresh_opt})
        assert ckpt.last_load_stats.optimizer_state == {"optimizer": "created"}
    a, b = optim.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k, st in a["state"].items():
        for sk, v in st.items():
            w = b["state"][k][sk]
            assert v.dtype == w.dtype and v.device == w.device and torch.equal(v, w), (k, sk)
    x = torch.randn(8, 256, device=CUDA)
    for m, o in ((model, optim), (fresh_model, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


def test_load_full_of_a_gpu_save_is_on_the_cpu(tmp_path):
    state = _mixed_state("cuda")
    bcp.save(tmp_path / "c", state)
    full = bcp.load_full(tmp_path / "c")
    assert all(t.device.type == "cpu" for t in full.values() if isinstance(t, torch.Tensor))
    _same(full, state)


def test_warm_up_allocates_pinned_buffers_before_the_first_async_save(tmp_path):
    model, optim = _trained(CUDA)
    state = {"model": model, "optimizer": optim}
    with bcp.Checkpointer(async_save=True) as ckpt:
        reserved = ckpt.warm_up(state)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert reserved >= 2 * 3 * nbytes  # both slots: weights and two moments
        pool = ckpt._pool
        # the buffers of GPU tensors are page-locked (AdamW's 0-d step counters live on the CPU)
        assert all(b.is_pinned() for s in pool._slots for b in s.buffers.values() if b.dim())
        ptrs = {k: b.data_ptr() for k, b in pool._slots[0].buffers.items()}
        h = ckpt.save(tmp_path / "c", state)
        h.wait()
        assert {k: b.data_ptr() for k, b in pool._slots[0].buffers.items()} == ptrs, "nothing allocated in the save"
        fresh = Net().to(CUDA)
        ckpt.load(tmp_path / "c", {"model": fresh}, strict=False)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


# ---------------------------------------------------------------------- one-GPU process group

@pytest.fixture(scope="module")
def one_gpu_group():
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()


def test_fsdp2_and_dtensor_on_a_one_gpu_mesh_to_cpu_and_back(tmp_path, one_gpu_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cuda", (1,))
    model, optim = _trained(CUDA)
    sharded = Net().to(CUDA)
    sharded.load_state_dict(model.state_dict())
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    x = torch.randn(8, 256, device=CUDA)
    opt.zero_grad()
    sharded(x).pow(2).mean().backward()
    opt.step()
    dt = distribute_tensor(_rand((64, 32), torch.float32, CUDA), mesh, [Shard(0)])
    bcp.save(tmp_path / "fsdp2", {"model": sharded, "optimizer": opt, "dt": dt})
    plain = Net()                                                   # CPU, no FSDP
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    bcp.load(tmp_path / "fsdp2", {"model": plain, "optimizer": plain_opt, "dt": torch.zeros(64, 32)})
    for (n, p), (_, q) in zip(sharded.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.full_tensor().cpu(), q), n
    bcp.save(tmp_path / "plain", {"model": plain, "optimizer": plain_opt})
    back = Net().to(CUDA)
    for layer in back.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(back, mesh=mesh)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-3)
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "plain", {"model": back, "optimizer": back_opt})
        assert ckpt.last_load_stats.device_bytes > 0 and ckpt.last_load_stats.optimizer_state == {"optimizer": "created"}
    for (n, p), (_, q) in zip(back.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.full_tensor().cpu(), q), n
    for p, q in zip(back_opt.state.values(), opt.state.values()):
        assert torch.equal(p["exp_avg"].full_tensor(), q["exp_avg"].full_tensor())


def test_fsdp1_flat_parameters_on_one_gpu(tmp_path, one_gpu_group):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model, optim = _trained(CUDA)
    wrapped = FSDP(Net().to(CUDA), device_id=CUDA, use_orig_params=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    x = torch.randn(8, 256, device=CUDA)
    opt.zero_grad()
    wrapped(x).pow(2).mean().backward()
    opt.step()
    bcp.save(tmp_path / "c", {"model": wrapped, "optimizer": opt})
    fresh = FSDP(Net().to(CUDA), device_id=CUDA, use_orig_params=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt})
        assert ckpt.last_load_stats.device_bytes > 0
    with FSDP.summon_full_params(wrapped), FSDP.summon_full_params(fresh):
        for p, q in zip(wrapped.parameters(), fresh.parameters()):
            assert torch.equal(p, q)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        for k in a:
            assert torch.equal(a[k], b[k]), k
