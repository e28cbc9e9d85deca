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
the median step time over the rounds (after one untimed warm-up round), and the ratio is
against no logging. Needs the
``lightning``, ``transformers``, ``mlflow`` and ``tensorboard`` extras (and torch).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import http.server
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _results

import monitor_bus


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
        # No job runner (server-side jobs, none used here): a second process importing MLflow
        # alongside the server's doubled its start on two busy cores.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
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


# -- step timing --

STEPS = 40  # training steps per run; the first WARMUP are not timed
WARMUP = 5


def _median_step(marks: list[float]) -> float:
    """Median seconds between consecutive step ends, past the warm-up."""
    gaps = [b - a for a, b in zip(marks[WARMUP:], marks[WARMUP + 1 :], strict=False)]
    return statistics.median(gaps)


def lightning_contenders(mlflow_url: str) -> dict[str, Callable[[], float]]:
    """Train the tiny Lightning model once per call; return its median step time."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import MLFlowLogger

    from monitor_bus.exporters.mlflow import MlflowEventHandler
    from monitor_bus.integrations.lightning import MonitorBusLogger

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(
                torch.randn(STEPS * 8, 32), torch.randn(STEPS * 8, 1)
            )
            return torch.utils.data.DataLoader(data, batch_size=8)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.marks.append(time.perf_counter())

    def fit(logger: Any) -> float:
        clock = Clock()
        trainer = L.Trainer(
            max_steps=STEPS,
            log_every_n_steps=1,
            accelerator="cpu",
            logger=logger,
            callbacks=[clock],
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(Tiny())
        return _median_step(clock.marks)

    def bus_logger() -> float:
        with monitor_bus.EventBus(name="bench") as bus:
            bus.register_event_handler(MlflowEventHandler(mlflow_url, experiment_name="bench-bus"))
            return fit(MonitorBusLogger(bus, finalize_timeout=0))

    return {
        "no logging": lambda: fit(False),
        "MLFlowLogger (inline)": lambda: fit(
            MLFlowLogger(experiment_name="bench-inline", tracking_uri=mlflow_url)
        ),
        "MonitorBusLogger + MlflowEventHandler": bus_logger,
    }


def hf_contenders(log_dir: Path) -> dict[str, Callable[[], float]]:
    """Train a tiny BERT (built from a config) once per call; return its median step time."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from monitor_bus.integrations.transformers import MonitorBusCallback
    from monitor_bus.tensorboard import SummaryWriter

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return STEPS * 4

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": torch.tensor([1 + i % 7, 2, 3, 4]), "labels": torch.tensor(i % 2)}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

    runs = iter(range(1_000_000))

    def train(report_to: str, extra: list[Any]) -> float:
        clock = Clock()
        config = BertConfig(
            vocab_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=8,
        )
        args = TrainingArguments(
            output_dir=str(log_dir / f"hf-{next(runs)}"),  # report_to="tensorboard" writes here
            max_steps=STEPS,
            logging_steps=1,
            per_device_train_batch_size=4,
            report_to=report_to,
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=BertForSequenceClassification(config),
            args=args,
            train_dataset=Data(),
            callbacks=[clock, *extra],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log line when tqdm is off
        trainer.train()
        return _median_step(clock.marks)

    def bus_callback() -> float:
        writer = SummaryWriter(log_dir / f"bus-{next(runs)}")
        with monitor_bus.EventBus(name="bench") as bus:
            bus.register_event_handler(writer.add_run_event)
            step = train("none", [MonitorBusCallback(bus, flush_timeout=0)])
        writer.close()
        return step

    return {
        "no logging": lambda: train("none", []),
        'report_to="tensorboard" (inline)': lambda: train("tensorboard", []),
        "MonitorBusCallback + SummaryWriter": bus_callback,
    }


def measure(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median step time per contender, the contenders alternating within each round."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():
        run()  # warm-up, untimed: the first training in a process pays for its set-up
    for _ in range(rounds):
        for name, run in contenders.items():
            gc.collect()
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def table(medians: dict[str, float]) -> dict[str, Any]:
    """One comparison's table: each contender's median step and its ratio to no logging."""
    base = medians["no logging"]
    rows = [
        [name, f"{value * 1e3:,.2f}", f"{value / base:.2f}x"] for name, value in medians.items()
    ]
    return _results.table(["logging", "median step (ms)", "vs no logging"], rows)


def figures(medians: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each contender's median step (ms) and ratio to no logging, under a key a page can quote."""
    base = medians["no logging"]
    return {
        KEYS[name]: {"step_ms": value * 1e3, "ratio": value / base}
        for name, value in medians.items()
    }


# Each contender's key in the results file.
KEYS = {
    "no logging": "none",
    "MLFlowLogger (inline)": "mlflow_logger",
    "MonitorBusLogger + MlflowEventHandler": "monitor_bus",
    'report_to="tensorboard" (inline)': "report_to",
    "MonitorBusCallback + SummaryWriter": "monitor_bus",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds (each trains every contender once)"
    )
    parser.add_argument(
        "--delay", type=float, default=0.05, help="seconds the proxy delays each request"
    )
    parser.add_argument(
        "--only", choices=("lightning", "hf"), help="run one of the two comparisons"
    )
    _results.save_argument(parser, "integrations")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one intra-op thread: the logging threads get the other core
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {
        "rounds": args.rounds,
        "steps": STEPS,
        "warmup": WARMUP,
        "delay_ms": args.delay * 1e3,
        "tables": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.only in (None, "lightning"):
            proc, url = start_mlflow_server(root / "mlflow.db")
            proxy = SlowProxy(url, delay=args.delay)
            try:
                lightning = measure(lightning_contenders(proxy.url), args.rounds)
            finally:
                proxy.close()
                stop_server(proc)
            results["lightning"] = figures(lightning)
            results["tables"]["lightning"] = table(lightning)
        if args.only in (None, "hf"):
            hf = measure(hf_contenders(root), args.rounds)
            results["hf"] = figures(hf)
            results["tables"]["hf"] = table(hf)
    print(
        f"torch on 1 thread; {STEPS} steps per run ({WARMUP} untimed), median of {args.rounds} "
        "rounds after a warm-up round, contenders interleaved.\n"
    )
    for name, spec in results["tables"].items():
        print(f"{name}:\n{_results.markdown(spec)}\n")
    if args.save is not None:
        packages = ("torch", "lightning", "mlflow", "transformers", "tensorboard")
        _results.save("integrations", results, packages=packages, path=args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
