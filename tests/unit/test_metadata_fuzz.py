"""Hostile or damaged metadata.json: truncated, wrong types, huge shapes, '..' and absolute paths,
deep nesting. Every public entry point (inspect, verify, is_checkpoint, load, load_full) must give
a CheckpointError or succeed; never another exception, never a huge allocation, never a hang, and
nothing outside the checkpoint is opened, read or written (watched with inotify).

The cases run in a child process with an address-space limit (RLIMIT_AS), so an attempt to
allocate for a huge shape fails loudly there instead of exhausting this machine.
"""
from __future__ import annotations

import copy
import ctypes
import ctypes.util
import json
import os
import random
import re
import resource
import struct
import subprocess
import sys
import time
import zlib

import pytest

ADDRESS_SPACE_LIMIT = 4 << 30
CASE_TIME_LIMIT_S = 30.0
OPS = ("is_checkpoint", "inspect", "verify", "load", "load_full")


# ---------------------------------------------------------------------- the checkpoint and mutations
def make_checkpoint(path: str) -> None:
    import torch
    import bytecheckpoint as bcp
    state = {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.arange(10),
             "nested": {"c": torch.ones(3, dtype=torch.bfloat16)}, "step": 7, "name": "run"}
    bcp.save(path, state)


def template():
    import torch
    return {"a": torch.zeros(4, 6), "b": torch.zeros(10, dtype=torch.int64),
            "nested": {"c": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0, "name": ""}


def encode(body, checksum: bool = True) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    if checksum:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["checksum"] = zlib.crc32(canonical.encode())
    return json.dumps(body, sort_keys=True).encode()


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:4]):
            yield from _paths(v, prefix + (i,))


def _set(body, path, value):
    node = body
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _array_of(t):
    """The array a tensor's first region lives in (format: tensor 'array', or per-region name)."""
    if "grid" in t:
        return t["array"] + ("/r0" if t["grid"].get("region_arrays") else "")
    r = t["regions"][0]
    return r[3] if len(r) == 5 else t["array"]


def _rename_array(t, old, new):
    if t.get("array") == old:
        t["array"] = new
    for r in t.get("regions", []):
        if len(r) == 5 and r[3] == old:
            r[3] = new


def _as_regions(t):
    """A grid tensor of this single-process checkpoint spelled out in the region form."""
    if "grid" in t:
        t.pop("grid")
        t["regions"] = [[[0] * len(t["shape"]), t["shape"], 0]]


WRONG = [None, "x", -1, 1.5, [], {}, True, 2 ** 70, "../outside", [[[[]]]], {"__pickle__": "gASVBQAAAAAAAACMAXiULg=="}]


