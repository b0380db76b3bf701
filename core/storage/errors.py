"""Storage errors: a failed tensorstore request turned into an error that names the URL and the fix.

tensorstore reports every failure as ValueError("CODE: message ..."); `classify` maps the code
and the server's error to one of the types below. All are CheckpointErrors.
"""
from __future__ import annotations

import errno
import re

from ..common.errors import CheckpointError, CheckpointNotFoundError


class StorageError(CheckpointError):
    """A request to the checkpoint's storage failed."""


class StorageAccessDeniedError(StorageError, PermissionError):
    """Credentials missing, wrong, or without permission for the bucket/path (permanent)."""


class BucketNotFoundError(StorageError, CheckpointNotFoundError):
    """The bucket in an s3:// or gs:// URL does not exist (permanent)."""


class StorageFullError(StorageError):
    """The storage is out of space or quota (ENOSPC, HTTP 507, QuotaExceeded)."""


class StorageUnavailableError(StorageError):
    """A transient failure that persisted through every retry (server down, 5xx, timeouts)."""


class StorageTimeoutError(StorageUnavailableError, TimeoutError):
    """A request got no answer within the per-request timeout (a hung server or mount)."""


_TS_CODE = re.compile(r"^([A-Z_]+):")


def classify(exc: BaseException, what: str, url: str) -> StorageError:
    """`what` says what was being done ("writing s3://b/p/metadata.json"); url is the checkpoint root."""
    msg = str(exc)
    code_match = _TS_CODE.match(msg)
    code = code_match.group(1) if code_match else ""
    short = _shorten(msg)
    if "NoSuchBucket" in msg:
        return BucketNotFoundError(
            f"{what} failed: the bucket of {url!r} does not exist. Create the bucket (or fix the URL / "
            f"storage_options endpoint) and try again. [{short}]")
    if code == "PERMISSION_DENIED" or "AccessDenied" in msg or "SignatureDoesNotMatch" in msg or \
            "InvalidAccessKeyId" in msg or "Failed to create credentials provider" in msg or \
            "Permission denied" in msg:
        return StorageAccessDeniedError(
            f"{what} failed: access denied for {url!r}. Check the credentials (storage_options "
            f"access_key_id/secret_access_key or profile, or AWS_* environment variables) and that they may "
            f"read and write this bucket/path. [{short}]")
    if _is_enospc(msg):
        return StorageFullError(f"{what} failed: no space left on the storage of {url!r}; free space or "
                                f"raise the quota. Nothing was committed. [{short}]")
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED") or re.search(r"http_response_code='5\d\d'", msg):
        return StorageUnavailableError(f"{what} failed after retrying: the storage of {url!r} is unavailable "
                                       f"or failing. [{short}]")
    return StorageError(f"{what} failed: {short}")


def _is_enospc(msg: str) -> bool:
    return ("No space left" in msg or f"[OS error {errno.ENOSPC}" in msg or "ENOSPC" in msg
            or "QuotaExceeded" in msg or "http_response_code='507'" in msg or "InsufficientStorage" in msg)


def _shorten(msg: str, limit: int = 400) -> str:
    """tensorstore appends the whole HTTP response body; keep the code and the server's message."""
    msg = re.sub(r"\s*\[http_response_body='.*?'\]", "", msg, flags=re.S)
    return msg if len(msg) <= limit else msg[:limit] + "..."


def classify_os_error(exc: OSError, what: str, url: str) -> StorageError:
    """The same classes for local file errors (ENOSPC, EACCES, ...)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"{what} failed: no space left on the storage of {url!r}; free space or raise "
                                f"the quota. Nothing was committed. [{exc}]")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageAccessDeniedError(f"{what} failed: permission denied for {url!r}; check that this process "
                                        f"may write there. [{exc}]")
    return StorageError(f"{what} failed: {exc}")
