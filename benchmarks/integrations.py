"""Integration benchmarks: Lightning with MLflow, and the Hugging Face Trainer with
TensorBoard, each logging inline (the framework's own logger) against the bus, side by side.

    python benchmarks/integrations.py                  # print the table
    python benchmarks/integrations.py --write docs/performance.md

- Lightning + MLflow: a tiny model trained on CPU with no logger, with Lightning's
  ``MLFlowLogger`` and with ``MonitorBusLogger`` + ``MlflowEventHandler``, both against a
  real ``mlflow server`` on loopback behind ``SlowProxy``, which delays every request 50 ms.
- HF Trainer + TensorBoard: a tiny model (built from a config) trained with
  ``report_to="none"``, ``report_to="tensorboard"`` and ``MonitorBusCallback`` with the
  torch-free ``SummaryWriter``.

The contenders alternate within each round so all see the same machine load; each figure is
the median step time over the rounds, and the ratio is against no logging. Needs the
``lightning``, ``transformers``, ``mlflow`` and ``tensorboard`` extras (and torch).
"""

from __future__ import annotations

import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path


class SlowProxy:
    """An HTTP proxy on loopback in front of a tracking server: it waits ``delay`` seconds
    before forwarding each request, holds every request while ``hold`` is clear, and answers
    503 itself while ``down`` is set (a server that is slow, stuck or down)."""

    def __init__(self, upstream: str, delay: float = 0.0) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.delay = delay
        self.hold = threading.Event()
        self.hold.set()
        self.held = threading.Event()  # set when a request waits on ``hold``
        self.down = threading.Event()
        self.requests = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy.requests += 1
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not proxy.hold.is_set():
                    proxy.held.set()
                    proxy.hold.wait(60)
                if proxy.down.is_set():
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if proxy.delay:
                    time.sleep(proxy.delay)  # the simulated network latency
                conn = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                conn.request(self.command, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.hold.set()
        self._server.shutdown()
        self._server.server_close()


def start_mlflow_server(store: Path, timeout: float = 120) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``mlflow server`` on a free loopback port with a SQLite store; returns the
    process and its URL once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{store}",
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)  # the server is still starting: nothing to wait on but the port
    stop_server(proc)
    raise RuntimeError("mlflow server did not answer /health in time")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server and its workers (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)