def mutations(raw: bytes, outside: str, seed: int, n_random: int, per_field: int = 3):
    """(name, bytes) pairs."""
    body = json.loads(raw)
    out = []
    # truncated anywhere
    for cut in sorted({0, 1, 2, len(raw) // 3, len(raw) // 2, len(raw) - 2, len(raw) - 1}):
        out.append((f"truncated@{cut}", raw[:cut]))
    out.append(("not-json", b"\x00\xff" * 50))
    out.append(("deep-nesting", b"[" * 200000 + b"]" * 200000))
    out.append(("deep-nesting-structure", encode(dict(body, structure=json.loads("[" * 500 + "]" * 500)))))
    out.append(("nan-and-inf", raw.replace(b'"world_size": 1', b'"world_size": NaN')))
    out.append(("checksum-mismatch", raw.replace(b'"step"', b'"stap"', 1) if b'"step"' in raw else raw[:-2] + b" }"))
    # wrong types at every field (checksum fixed up, as an attacker would)
    rng = random.Random(seed)
    fields = [p for p in _paths(body) if p and p[0] != "checksum"]
    for path in fields:
        for value in rng.sample(WRONG, per_field):
            b = copy.deepcopy(body)
            _set(b, path, value)
            out.append((f"type:{'/'.join(map(str, path))}={json.dumps(value)[:20]}", encode(b)))
    # random byte flips with and without a fixed-up checksum
    for i in range(n_random):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append((f"flip{i}", bytes(b)))
        try:
            out.append((f"flip{i}-resummed", encode(json.loads(bytes(b)))))
        except (ValueError, UnicodeDecodeError):
            pass
    # huge shapes, consistent everywhere so that only size limits can stop them
    tensor_key = "a"
    array_key = _array_of(body["tensors"][tensor_key])
    for name, shape, chunks in (("huge-2d", [1 << 25, 1 << 25], [1 << 25, 1 << 25]),
                                ("huge-tiny-chunks", [1 << 24, 1 << 24], [1, 1]),
                                ("huge-1d", [1 << 49], [1 << 49]),
                                ("huge-ndim", [2] * 32, [1] * 32),
                                ("big-2gib", [1 << 15, 1 << 14], [1 << 15, 1 << 14])):
        b = copy.deepcopy(body)
        t = b["tensors"][tensor_key]
        a = b["arrays"][array_key]
        t["shape"], a["shape"], a["chunks"] = shape, shape, chunks
        t["array"] = array_key
        out.append((name, encode(b)))  # the grid form (mesh [1]: one region, the whole tensor)
        _as_regions(t)
        t["regions"] = [[[0] * len(shape), shape, 0]]
        out.append((name + "-regions", encode(b)))
    b = copy.deepcopy(body)
    _as_regions(b["tensors"][tensor_key])
    b["tensors"][tensor_key]["regions"] = b["tensors"][tensor_key]["regions"] * 20000
    out.append(("many-regions", encode(b)))
    # regular layouts that do not add up: each must be refused, never generate unbounded regions
    for name, change in (("mesh-larger-than-world", {"mesh": [1 << 20], "dims": [0]}),
                         ("mesh-table-short", {"mesh": [2], "dims": [0]}),
                         ("dims-out-of-range", {"dims": [5]}),
                         ("ranks-index-out-of-range", {"ranks": 7}),
                         ("choices-garbage", {"choices": "!!notbase64", "choice_bytes": 1}),
                         ("choices-too-many", {"choices": "AAAA", "choice_bytes": 1}),
                         ("choices-no-holder", {"choices": "AQ==", "choice_bytes": 1}),
                         ("region-arrays-missing", {"region_arrays": True}),
                         ("region-arrays-not-bool", {"region_arrays": 1})):
        b = copy.deepcopy(body)
        b["tensors"][tensor_key]["grid"].update(change)
        out.append((f"grid:{name}", encode(b)))
    for name, meshes in (("uncovered", [[-1]]), ("rank-twice", [[0, 0]]), ("rank-outside-world", [[3]]),
                         ("huge-table", [[-1] * 5000])):
        b = copy.deepcopy(body)
        b["meshes"] = meshes
        out.append((f"meshes:{name}", encode(b)))
    b = copy.deepcopy(body)
    b["arrays"][array_key]["crc32"] = b["arrays"][array_key]["crc32"] * 3
    out.append(("crc32-wrong-count", encode(b)))
    # paths that leave the checkpoint
    for name, target in (("dotdot-array", "../outside/secret"), ("dotdot-inner", "data-x/../../outside/secret"),
                         ("absolute-array", os.path.join(outside, "secret")), ("dot-array", "./x"),
                         ("empty-array", ""), ("backslash", "..\\outside\\secret"), ("nul", "a\u0000b"),
                         ("url", "file:///etc/passwd"), ("tilde", "~/x")):
        b = copy.deepcopy(body)
        a = b["arrays"].pop(array_key)
        a["path"] = target
        b["arrays"][target] = a
        for t in b["tensors"].values():
            _rename_array(t, array_key, target)
        out.append((f"path:{name}", encode(b)))
        if b["objects"]:
            b = copy.deepcopy(body)
            b["objects"][0]["path"] = target
            out.append((f"objpath:{name}", encode(b)))
    # tensor keys with traversal (keys are names, not paths, but must not become paths)
    b = copy.deepcopy(body)
    b["tensors"]["../../outside/evil"] = b["tensors"].pop(tensor_key)
    out.append(("tensor-key-dotdot", encode(b)))
    b = copy.deepcopy(body)
    b["info"]["data_dir"] = "../outside"
    out.append(("info-data-dir-dotdot", encode(b)))
    return out


# ---------------------------------------------------------------------- known gaps (core changes needed)
# verify() walks every chunk an array's shape implies, so a shape with ~2^48 tiny chunks runs for
# minutes and then fails allocating (see test_verify_bounds_chunk_count). Skipped in the sweep.
UNBOUNDED = {("huge-tiny-chunks", "verify"), ("huge-ndim", "verify")}


def known_gap(case: str, op: str, result: str) -> str:
    """The reason for a non-CheckpointError outcome that a strict xfail test below pins down."""
    if case == "deep-nesting" and "RecursionError" in result:
        return "deep-nesting"
    if "unhashable type" in result and "dtype" in case:
        return "unhashable-dtype"
    if op == "load_full" and case.startswith(("huge", "big")) and "allocate" in result:
        return "load-full-allocation"
    if op in ("load", "load_full") and re.search(r"KeyError|unpack|not iterable|unhashable", result):
        return "structure-unvalidated"  # the structure tree disagrees with tensors/objects
    return ""


# ---------------------------------------------------------------------- child process
def run_cases(ckpt: str, cases_file: str, results_file: str) -> None:
    import bytecheckpoint as bcp
    from bytecheckpoint.common.errors import CheckpointError
    with open(cases_file) as f:
        cases = json.load(f)
    meta = os.path.join(ckpt, "metadata.json")
    out = open(results_file, "w")
    for name, hex_raw in cases:
        with open(meta, "wb") as f:
            f.write(bytes.fromhex(hex_raw))
        for op in OPS:
            if (name, op) in UNBOUNDED:
                continue
            t0 = time.monotonic()
            try:
                if op == "is_checkpoint":
                    bcp.is_checkpoint(ckpt)
                elif op == "inspect":
                    bcp.inspect(ckpt)
                elif op == "verify":
                    bcp.verify(ckpt)
                elif op == "load":
                    bcp.load(ckpt, template())
                else:
                    bcp.load_full(ckpt)
                result = "ok"
            except CheckpointError as exc:
                result = f"error:{type(exc).__name__}"
            except BaseException as exc:  # noqa: BLE001 - reported, judged by the parent
                result = f"OTHER:{type(exc).__name__}: {str(exc)[:200]}"
            out.write(json.dumps({"case": name, "op": op, "result": result,
                                  "s": round(time.monotonic() - t0, 3)}) + "\n")
            out.flush()


# ---------------------------------------------------------------------- inotify: nothing outside
class Watch:
    IN_ACCESS, IN_MODIFY, IN_OPEN, IN_CREATE, IN_DELETE, IN_MOVED_TO = 0x1, 0x2, 0x20, 0x100, 0x200, 0x80

    def __init__(self, dirs):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = self.IN_ACCESS | self.IN_MODIFY | self.IN_OPEN | self.IN_CREATE | self.IN_DELETE | self.IN_MOVED_TO
        self.dirs = {}
        for d in dirs:
            wd = self.libc.inotify_add_watch(self.fd, d.encode(), mask)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.dirs[wd] = d

    def events(self):
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            i = 0
            while i < len(buf):
                wd, mask, _, size = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + size].rstrip(b"\0").decode()
                out.append((self.dirs.get(wd, "?"), name, mask))
                i += 16 + size
        return out

    def close(self):
        os.close(self.fd)


# ---------------------------------------------------------------------- the tests
def _run(tmp_path, n_random, seed, per_field=3):
    base = tmp_path / "base"
    ckpt = base / "ck"
    outside = base / "outside"
    outside.mkdir(parents=True)
    (outside / "secret").write_bytes(b"secret" * 100)
    (outside / "c").mkdir()
    (outside / "c" / "0").write_bytes(b"\0" * 96)
    (base / "victim.txt").write_text("do not touch")
    make_checkpoint(str(ckpt))
    raw = (ckpt / "metadata.json").read_bytes()
    cases = mutations(raw, str(outside), seed, n_random, per_field)
    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.jsonl"
    cases_file.write_text(json.dumps([(n, r.hex()) for n, r in cases]))
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in base.rglob("*") if ckpt not in p.parents and p != ckpt}
    watch = Watch([str(base), str(outside), str(outside / "c")])

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))

    code = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import test_metadata_fuzz as t; "
            "t.run_cases(*sys.argv[2:])", os.path.dirname(os.path.abspath(__file__)), str(ckpt), str(cases_file),
            str(results_file)]
    proc = subprocess.run(code, preexec_fn=limit, capture_output=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    events = watch.events()
    watch.close()
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr.decode()[-3000:]}"
    results = [json.loads(line) for line in results_file.read_text().splitlines()]
    assert len(results) == len(cases) * len(OPS) - sum(1 for n, _ in cases for op in OPS if (n, op) in UNBOUNDED)
    return cases, results, events, before, base, ckpt


