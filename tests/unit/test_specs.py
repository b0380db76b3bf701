"""tensorstore spec building (pure: dicts compared with dicts) and storage error classification."""
import os
import stat

import pytest
import tensorstore as ts

from bytecheckpoint import CheckpointError, CheckpointNotFoundError
from bytecheckpoint.storage import errors as serr
from bytecheckpoint.storage import faults
from bytecheckpoint.storage.specs import (RETRY_DEFAULTS, STATIC_PROFILE, context_spec, kvstore_spec, split_url,
                                          static_credentials_files)
import bytecheckpoint as bcp

NOENV = {}


def test_split_url():
    assert split_url("s3://bkt/a/b/") == ("s3", "bkt", "a/b/")
    assert split_url("s3://bkt") == ("s3", "bkt", "")
    assert split_url("gs://bkt/x") == ("gs", "bkt", "x/")
    assert split_url("file:///tmp/x/") == ("file", "", "/tmp/x/")
    with pytest.raises(CheckpointError, match="no bucket"):
        split_url("s3:///x")
    with pytest.raises(CheckpointError, match="unsupported URL scheme 'ftp'"):
        split_url("ftp://h/x")


def test_local_and_memory():
    assert kvstore_spec("/tmp/ck", env=NOENV) == {"driver": "file", "path": "/tmp/ck/"}
    assert kvstore_spec("memory://m/p", env=NOENV) == {"driver": "memory", "path": "m/p/"}
    with pytest.raises(CheckpointError, match="do not apply"):
        kvstore_spec("/tmp/ck", {"endpoint": "http://x"}, env=NOENV)


def test_s3_minimal_uses_default_chain():
    # no aws_credentials member: tensorstore's default chain (AWS_* env vars, ~/.aws, ...) applies
    assert kvstore_spec("s3://bkt/run/step1", env=NOENV) == {"driver": "s3", "bucket": "bkt", "path": "run/step1/"}


def test_s3_endpoint_region_and_flags():
    spec = kvstore_spec("s3://bkt/p", {"endpoint": "http://127.0.0.1:8333/", "requester_pays": True,
                                       "host_header": "bkt.local"}, env=NOENV)
    assert spec == {"driver": "s3", "bucket": "bkt", "path": "p/", "endpoint": "http://127.0.0.1:8333",
                    "aws_region": "us-east-1", "requester_pays": True, "host_header": "bkt.local"}
    assert kvstore_spec("s3://bkt/p", {"region": "eu-west-1"}, env=NOENV)["aws_region"] == "eu-west-1"
    with pytest.raises(CheckpointError, match="http:// or https://"):
        kvstore_spec("s3://bkt/p", {"endpoint": "127.0.0.1:8333"}, env=NOENV)
    with pytest.raises(CheckpointError, match="host_header needs an endpoint"):
        kvstore_spec("s3://bkt/p", {"host_header": "x"}, env=NOENV)


def test_s3_honours_aws_environment():
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_REGION": "ap-south-1"}
    spec = kvstore_spec("s3://bkt/p", env=env)
    assert spec["endpoint"] == "http://127.0.0.1:1" and spec["aws_region"] == "ap-south-1"
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:2",
           "AWS_DEFAULT_REGION": "us-west-2"}
    spec = kvstore_spec("s3://bkt/p", env=env)
    assert spec["endpoint"] == "http://127.0.0.1:2" and spec["aws_region"] == "us-west-2"
    # explicit options win over the environment
    spec = kvstore_spec("s3://bkt/p", {"endpoint": "http://127.0.0.1:3", "region": "r"}, env=env)
    assert spec["endpoint"] == "http://127.0.0.1:3" and spec["aws_region"] == "r"


def test_s3_static_keys_become_a_private_profile():
    opts = {"access_key_id": "AK", "secret_access_key": "SK", "session_token": "TOK"}
    spec = kvstore_spec("s3://bkt/p", opts, env=NOENV, secrets_dir="/secrets")
    cred, conf, text, config = static_credentials_files(opts)
    assert spec["aws_credentials"] == {"type": "profile", "profile": STATIC_PROFILE,
                                       "credentials_file": f"/secrets/{cred}", "config_file": f"/secrets/{conf}"}
    assert text == (f"[{STATIC_PROFILE}]\naws_access_key_id = AK\naws_secret_access_key = SK\n"
                    f"aws_session_token = TOK\n")
    assert config == f"[profile {STATIC_PROFILE}]\n"
    # secrets never appear in the spec itself
    assert "SK" not in repr(spec) and "TOK" not in repr(spec)
    # different keys, different files
    assert static_credentials_files({"access_key_id": "AK", "secret_access_key": "other"})[0] != cred


