"""s3:// checkpoints against a real S3-compatible server (SeaweedFS, started by the tests on
127.0.0.1 with access keys required), through tensorstore's s3 kvstore driver.

Multi-rank cases run in fresh gloo processes (tests/launcher.py) with a hard time limit; the
rank functions at the top of this module are what those processes run.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage.errors import (BucketNotFoundError, StorageAccessDeniedError, StorageFullError,
                                           StorageUnavailableError)

from seaweed import ACCESS_KEY, SECRET_KEY, FaultProxy, seaweed  # noqa: F401 - fixture


def _store(url, opts):
    """The storage object the default Checkpointer uses for `url` (to look inside)."""
    return bcp.default_checkpointer().storage(url, opts)

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------- rank functions
def rank_save(path, storage_options, async_save=False, async_path=None):
    """Save the all-layouts state to `path` (and asynchronously to `async_path`, if given)."""
    from scenarios_reshard import build_state, rank_world
    rank, world = rank_world()
    for p, is_async in ((path, async_save), (async_path, True)):
        if p is None:
            continue
        state = build_state(world, rank, zero=False)
        h = bcp.save(p, state, async_save=is_async, storage_options=storage_options)
        if is_async:
            # training goes on right after save() returns: must not leak into the checkpoint
            state["replicated"].fill_(0)
            state["fsdp"].to_local().fill_(0)
            h.wait()
        print(f"rank {rank}: saved {p}")


def rank_load(paths, storage_options):
    from scenarios_reshard import build_state, expected_local, rank_world
    rank, world = rank_world()
    for path in paths:
        state = build_state(world, rank, zero=True)
        bcp.load(path, state, storage_options=storage_options)
        for name, value in state.items():
            if name == "extra":
                assert value == build_state(world, rank, zero=False)["extra"], f"{path}: extra differs"
                continue
            want, got = expected_local(name, value)
            if want.dtype == torch.float8_e4m3fn:
                want, got = want.view(torch.uint8), got.view(torch.uint8)
            assert torch.equal(want, got), f"{path}: {name} differs on rank {rank} of {world}"
        print(f"rank {rank}: loaded {path} ok")


def rank_expect_error(path, storage_options, op="save", error="CheckpointError", match=""):
    """Every rank must raise `error` (a class name in the MRO) whose message contains `match`."""
    from scenarios_reshard import build_state, rank_world
    rank, world = rank_world()
    state = build_state(world, rank, zero=op == "load")
    t0 = time.monotonic()
    try:
        if op == "save":
            bcp.save(path, state, storage_options=storage_options).wait()
        else:
            bcp.load(path, state, storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - checked below
        names = [c.__name__ for c in type(exc).__mro__]
        assert error in names, f"rank {rank}: expected {error}, got {type(exc).__name__}: {exc}"
        assert match in str(exc), f"rank {rank}: {match!r} not in {exc}"
        print(f"rank {rank}: raised {type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}")
        return
    raise AssertionError(f"rank {rank}: {op} of {path} did not fail")


def _run(target, world, args, timeout=150, env=None):
    from launcher import run_ranks
    extra = {"PYTHONPATH": HERE, "AWS_EC2_METADATA_DISABLED": "true", **(env or {})}
    return run_ranks(f"test_s3:{target}", world, args, timeout=timeout, extra_env=extra)


# ---------------------------------------------------------------------- fixtures
_counter = [0]


@pytest.fixture(scope="module")
def _bucket_name(seaweed):
    # One bucket: SeaweedFS gives every bucket its own volumes (a collection), so many buckets
    # would exhaust the server's volume slots.
    name = f"bcp-test-{os.getpid()}"
    seaweed.create_bucket(name)
    return name


@pytest.fixture
def bucket(_bucket_name):
    """'BUCKET/PREFIX' unique to the test."""
    _counter[0] += 1
    return f"{_bucket_name}/t{_counter[0]}"


# ---------------------------------------------------------------------- resharding, async
def test_save_2_ranks_load_resharded_1_and_3(seaweed, bucket):
    opts = seaweed.storage_options
    sync_url, async_url = f"s3://{bucket}/run/sync", f"s3://{bucket}/run/async"
    _run("rank_save", 2, {"path": sync_url, "async_path": async_url, "storage_options": opts})
    assert bcp.verify(sync_url, storage_options=opts).ok
    assert bcp.verify(async_url, storage_options=opts).ok
    info = bcp.inspect(async_url, storage_options=opts)
    assert info.complete and info.world_size == 2
    for world in (1, 3):
        outs = _run("rank_load", world, {"paths": [sync_url, async_url], "storage_options": opts})
        assert all("ok" in o for o in outs)


def test_single_process_roundtrip_and_async(seaweed, bucket):
    opts = seaweed.storage_options
    state = {"w": torch.randn(64, 33), "b": torch.arange(10, dtype=torch.int64), "step": 5, "name": "x"}
    url = f"s3://{bucket}/one"
    saved_w = state["w"].clone()
    h = bcp.save(url, state, async_save=True, storage_options=opts)
    state["w"].add_(1)  # after the copy-out: must not reach storage
    h.wait()
    out = {"w": torch.zeros(64, 33), "b": torch.zeros(10, dtype=torch.int64), "step": 0, "name": ""}
    bcp.load(url, out, storage_options=opts)
    assert torch.equal(out["w"], saved_w) and torch.equal(out["b"], state["b"])
    assert out["step"] == 5 and out["name"] == "x"
    with pytest.raises(bcp.CheckpointExistsError):
        bcp.save(url, state, storage_options=opts)
    bcp.save(url, state, storage_options=opts, overwrite=True)
    bcp.load(url, out, storage_options=opts)
    assert torch.equal(out["w"], state["w"])
    # overwrite removed the first save's data objects
    data_dirs = {k.split("/")[0] for k in _store(url, opts).list() if k.startswith("data-")}
    assert len(data_dirs) == 1


def test_packs_are_the_parallel_puts(seaweed, bucket, monkeypatch):
    """Object stores write smaller packs, several PUTs at once (packs.OBJECTS); past max_packs the
    packs grow only to max_bytes. Sync and async saves load back and verify; no PUT thread is left."""
    import json
    import threading
    from bytecheckpoint.storage import packs
    monkeypatch.setattr(packs, "OBJECTS", packs.Sizing(1 << 20, 6, 2 << 20))  # 16 MiB -> 8 packs, 6 in flight
    opts = seaweed.storage_options
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(512, 512) for i in range(16)}   # 16 x 1 MiB
    for mode in ("sync", "async"):
        url = f"s3://{bucket}/{mode}"
        bcp.save(url, state, async_save=mode == "async", storage_options=opts).wait()
        body = json.loads(_store(url, opts).get("metadata.json"))
        assert len(body["packs"]) == 8, body["packs"]
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        bcp.load(url, out, storage_options=opts)
        assert all(torch.equal(out[k], state[k]) for k in state)
        assert bcp.verify(url, storage_options=opts).ok
    assert not [t for t in threading.enumerate() if t.name.startswith("bytecheckpoint-put")]


# ---------------------------------------------------------------------- commit point
def test_commit_is_the_metadata_object_not_a_listing(seaweed, bucket):
    """Every data object of a checkpoint, without metadata.json, is not a checkpoint."""
    opts = seaweed.storage_options
    src, dst = f"s3://{bucket}/src", f"s3://{bucket}/copy"
    bcp.save(src, {"w": torch.randn(8, 8), "step": 1}, storage_options=opts)
    a, b = _store(src, opts), _store(dst, opts)
    keys = a.list()
    assert "metadata.json" in keys
    for k in keys:
        if k != "metadata.json":
            b.put(k, a.get(k))
    assert sorted(b.list()) == sorted(k for k in keys if k != "metadata.json")
    with pytest.raises(bcp.IncompleteCheckpointError, match="did not finish"):
        bcp.load(dst, {"w": torch.zeros(8, 8), "step": 0}, storage_options=opts)
    assert not bcp.is_checkpoint(dst, storage_options=opts)
    info = bcp.inspect(dst, storage_options=opts)
    assert not info.complete and "no metadata.json" in info.problem
    assert not bcp.verify(dst, storage_options=opts).ok
    # and writing the metadata object (one PUT) makes it complete, all at once
    b.put("metadata.json", a.get("metadata.json"))
    assert bcp.verify(dst, storage_options=opts).ok


def test_failed_commit_leaves_nothing_committed(seaweed, bucket):
    """The metadata PUT fails: the save raises, the path is reported incomplete (its data objects
    are there), and a previous checkpoint is untouched. (Every-rank behaviour of a failed commit is
    covered on 2 ranks in tests/faults/test_storage_faults.py.)"""
    from bytecheckpoint.storage import faults
    opts = seaweed.storage_options
    prev, url = f"s3://{bucket}/prev", f"s3://{bucket}/failed-commit"
    bcp.save(prev, {"w": torch.ones(8)}, storage_options=opts)
    with faults.inject({"op": "write", "kind": "unavailable", "key": "metadata.json"}, checkpointer=bcp.default_checkpointer()):
        with pytest.raises(bcp.CheckpointError, match="unavailable"):
            bcp.save(url, {"w": torch.zeros(8)}, storage_options=opts)
    assert any(k.startswith("data-") for k in _store(url, opts).list())
    assert bcp.verify(prev, storage_options=opts).ok
    info = bcp.inspect(url, storage_options=opts)
    assert not info.complete
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.load(url, {"w": torch.zeros(1)}, storage_options=opts)


def test_object_store_conditional_commit(seaweed, bucket):
    """The commit PUT is conditional (If-None-Match): a second writer of the same new metadata
    object loses, even when both found it absent."""
    store = _store(f"s3://{bucket}/cond", seaweed.storage_options)
    kv = store.kv
    absent = kv.read("metadata.json").result()
    assert absent.state == "missing"
    first = kv.write("metadata.json", b"A", if_equal=absent.stamp.generation).result()
    second = kv.write("metadata.json", b"B", if_equal=absent.stamp.generation).result()
    assert first.generation != b"" and second.generation == b""
    assert store.get("metadata.json") == b"A"
    assert store.put("metadata.json", b"C", if_absent=True) is False


# ---------------------------------------------------------------------- permanent errors
def test_no_bucket_is_a_clear_error_on_every_rank(seaweed):
    opts = seaweed.storage_options
    url = "s3://no-such-bucket-bcp/run/step1"
    outs = _run("rank_expect_error", 2, {"path": url, "storage_options": opts, "error": "BucketNotFoundError",
                                         "match": "s3://no-such-bucket-bcp/run/step1"})
    assert all("does not exist" in o for o in outs)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-bcp.*does not exist.*Create the bucket"):
        bcp.load(url, {"w": torch.zeros(1)}, storage_options=opts)
    with pytest.raises(BucketNotFoundError):
        bcp.inspect(url, storage_options=opts)
    assert not bcp.verify(url, storage_options=opts).ok


@pytest.mark.parametrize("creds", [{"secret_access_key": "wrong"}, {"access_key_id": "nobody"}, "anonymous"])
def test_access_denied_is_a_clear_error(seaweed, bucket, creds):
    good = seaweed.storage_options
    url = f"s3://{bucket}/denied"
    bcp.save(url, {"w": torch.ones(3)}, storage_options=good)
    bad = {"endpoint": good["endpoint"], "anonymous": True} if creds == "anonymous" else dict(good, **creds)
    with pytest.raises(StorageAccessDeniedError, match=f"access denied for '{url}'.*Check the credentials"):
        bcp.load(url, {"w": torch.zeros(3)}, storage_options=bad)
    with pytest.raises(StorageAccessDeniedError):
        bcp.save(url + "-2", {"w": torch.ones(3)}, storage_options=bad)
    assert not bcp.is_checkpoint(url + "-2", storage_options=good)


def test_aws_environment_credentials_are_honoured(seaweed, bucket):
    """No keys in storage_options: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL from
    the environment (tensorstore's default chain), in a fresh process."""
    url = f"s3://{bucket}/from-env"
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": seaweed.endpoint,
           "AWS_REGION": "us-east-1"}
    _run("rank_save", 1, {"path": url, "storage_options": None}, env=env)
    assert bcp.verify(url, storage_options=seaweed.storage_options).ok