def _judge(cases, results, events, before, base, ckpt):
    bad = [r for r in results if r["result"].startswith("OTHER") and not known_gap(r["case"], r["op"], r["result"])]
    slow = [r for r in results if r["s"] > CASE_TIME_LIMIT_S]
    outside_events = [e for e in events if not (e[0] == str(base) and e[1] == "ck")]
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in base.rglob("*") if ckpt not in p.parents and p != ckpt}
    assert not bad, f"{len(bad)} non-CheckpointError outcomes, e.g. {bad[:10]}"
    assert not slow, f"slow cases: {slow[:10]}"
    assert not outside_events, f"files outside the checkpoint were touched: {outside_events[:10]}"
    assert before == after
    by_case = {}
    for r in results:
        by_case.setdefault(r["case"], {})[r["op"]] = r["result"]
    # cases that must be refused outright, by every entry point that reads the metadata
    for name, ops in by_case.items():
        if name.startswith(("truncated", "not-json", "deep-nesting", "path:", "objpath:", "checksum-mismatch",
                            "huge", "grid:", "meshes:", "crc32-")) and "tilde" not in name:  # '~/x': a plain key
            for op in ("load", "load_full"):
                assert ops[op].startswith("error:") or known_gap(name, op, ops[op]), f"{name}: {op} -> {ops[op]}"
        if name.startswith(("truncated", "not-json", "path:", "objpath:", "checksum-mismatch", "grid:", "meshes:",
                            "crc32-")) and "tilde" not in name:
            assert ops["inspect"].startswith("error:"), f"{name}: inspect -> {ops['inspect']}"
    return by_case