def test_s3_credential_choices():
    assert kvstore_spec("s3://b/p", {"anonymous": True}, env=NOENV)["aws_credentials"] == {"type": "anonymous"}
    assert kvstore_spec("s3://b/p", {"profile": "prod"}, env=NOENV)["aws_credentials"] == {
        "type": "profile", "profile": "prod"}
    assert kvstore_spec("s3://b/p", {"profile": "p", "credentials_file": "/c", "config_file": "/f"},
                        env=NOENV)["aws_credentials"] == {"type": "profile", "profile": "p",
                                                          "credentials_file": "/c", "config_file": "/f"}
    with pytest.raises(CheckpointError, match="both access_key_id and secret_access_key"):
        kvstore_spec("s3://b/p", {"access_key_id": "AK"}, env=NOENV, secrets_dir="/s")
    with pytest.raises(CheckpointError, match="more than one kind of credentials"):
        kvstore_spec("s3://b/p", {"access_key_id": "AK", "secret_access_key": "S", "anonymous": True},
                     env=NOENV, secrets_dir="/s")
    with pytest.raises(CheckpointError, match="line breaks"):
        static_credentials_files({"access_key_id": "AK\n[evil]", "secret_access_key": "S"})


def test_unknown_options_name_the_known_ones():
    with pytest.raises(CheckpointError, match=r"unknown storage_options \['endpoint_url'\]; known: .*endpoint"):
        kvstore_spec("s3://b/p", {"endpoint_url": "http://x"}, env=NOENV)
    with pytest.raises(CheckpointError, match="unknown storage_options"):
        kvstore_spec("gs://b/p", {"endpoint": "http://x"}, env=NOENV)


def test_retries():
    assert "s3_request_retries" not in kvstore_spec("s3://b/p", env=NOENV)
    spec = kvstore_spec("s3://b/p", {"max_retries": 2, "retry_initial_delay": 0.01}, env=NOENV)
    assert spec["s3_request_retries"] == {"max_retries": 2, "initial_delay": "10ms",
                                          "max_delay": RETRY_DEFAULTS["max_delay"]}
    spec = kvstore_spec("gs://b/p", {"max_retries": 3, "retry_max_delay": "2s"}, env=NOENV)
    assert spec["gcs_request_retries"] == {"max_retries": 3, "initial_delay": RETRY_DEFAULTS["initial_delay"],
                                           "max_delay": "2s"}
    assert context_spec()["s3_request_retries"] == RETRY_DEFAULTS
    for bad in (0, -1, True, "3"):
        with pytest.raises(CheckpointError, match="max_retries"):
            kvstore_spec("s3://b/p", {"max_retries": bad}, env=NOENV)


def test_gs():
    assert kvstore_spec("gs://bkt/a/b", env=NOENV) == {"driver": "gcs", "bucket": "bkt", "path": "a/b/"}
    assert kvstore_spec("gs://bkt/a", {"user_project": "proj"}, env=NOENV) == {
        "driver": "gcs", "bucket": "bkt", "path": "a/", "gcs_user_project": {"project_id": "proj"}}


@pytest.mark.parametrize("opts,url", [
    ({}, "s3://bkt/p"),
    ({"endpoint": "http://127.0.0.1:9", "anonymous": True, "max_retries": 2}, "s3://bkt/p"),
    ({"access_key_id": "AK", "secret_access_key": "SK"}, "s3://bkt/p"),
    ({"profile": "x"}, "s3://bkt/p"),
    ({"user_project": "p", "max_retries": 2}, "gs://bkt/p"),
])
def test_specs_are_valid_tensorstore_specs(opts, url):
    """tensorstore itself accepts every spec we build (parsing only; nothing is contacted)."""
    ts.KvStore.Spec(kvstore_spec(url, opts, env=NOENV, secrets_dir="/nonexistent"))


def test_store_writes_private_credentials_file():
    ckpt = bcp.Checkpointer()
    store = ckpt.storage("s3://bkt/p", {"endpoint": "http://127.0.0.1:9", "access_key_id": "AK",
                                        "secret_access_key": "SK"})
    creds = store.kv_spec["aws_credentials"]
    mode = stat.S_IMODE(os.stat(creds["credentials_file"]).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(creds["credentials_file"])).st_mode) == 0o700
    with open(creds["credentials_file"]) as f:
        assert "aws_secret_access_key = SK" in f.read()
    assert os.path.exists(creds["config_file"])
    ckpt.close()  # the instance's private credentials directory goes with it
    assert not os.path.exists(creds["credentials_file"])


