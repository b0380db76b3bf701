"""The command line: inspect, verify, export, import (in process through cli.main, plus a few
real `python -m bytecheckpoint` / console-script runs for exit codes and the entry point)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.tools import cli

REPO = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.register_buffer("steps", torch.tensor(7))


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.head(model.encoder(torch.randn(2, 16))).sum().backward()
    opt.step()
    path = tmp_path / "ck"
    bcp.save(str(path), {"model": model, "optimizer": opt, "epoch": 2})
    return path


def run_cli(capsys, *argv: str):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_table_and_json(ckpt, capsys):
    code, out, _ = run_cli(capsys, "inspect", ckpt)
    assert code == 0
    assert "saved by 1 rank(s)" in out and "model/encoder.weight" in out and "32x16" in out and "float32" in out
    code, out, _ = run_cli(capsys, "inspect", ckpt, "--json")
    info = json.loads(out)
    assert code == 0 and info["complete"] and info["world_size"] == 1
    assert {t["name"] for t in info["tensors"]} >= {"model/encoder.weight", "model/steps"}


def _largest_data_file(path: Path) -> Path:
    files = [p for p in path.rglob("*") if p.is_file() and p.name not in ("metadata.json", "zarr.json")
             and "objects" not in p.parts]
    return max(files, key=lambda p: p.stat().st_size)


def test_verify_ok_damaged_and_progress_bar(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run_cli(capsys, "verify", ckpt)
    assert code == 0 and out.startswith("OK:") and "[" in err and "#" in err
    victim = _largest_data_file(ckpt)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    code, out, _ = run_cli(capsys, "verify", ckpt)
    assert code == 1 and out.startswith("DAMAGED:") and "checksum" in out


def test_export_and_reload(ckpt, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "export", ckpt, tmp_path / "hf", "--to", "safetensors")
    assert code == 0, out
    assert "exported 5 tensors" in out and "key 'model'" in out and "model.safetensors" in out
    assert "no config.json" in out  # says what from_pretrained still needs
    sd = bcp.load_full(str(ckpt), keys=["model"])["model"]
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_export_sharded_bf16_json_and_config(ckpt, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"model_type": "bert"}')
    code, out, _ = run_cli(capsys, "export", ckpt, tmp_path / "hf", "--max-shard-size", "1KB", "--dtype", "bf16",
                           "--key", "model", "--config-from", cfg, "--json")
    res = json.loads(out)
    assert code == 0 and res["index_file"] == "model.safetensors.index.json" and len(res["files"]) >= 2
    assert res["copied"] == ["config.json"] and (tmp_path / "hf" / "config.json").exists()
    merged = {}
    for f in res["files"]:
        merged.update(load_file(tmp_path / "hf" / f))
    assert merged["encoder.weight"].dtype == torch.bfloat16 and merged["steps"].dtype == torch.int64
    idx = json.loads((tmp_path / "hf" / res["index_file"]).read_text())
    assert set(idx["weight_map"]) == set(merged) and set(idx["weight_map"].values()) == set(res["files"])


def test_export_bad_inputs(ckpt, tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", tmp_path, tmp_path / "o1")
    assert code == 2 and "is not a bytecheckpoint checkpoint" in err
    code, _, err = run_cli(capsys, "export", ckpt, tmp_path / "o2", "--key", "weights")
    assert code == 2 and "'weights' is not in the checkpoint" in err and "'model' (5 tensors)" in err
    assert "'optimizer'" in err and "'epoch' (no tensors)" in err
    (tmp_path / "o3").mkdir()
    (tmp_path / "o3" / "x").write_text("keep")
    code, _, err = run_cli(capsys, "export", ckpt, tmp_path / "o3")
    assert code == 2 and "--overwrite" in err
    code, _, _ = run_cli(capsys, "export", ckpt, tmp_path / "o3", "--overwrite")
    assert code == 0 and (tmp_path / "o3" / "x").read_text() == "keep"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(ckpt), str(tmp_path / "o4"), "--max-shard-size", "5 gigs"])
    assert exit_info.value.code == 2 and "not understood" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["export", str(ckpt), str(tmp_path / "o4"), "--dtype", "int3"])
    with pytest.raises(SystemExit):
        cli.main(["export", str(ckpt), str(tmp_path / "o4"), "--to", "gguf"])
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o4").exists()


def test_incomplete_checkpoint_is_reported(ckpt, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "metadata.json").unlink()
    code, out, _ = run_cli(capsys, "inspect", broken)
    assert code == 2 and "INCOMPLETE" in out
    code, _, err = run_cli(capsys, "export", broken, tmp_path / "o")
    assert code == 2 and "did not finish" in err


def test_import_then_export_round_trip(tmp_path, capsys):
    sd = {"a.weight": torch.randn(5, 3), "a.bias": torch.randn(5), "ids": torch.arange(4)}
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    code, out, _ = run_cli(capsys, "import", tmp_path / "hf", tmp_path / "ck")
    assert code == 0 and "imported 3 tensors" in out and "key 'model'" in out
    code, _, err = run_cli(capsys, "import", tmp_path / "hf", tmp_path / "ck")
    assert code == 2 and "--overwrite" in err
    assert run_cli(capsys, "import", tmp_path / "hf", tmp_path / "ck", "--overwrite")[0] == 0
    assert run_cli(capsys, "export", tmp_path / "ck", tmp_path / "back")[0] == 0
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    code, _, err = run_cli(capsys, "import", tmp_path / "missing", tmp_path / "ck2")
    assert code == 2 and "no such file or directory" in err


def test_push_to_hub_flag(ckpt, tmp_path, capsys, monkeypatch):
    import huggingface_hub
    seen = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kw):
            seen["create"] = (repo_id, kw)

        def upload_folder(self, **kw):
            seen["upload"] = kw
            return type("C", (), {"commit_url": "https://huggingface.co/org/m/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    code, out, _ = run_cli(capsys, "export", ckpt, tmp_path / "hf", "--push-to-hub", "org/m", "--private")
    assert code == 0 and "pushed to the Hugging Face Hub: https://huggingface.co/org/m/commit/1" in out
    assert seen["create"] == ("org/m", {"repo_type": "model", "private": True, "exist_ok": True})
    assert seen["upload"]["folder_path"] == str(tmp_path / "hf")


@pytest.mark.timeout(120)
def test_python_dash_m_and_console_script(ckpt, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = lambda *a: subprocess.run([*a], capture_output=True, text=True, env=env, timeout=60)  # noqa: E731
    r = run(sys.executable, "-m", "bytecheckpoint", "export", str(ckpt), str(tmp_path / "hf"))
    assert r.returncode == 0 and "exported 5 tensors" in r.stdout, r.stderr
    r = run(sys.executable, "-m", "bytecheckpoint", "export", str(ckpt), str(tmp_path / "hf"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "--overwrite" in r.stderr
    r = run(sys.executable, "-m", "bytecheckpoint", "export", str(ckpt), str(tmp_path / "x"), "--max-shard-size", "lots")
    assert r.returncode == 2 and "--max-shard-size" in r.stderr
    script = Path(sys.executable).parent / "bytecheckpoint"
    if not script.exists():
        pytest.skip("console script not installed (pip install -e . creates it)")
    r = run(str(script), "verify", str(ckpt))
    assert r.returncode == 0 and r.stdout.startswith("OK:") and "[" not in r.stderr  # no bar off a terminal


def test_checkpoint_served_over_http_loads_inspects_and_verifies(tmp_path):
    """A checkpoint directory behind a plain web server (no Range support: Python's http.server)
    is loaded (resharded), inspected and verified in place; it is read-only."""
    import functools
    import http.server
    import threading

    import torch

    import bytecheckpoint as bcp
    full = torch.arange(4096 * 64, dtype=torch.float32).view(4096, 64)
    bcp.save(tmp_path / "ck", {"w": full, "step": 5})
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ck"
        assert bcp.is_checkpoint(url) and not bcp.is_checkpoint(url + "-missing")
        assert bcp.inspect(url).nbytes == full.numel() * 4 and bcp.verify(url).ok
        part = {"w": bcp.Shard(torch.zeros(100, 64), (4096, 64), (1000, 0)), "step": 0}
        bcp.load(url, part)
        assert torch.equal(part["w"].local, full[1000:1100]) and part["step"] == 5
        with pytest.raises(bcp.CheckpointError, match="read-only"):
            bcp.save(url, {"w": full}, overwrite=True)
        with pytest.raises(bcp.CheckpointNotFoundError):
            bcp.load(url + "-missing", {"w": full})
    finally:
        server.shutdown()
        server.server_close()