@pytest.mark.timeout(300)
def test_fuzzed_metadata(tmp_path):
    by_case = _judge(*_run(tmp_path, n_random=20, seed=1234, per_field=1))
    assert len(by_case) > 80


@pytest.mark.faults
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzzed_metadata_long(tmp_path, seed):
    _judge(*_run(tmp_path, n_random=400, seed=seed, per_field=len(WRONG)))


# ---------------------------------------------------------------------- single cases
def _one_case(tmp_path, name, op, timeout=60):
    """Run one mutation through one entry point in a limited child; (returncode, result or None)."""
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    raw = (ckpt / "metadata.json").read_bytes()
    case = dict(mutations(raw, str(tmp_path / "outside"), 0, 0))[name]
    (tmp_path / "cases.json").write_text(json.dumps([(name, case.hex())]))
    code = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import test_metadata_fuzz as t; "
            "t.UNBOUNDED = {(sys.argv[5], o) for o in t.OPS if o != sys.argv[6]}; t.run_cases(*sys.argv[2:5])",
            os.path.dirname(os.path.abspath(__file__)), str(ckpt), str(tmp_path / "cases.json"),
            str(tmp_path / "r.jsonl"), name, op]
    try:
        proc = subprocess.run(code, capture_output=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT,) * 2))
    except subprocess.TimeoutExpired:
        return None, "timeout"
    lines = (tmp_path / "r.jsonl").read_text().splitlines() if (tmp_path / "r.jsonl").exists() else []
    return proc.returncode, json.loads(lines[0])["result"] if lines else proc.stderr.decode()[-500:]