def test_profile_credentials(seaweed, bucket, tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(f"[ckpt]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    config = tmp_path / "config"
    config.write_text("[profile ckpt]\n")
    opts = {"endpoint": seaweed.endpoint, "profile": "ckpt", "credentials_file": str(creds),
            "config_file": str(config)}
    url = f"s3://{bucket}/profile"
    bcp.save(url, {"w": torch.ones(4)}, storage_options=opts)
    out = {"w": torch.zeros(4)}
    bcp.load(url, out, storage_options=opts)
    assert torch.equal(out["w"], torch.ones(4))


# ---------------------------------------------------------------------- transient errors, retries
def test_transient_errors_are_retried(seaweed, bucket):
    """Real HTTP 503 SlowDown responses from a proxy in front of the server: the first 6 requests
    and then every 7th fail; tensorstore's backoff retries them and save/load succeed."""
    state = {"w": torch.randn(32, 32), "v": torch.randn(100), "step": 9}
    with FaultProxy(seaweed.endpoint, status=503, fail_first=6, fail_every=7) as proxy:
        opts = dict(seaweed.storage_options, endpoint=proxy.endpoint, retry_initial_delay=0.01)
        url = f"s3://{bucket}/flaky"
        bcp.save(url, state, storage_options=opts)
        out = {"w": torch.zeros(32, 32), "v": torch.zeros(100), "step": 0}
        bcp.load(url, out, storage_options=opts)
        assert proxy.injected >= 6
    assert torch.equal(out["w"], state["w"]) and out["step"] == 9
    assert bcp.verify(url, storage_options=seaweed.storage_options).ok


def test_persistent_server_errors_fail_in_bounded_time(seaweed, bucket):
    good = seaweed.storage_options
    prev = f"s3://{bucket}/prev"
    bcp.save(prev, {"w": torch.ones(8)}, storage_options=good)
    with FaultProxy(seaweed.endpoint, status=503, fail_all=True, methods=("PUT",)) as proxy:
        opts = dict(good, endpoint=proxy.endpoint, max_retries=3, retry_initial_delay=0.01)
        t0 = time.monotonic()
        with pytest.raises(bcp.CheckpointError, match="unavailable|failed"):
            bcp.save(f"s3://{bucket}/never", {"w": torch.ones(8)}, storage_options=opts)
        assert time.monotonic() - t0 < 30
    assert not bcp.is_checkpoint(f"s3://{bucket}/never", storage_options=good)
    assert bcp.verify(prev, storage_options=good).ok


def test_server_out_of_space(seaweed, bucket):
    """HTTP 507 InsufficientStorage on every PUT: a StorageFullError naming the URL, nothing committed."""
    with FaultProxy(seaweed.endpoint, status=507, fail_all=True, methods=("PUT",)) as proxy:
        opts = dict(seaweed.storage_options, endpoint=proxy.endpoint, max_retries=2, retry_initial_delay=0.01)
        with pytest.raises(bcp.CheckpointError) as info:
            bcp.save(f"s3://{bucket}/full", {"w": torch.ones(8), "step": 1}, storage_options=opts)
    assert "space" in str(info.value) or "507" in str(info.value) or isinstance(info.value, StorageFullError)
    assert not bcp.is_checkpoint(f"s3://{bucket}/full", storage_options=seaweed.storage_options)


def test_server_down_fails_in_bounded_time(seaweed):
    proxy = FaultProxy(seaweed.endpoint).start()
    endpoint = proxy.endpoint
    proxy.stop()  # nothing listens there any more
    opts = dict(seaweed.storage_options, endpoint=endpoint, max_retries=3, retry_initial_delay=0.01)
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="unavailable"):
        bcp.load("s3://any-bucket/x", {"w": torch.zeros(1)}, storage_options=opts)
    assert time.monotonic() - t0 < 30


def test_slow_server_still_completes(seaweed, bucket):
    with FaultProxy(seaweed.endpoint, delay_s=0.05) as proxy:
        opts = dict(seaweed.storage_options, endpoint=proxy.endpoint)
        url = f"s3://{bucket}/slow"
        state = {"w": torch.randn(16, 16), "step": 2}
        bcp.save(url, state, storage_options=opts)
        out = {"w": torch.zeros(16, 16), "step": 0}
        bcp.load(url, out, storage_options=opts)
    assert torch.equal(out["w"], state["w"])


# ---------------------------------------------------------------------- corruption
def test_flipped_byte_in_object_is_detected(seaweed, bucket):
    opts = seaweed.storage_options
    url = f"s3://{bucket}/flip"
    state = {"w": torch.randn(16, 16)}
    bcp.save(url, state, storage_options=opts)
    store = _store(url, opts)
    chunk = next(k for k in store.list() if "/pack/" in k)   # format 5: the rank's pack object
    raw = bytearray(store.get(chunk))
    raw[16 * 16 * 4 // 2] ^= 0x10                            # inside the tensor's bytes (offset 0)
    store.put(chunk, bytes(raw))
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(url, {"w": torch.zeros(16, 16)}, storage_options=opts)
    report = bcp.verify(url, storage_options=opts)
    assert not report.ok and any("checksum" in p for p in report.problems)


# ---------------------------------------------------------------------- retention
def test_keep_last_on_s3(seaweed, bucket):
    from bytecheckpoint import keep_last
    opts = seaweed.storage_options
    run = f"s3://{bucket}/run"
    for v in (1, 2, 3):
        bcp.save(f"{run}/step-{v}", {"w": torch.full((4,), float(v))}, storage_options=opts)
        time.sleep(0.01)
    store = _store(f"{run}/step-3", opts)  # a crashed save next to them: data, no metadata
    crashed = _store(f"{run}/step-4", opts)
    for k in store.list():
        if k != "metadata.json":
            crashed.put(k, store.get(k))
    report = keep_last(run, 1, storage_options=opts)
    assert report.kept == [f"{run}/step-3"]
    assert sorted(report.deleted) == [f"{run}/step-1", f"{run}/step-2"]
    assert report.incomplete == [f"{run}/step-4"]
    names = {k.split("/")[0] for k in _store(run, opts).list()}
    assert names == {"step-3", "step-4"}
    out = {"w": torch.zeros(4)}
    bcp.load(f"{run}/step-3", out, storage_options=opts)
    assert torch.equal(out["w"], torch.full((4,), 3.0))
