"""TensorBoard in tests: a real ``tensorboard`` server on 127.0.0.1 (always stopped), and the
custom-scalars layouts read back from event files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TensorBoard:
    """A running server: ``get("/data/runs")`` returns its parsed JSON."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **query: str) -> Any:
        return json.loads(self.get_bytes(path, **query))

    def get_bytes(self, path: str, **query: str) -> bytes:
        suffix = f"?{urllib.parse.urlencode(query)}" if query else ""
        with urllib.request.urlopen(f"{self.url}{path}{suffix}", timeout=10) as response:
            return response.read()  # type: ignore[no-any-return]


def _tensorboard_command(logdir: Path, port: int) -> list[str]:
    # Run the venv's tensorboard through this interpreter: no PATH lookups.
    code = (
        "import sys; from tensorboard.main import run_main; sys.argv[0] = 'tensorboard'; run_main()"
    )
    return [
        sys.executable,
        "-c",
        code,
        "--logdir",
        str(logdir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--reload_interval",
        "1",
    ]


@contextmanager
def tensorboard(logdir: Path, timeout: float = 40.0) -> Iterator[TensorBoard]:
    """Serve ``logdir`` until the block ends; fail if it is not up within ``timeout`` seconds."""
    port = free_port()
    log = (logdir.parent / f"tensorboard-{port}.log").open("wb")
    proc = subprocess.Popen(
        _tensorboard_command(logdir, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its data server child goes in the same group: stop both
    )
    try:
        server = TensorBoard(f"http://127.0.0.1:{port}")
        _wait(server, proc, timeout)
        yield server
    finally:
        _stop(proc)
        log.close()


def _wait(server: TensorBoard, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited early with code {proc.returncode}")
        try:
            server.get("/data/runs")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.3)
    raise TimeoutError(f"tensorboard at {server.url} not up after {timeout:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


LAYOUT_TAG = "custom_scalars__config__"


def read_layouts(logdir: Path) -> list[layout_pb2.Layout]:
    """Every custom-scalars layout written under ``logdir``, in file order."""
    layouts = []
    for events in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        if LAYOUT_TAG in acc.Tags()["tensors"]:
            for event in acc.Tensors(LAYOUT_TAG):
                layouts.append(layout_pb2.Layout.FromString(event.tensor_proto.string_val[0]))
    return layouts


def charts(layout: layout_pb2.Layout) -> dict[str, list[str]]:
    """``"category/chart title" -> regexes`` of a layout."""
    return {
        f"{category.title}/{chart.title}": list(chart.multiline.tag)
        for category in layout.category
        for chart in category.chart
    }