@pytest.mark.timeout(120)
def test_deeply_nested_json_is_a_metadata_error(tmp_path):
    import bytecheckpoint as bcp
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    (ckpt / "metadata.json").write_bytes(b"[" * 200000 + b"]" * 200000)
    with pytest.raises(bcp.MetadataError):
        bcp.load(str(ckpt), template())


@pytest.mark.timeout(120)
def test_unhashable_dtype_is_a_metadata_error(tmp_path):
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    body = json.loads((ckpt / "metadata.json").read_bytes())
    body["tensors"]["a"]["dtype"] = ["float32"]
    (ckpt / "metadata.json").write_bytes(encode(body))
    import bytecheckpoint as bcp
    with pytest.raises(bcp.MetadataError):
        bcp.load(str(ckpt), template())


@pytest.mark.timeout(120)
def test_load_full_refuses_huge_shapes_without_allocating(tmp_path):
    # 2^50 float32 elements: the allocation fails at once, so this is safe in-process
    import bytecheckpoint as bcp
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    case = dict(mutations((ckpt / "metadata.json").read_bytes(), str(tmp_path / "o"), 0, 0))["huge-2d"]
    (ckpt / "metadata.json").write_bytes(case)
    with pytest.raises(bcp.CheckpointError):
        bcp.load_full(str(ckpt))


@pytest.mark.timeout(120)
def test_verify_bounds_chunk_count(tmp_path):
    rc, result = _one_case(tmp_path, "huge-tiny-chunks", "verify", timeout=30)
    assert result == "ok"  # returns a report (with problems) promptly


@pytest.mark.timeout(120)
@pytest.mark.parametrize("structure", [{"dict": "x"}, {"dict": [True]}, {"dict": [["a", {"tensor": "nope"}]]},
                                       {"dict": [["a", {"tensor": {"x": 1}}]]}], ids=["str", "bool", "missing",
                                                                                       "dict-key"])
def test_malformed_structure_is_a_metadata_error(tmp_path, structure):
    import bytecheckpoint as bcp
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    body = json.loads((ckpt / "metadata.json").read_bytes())
    body["structure"] = structure
    (ckpt / "metadata.json").write_bytes(encode(body))
    for fn in (lambda: bcp.load(str(ckpt), template()), lambda: bcp.load_full(str(ckpt))):
        with pytest.raises(bcp.CheckpointError):
            fn()


@pytest.mark.timeout(120)
def test_overwrite_never_deletes_outside_the_checkpoint(tmp_path):
    """A hostile metadata.json names '../outside' as its data directory; saving over it with
    overwrite=True must not delete that directory (Store.delete_prefix refuses such keys)."""
    import torch
    import bytecheckpoint as bcp
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    ckpt = tmp_path / "ck"
    make_checkpoint(str(ckpt))
    body = json.loads((ckpt / "metadata.json").read_bytes())
    body["info"]["data_dir"] = "../outside"
    (ckpt / "metadata.json").write_bytes(encode(body))
    try:
        bcp.save(str(ckpt), {"a": torch.ones(2)}, overwrite=True)
    except bcp.CheckpointError:
        pass  # refusing is fine too; deleting is not
    assert (outside / "keep.txt").read_text() == "keep"
