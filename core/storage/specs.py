"""Pure builders of tensorstore spec dicts, tested by comparing dicts.

URLs: a local path or file://path, s3://bucket/prefix, gs://bucket/prefix, memory://name.
storage_options (remote stores): endpoint, region, profile, access_key_id, secret_access_key,
session_token, requester_pays; the usual AWS_* environment variables are honoured by
tensorstore itself when no explicit credentials are given.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ..config import TUNABLES
from ..errors import CheckpointError
from ..metadata import ArrayMeta

_S3_OPTIONS = {"endpoint", "region", "profile", "access_key_id", "secret_access_key", "session_token",
               "requester_pays", "host_header"}


def split_url(url: str) -> Tuple[str, str, str]:
    """(scheme, bucket, path) with path always ending in '/' (or empty)."""
    url = os.fspath(url)
    if "://" not in url:
        return "file", "", os.path.abspath(url).rstrip("/") + "/"
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return "file", "", os.path.abspath(rest).rstrip("/") + "/"
    if scheme in ("s3", "gs", "memory"):
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{url!r}: no bucket/name; expected {scheme}://BUCKET/PREFIX")
        path = path.strip("/")
        return scheme, bucket, (path + "/") if path else ""
    raise CheckpointError(f"{url!r}: unsupported URL scheme {scheme!r}; use a local path, file://, s3://, gs:// "
                          f"or memory://")


def kvstore_spec(url: str, storage_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    scheme, bucket, path = split_url(url)
    opts = dict(storage_options or {})
    if scheme == "file":
        _no_options(url, opts)
        return {"driver": "file", "path": path}
    if scheme == "memory":
        _no_options(url, opts)
        return {"driver": "memory", "path": f"{bucket}/{path}"}
    if scheme == "gs":
        spec: Dict[str, Any] = {"driver": "gcs", "bucket": bucket, "path": path}
        if "user_project" in opts:
            spec["user_project"] = opts.pop("user_project")
        _no_options(url, opts)
        return spec
    unknown = set(opts) - _S3_OPTIONS
    if unknown:
        raise CheckpointError(f"{url!r}: unknown storage_options {sorted(unknown)}; known: {sorted(_S3_OPTIONS)}")
    spec = {"driver": "s3", "bucket": bucket, "path": path}
    if "endpoint" in opts:
        spec["endpoint"] = opts["endpoint"]
    if "host_header" in opts:
        spec["host_header"] = opts["host_header"]
    if "region" in opts:
        spec["aws_region"] = opts["region"]
    if "requester_pays" in opts:
        spec["requester_pays"] = bool(opts["requester_pays"])
    if "access_key_id" in opts:
        creds = {"access_key_id": opts["access_key_id"], "secret_access_key": opts.get("secret_access_key", "")}
        if "session_token" in opts:
            creds["session_token"] = opts["session_token"]
        spec["aws_credentials"] = {"type": "default", **creds}
    elif "profile" in opts:
        spec["aws_credentials"] = {"type": "profile", "profile": opts["profile"]}
    return spec


def _no_options(url: str, opts: Mapping[str, Any]) -> None:
    if opts:
        raise CheckpointError(f"{url!r}: storage_options {sorted(opts)} do not apply to this kind of path")


def context_spec() -> Dict[str, Any]:
    """All concurrency limits in one place."""
    return {
        "file_io_concurrency": {"limit": TUNABLES.io_concurrency},
        "data_copy_concurrency": {"limit": TUNABLES.copy_concurrency},
        "s3_request_concurrency": {"limit": TUNABLES.io_concurrency},
        "experimental_s3_rate_limiter": {},
        "s3_request_retries": {"max_retries": 8, "initial_delay": "50ms", "max_delay": "5s"},
        "gcs_request_retries": {"max_retries": 8, "initial_delay": "50ms", "max_delay": "5s"},
    }


def zarr_spec(kvstore: Mapping[str, Any], array: ArrayMeta) -> Dict[str, Any]:
    """A zarr v3 array with crc32c on every chunk; `kvstore` is the checkpoint root."""
    base = dict(kvstore)
    base["path"] = base.get("path", "") + array.path + "/"
    return {
        "driver": "zarr3",
        "kvstore": base,
        "metadata": {
            "shape": list(array.shape),
            "data_type": array.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(array.chunks)}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": _fill_value(array.dtype),
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    return 0