@pytest.mark.parametrize("message,kind", [
    ("NOT_FOUND: NoSuchBucket: The specified bucket does not exist [http_response_code='404']",
     serr.BucketNotFoundError),
    ("PERMISSION_DENIED: AccessDenied: Access Denied. [http_response_code='403'] "
     "[http_response_body='<?xml ...>']", serr.StorageAccessDeniedError),
    ("PERMISSION_DENIED: SignatureDoesNotMatch: ...", serr.StorageAccessDeniedError),
    ("INTERNAL: Failed to create credentials provideraws-c-common: ...", serr.StorageAccessDeniedError),
    ("RESOURCE_EXHAUSTED: Error writing local file: No space left on device [OS error 28: ...]",
     serr.StorageFullError),
    ("UNKNOWN: x [http_response_code='507']", serr.StorageFullError),
    ("ABORTED: All 3 retry attempts failed: CURL error Could not connect to server", serr.StorageUnavailableError),
    ("UNAVAILABLE: SlowDown [http_response_code='503']", serr.StorageUnavailableError),
    ("UNKNOWN: something else", serr.StorageError),
])
def test_classify(message, kind):
    err = serr.classify(ValueError(message), "writing s3://b/p/k", "s3://b/p")
    assert type(err) is kind
    assert isinstance(err, CheckpointError)
    assert "s3://b/p" in str(err)
    assert "http_response_body" not in str(err)
    if kind is serr.BucketNotFoundError:
        assert isinstance(err, CheckpointNotFoundError)


def test_fault_rules():
    rules = faults.Rules()
    assert not rules
    (rule,) = made = [faults.Fault(op="write", kind="enospc", key="/c/", skip=1, count=2)]
    rules.add(made)
    assert rules
    assert rules.fire("write", "d/a/zarr.json") is None    # key does not match
    assert rules.fire("write", "d/a/c/0") is None          # skipped
    assert rules.fire("write", "d/a/c/1") == "enospc"
    assert rules.fire("write", "d/a/c/2") == "enospc"
    assert rules.fire("write", "d/a/c/3") is None          # count exhausted
    assert rules.fire("read", "d/a/c/0") is None           # other op
    assert rule.fired == 2
    rules.remove(made)
    assert not rules
    with pytest.raises(ValueError, match="fault kind"):
        faults.Fault(kind="explode")


def test_fault_rank_filter(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert faults.Rules([faults.Fault(kind="error", rank=0)]).fire("write", "k") is None
    assert faults.Rules([faults.Fault(kind="error", rank=1)]).fire("write", "k") == "error"


def test_fault_env(monkeypatch):
    monkeypatch.setenv(faults.ENV, '[{"op": "read", "kind": "denied"}]')
    (rule,) = faults.rules_from_env()
    assert (rule.op, rule.kind) == ("read", "denied")
    ckpt = bcp.Checkpointer.from_env()
    assert ckpt.fault_rules and isinstance(ckpt.storage("/tmp/x"), faults.FaultyStorage)
    monkeypatch.delenv(faults.ENV)
    assert not faults.rules_from_env()
    assert not isinstance(bcp.Checkpointer.from_env().storage("/tmp/x"), faults.FaultyStorage)


@pytest.mark.parametrize("local_io", ["posix", "tensorstore"])
def test_faulty_store_raises_classified_errors(tmp_path, local_io):
    ckpt = bcp.Checkpointer(local_io=local_io)
    with faults.inject({"op": "write", "kind": "enospc", "key": "obj"}, checkpointer=ckpt):
        store = ckpt.storage(str(tmp_path / "ck"))
        with pytest.raises(serr.StorageFullError, match="no space left.*ck"):
            store.put("obj", b"x")
        assert store.put("other", b"x")
    with faults.inject({"op": "read", "kind": "denied"}, checkpointer=ckpt):
        with pytest.raises(serr.StorageAccessDeniedError, match="(access|permission) denied"):
            ckpt.storage(str(tmp_path / "ck")).get("other")
    assert ckpt.storage(str(tmp_path / "ck")).get("other") == b"x"  # rules gone with the block
