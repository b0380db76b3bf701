"""Pure builders of tensorstore spec dicts, tested by comparing dicts.

URLs: a local path or file://path, s3://bucket/prefix, gs://bucket/prefix, memory://name.
storage_options (remote stores) are listed in _S3_OPTIONS / _GS_OPTIONS below and documented in
docs/remote_storage.md. Without explicit credentials the usual AWS_* environment variables, the
AWS config files and the rest of tensorstore's default chain apply.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ..common.errors import CheckpointError

# Options a user may pass for s3:// paths (storage_options), all optional.
_S3_OPTIONS = {
    "endpoint",            # S3-compatible server, e.g. "http://127.0.0.1:8333" (else AWS_ENDPOINT_URL[_S3])
    "region",              # signing region (else AWS_REGION / AWS_DEFAULT_REGION; "us-east-1" with an endpoint)
    "host_header",         # override the Host header (with endpoint only)
    "requester_pays",      # bool
    "access_key_id", "secret_access_key", "session_token",   # explicit static credentials
    "profile", "credentials_file", "config_file",             # a named profile from AWS config files
    "anonymous",           # bool: unsigned requests (public buckets)
    "max_retries", "retry_initial_delay", "retry_max_delay",  # per-store retry policy for transient errors
}
_GS_OPTIONS = {"user_project", "max_retries", "retry_initial_delay", "retry_max_delay"}
# Options for every kind of path, handled by the engine rather than the kvstore spec.
COMMON_OPTIONS = {
    "request_timeout",     # seconds one storage request may take before it fails naming its URL
}
DEFAULT_REQUEST_TIMEOUT_S = 300.0


def split_common_options(url: str, storage_options: Optional[Mapping[str, Any]]
                         ) -> Tuple[Dict[str, Any], Optional[float]]:
    """(options for the kvstore spec, request timeout in seconds). storage_options must be a dict."""
    if storage_options is None:
        return {}, DEFAULT_REQUEST_TIMEOUT_S
    if not isinstance(storage_options, Mapping):
        raise CheckpointError(f"{url!r}: storage_options must be a dict (e.g. {{'endpoint': 'http://...'}}), got "
                              f"{type(storage_options).__name__} {storage_options!r:.60}")
    opts = dict(storage_options)
    timeout = opts.pop("request_timeout", DEFAULT_REQUEST_TIMEOUT_S)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise CheckpointError(f"{url!r}: storage_options request_timeout must be a positive number of seconds "
                              f"or None, got {timeout!r}")
    return opts, None if timeout is None else float(timeout)
# Transient failures (5xx, 429/SlowDown, connection errors) are retried with exponential backoff:
# 50ms, 100ms, ... capped at 10s, 10 attempts (~30s in all) before a StorageUnavailableError.
# Permanent ones (403, no bucket) are not retried. Per store: storage_options max_retries,
# retry_initial_delay, retry_max_delay.
RETRY_DEFAULTS = {"max_retries": 10, "initial_delay": "50ms", "max_delay": "10s"}
# Profile name used in the private credentials file written for explicit keys.
STATIC_PROFILE = "bytecheckpoint"


def split_url(url: str) -> Tuple[str, str, str]:
    """(scheme, bucket, path) with path always ending in '/' (or empty)."""
    url = os.fspath(url)
    if "://" not in url:
        return "file", "", os.path.abspath(url).rstrip("/") + "/"
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return "file", "", os.path.abspath(rest).rstrip("/") + "/"
    if scheme in ("s3", "gs", "memory", "http", "https"):
        bucket, _, path = rest.partition("/")
        if not bucket:
            what = "HOST/PATH" if scheme.startswith("http") else "BUCKET/PREFIX"
            raise CheckpointError(f"{url!r}: no {what.split('/')[0].lower()}; expected {scheme}://{what}")
        path = path.strip("/")
        return scheme, bucket, (path + "/") if path else ""
    raise CheckpointError(f"{url!r}: unsupported URL scheme {scheme!r}; use a local path, file://, s3://, gs://, "
                          f"memory:// or (read-only) http(s)://")


def kvstore_spec(url: str, storage_options: Optional[Mapping[str, Any]] = None, *,
                 env: Optional[Mapping[str, str]] = None, secrets_dir: Optional[str] = None) -> Dict[str, Any]:
    """The tensorstore kvstore spec of a checkpoint root.

    `env` defaults to os.environ (AWS_ENDPOINT_URL[_S3], AWS_REGION, AWS_DEFAULT_REGION are read
    here; AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE and the
    ~/.aws files are read by tensorstore's default credential chain). `secrets_dir` is where the
    Store wrote the private credentials file for explicit keys (see `static_credentials_files`).
    """
    scheme, bucket, path = split_url(url)
    opts = dict(storage_options or {})
    env = os.environ if env is None else env
    if scheme == "file":
        _no_options(url, opts)
        return {"driver": "file", "path": path}
    if scheme == "memory":
        _no_options(url, opts)
        return {"driver": "memory", "path": f"{bucket}/{path}"}
    if scheme in ("http", "https"):  # read-only: a checkpoint directory served by a web server
        _no_options(url, opts)
        return {"driver": "http", "base_url": f"{scheme}://{bucket}", "path": "/" + path}
    if scheme == "gs":
        _known(url, opts, _GS_OPTIONS)
        spec: Dict[str, Any] = {"driver": "gcs", "bucket": bucket, "path": path}
        if "user_project" in opts:
            spec["gcs_user_project"] = {"project_id": str(opts["user_project"])}
        retries = _retries(url, opts)
        if retries:
            spec["gcs_request_retries"] = retries
        return spec
    _known(url, opts, _S3_OPTIONS)
    spec = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = opts.get("endpoint") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        endpoint = str(endpoint).rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise CheckpointError(f"{url!r}: storage_options endpoint {endpoint!r} must start with http:// or "
                                  f"https://")
        spec["endpoint"] = endpoint
    if "host_header" in opts:
        if not endpoint:
            raise CheckpointError(f"{url!r}: storage_options host_header needs an endpoint")
        spec["host_header"] = str(opts["host_header"])
    region = opts.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = str(region)
    elif endpoint:  # a custom server: sign for the default region instead of asking the server
        spec["aws_region"] = "us-east-1"
    if opts.get("requester_pays"):
        spec["requester_pays"] = True
    creds = aws_credentials_spec(url, opts, secrets_dir)
    if creds is not None:
        spec["aws_credentials"] = creds
    retries = _retries(url, opts)
    if retries:
        spec["s3_request_retries"] = retries
    return spec


def aws_credentials_spec(url: str, opts: Mapping[str, Any], secrets_dir: Optional[str] = None
                         ) -> Optional[Dict[str, Any]]:
    """tensorstore `Context.aws_credentials` for the options, or None for the default chain.

    tensorstore has no inline static-key provider (its types are default, anonymous,
    environment, imds, profile, ecs), so explicit keys are written by the Store to a private
    (0600) credentials file and read through the `profile` provider; nothing is put in the
    process environment, so two stores with different keys can coexist in one process.
    """
    explicit = [k for k in ("access_key_id", "secret_access_key", "session_token") if opts.get(k)]
    chosen = [name for name, on in (("access keys", bool(explicit)), ("anonymous", bool(opts.get("anonymous"))),
                                     ("profile", bool(opts.get("profile") or opts.get("credentials_file"))))
              if on]
    if len(chosen) > 1:
        raise CheckpointError(f"{url!r}: storage_options give more than one kind of credentials "
                              f"({', '.join(chosen)}); pass only one")
    if explicit:
        if not (opts.get("access_key_id") and opts.get("secret_access_key")):
            raise CheckpointError(f"{url!r}: storage_options need both access_key_id and secret_access_key")
        if secrets_dir is None:
            raise CheckpointError(f"{url!r}: internal: explicit credentials need a secrets directory")
        cred_name, conf_name, _, _ = static_credentials_files(opts)
        return {"type": "profile", "profile": STATIC_PROFILE,
                "credentials_file": os.path.join(secrets_dir, cred_name),
                "config_file": os.path.join(secrets_dir, conf_name)}
    if opts.get("anonymous"):
        return {"type": "anonymous"}
    if opts.get("profile") or opts.get("credentials_file"):
        spec: Dict[str, Any] = {"type": "profile", "profile": str(opts.get("profile") or "default")}
        for key in ("credentials_file", "config_file"):
            if opts.get(key):
                spec[key] = os.path.expanduser(str(opts[key]))
        return spec
    return None


def static_credentials_files(opts: Mapping[str, Any]) -> Tuple[str, str, str, str]:
    """(credentials file name, config file name, credentials text, config text) for explicit keys.

    Names are derived from a hash of the contents, so equal keys share one file.
    """
    lines = [f"[{STATIC_PROFILE}]", f"aws_access_key_id = {_one_line(opts['access_key_id'])}",
             f"aws_secret_access_key = {_one_line(opts['secret_access_key'])}"]
    if opts.get("session_token"):
        lines.append(f"aws_session_token = {_one_line(opts['session_token'])}")
    text = "\n".join(lines) + "\n"
    config = f"[profile {STATIC_PROFILE}]\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    return f"credentials-{digest}", f"config-{digest}", text, config


def _one_line(value: Any) -> str:
    s = str(value)
    if "\n" in s or "\r" in s:
        raise CheckpointError("storage_options credentials must not contain line breaks")
    return s.strip()


def _retries(url: str, opts: Mapping[str, Any]) -> Dict[str, Any]:
    """A per-store retry resource when any retry option is given (unset fields: RETRY_DEFAULTS)."""
    if not any(k in opts for k in ("max_retries", "retry_initial_delay", "retry_max_delay")):
        return {}
    out: Dict[str, Any] = dict(RETRY_DEFAULTS)
    if "max_retries" in opts:
        n = opts["max_retries"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise CheckpointError(f"{url!r}: storage_options max_retries must be an integer >= 1, got {n!r}")
        out["max_retries"] = n
    for opt, key in (("retry_initial_delay", "initial_delay"), ("retry_max_delay", "max_delay")):
        if opt in opts:
            out[key] = _duration(url, opt, opts[opt])
    return out


def _duration(url: str, name: str, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return f"{int(round(value * 1000))}ms"
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise CheckpointError(f"{url!r}: storage_options {name} must be seconds (a number) or a duration like '50ms'")


def _known(url: str, opts: Mapping[str, Any], known: set) -> None:
    unknown = set(opts) - known
    if unknown:
        raise CheckpointError(f"{url!r}: unknown storage_options {sorted(unknown)}; known: {sorted(known)}")


def _no_options(url: str, opts: Mapping[str, Any]) -> None:
    if opts:
        raise CheckpointError(f"{url!r}: storage_options {sorted(opts)} do not apply to this kind of path")


def context_spec(io_concurrency: int = 32, copy_concurrency: int = 4) -> Dict[str, Any]:
    """All concurrency limits in one place (one Context per Checkpointer)."""
    return {
        "file_io_concurrency": {"limit": io_concurrency},
        # durability comes from one Storage.sync() per rank before the commit, not per-file fsync
        "file_io_sync": False,
        "data_copy_concurrency": {"limit": copy_concurrency},
        "s3_request_concurrency": {"limit": io_concurrency},
        "experimental_s3_rate_limiter": {},
        "s3_request_retries": dict(RETRY_DEFAULTS),
        "gcs_request_retries": dict(RETRY_DEFAULTS),
    }
