"""A real OpenTelemetry Collector for the tests: spans sent to it over OTLP/HTTP come back as dicts.

The binary (OTLP receiver, file exporter; collector/) is built from the Go module proxy by
build-collector.sh and cached outside the tree; `make otelcol` builds it before the tests, which must not
download.

    with running_collector(tmp_path) as collector:
        ...  # POST spans over OTLP/HTTP to collector.endpoint + "/v1/traces" (plaintext)
        spans = collector.spans(min_count=2)
"""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILD_SH = Path(__file__).with_name("build-collector.sh")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def collector_bin() -> Path:
    """The collector binary: build-collector.sh's (a no-op once built; about 1.5 minutes cold)."""
    done = subprocess.run(["bash", str(BUILD_SH)], stdout=subprocess.PIPE, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"e2e/tracing/build-collector.sh failed with exit code {done.returncode}")
    return Path(done.stdout.strip().splitlines()[-1]) / "otelcol"


@dataclass(frozen=True)
class Collector:
    """One running collector: OTLP/HTTP (plaintext) at ``endpoint``, every span written to ``spans_file``."""

    endpoint: str
    spans_file: Path
    log_file: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def spans(self, *, min_count: int = 1, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """Every span written so far, once there are at least ``min_count`` (TimeoutError after
        ``timeout_s``): the raw OTLP JSON span with its ``attributes`` as a plain dict and its resource's
        attributes under ``resource``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = read_spans(self.spans_file)
            if len(spans) >= min_count:
                return spans
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the collector exited ({self.process.returncode}) with {len(spans)} of {min_count} "
                    f"spans written:\n{log_tail(self.log_file)}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(spans)} of {min_count} spans in {self.spans_file} after {timeout_s:g}s; "
                    f"the collector's log:\n{log_tail(self.log_file)}"
                )
            time.sleep(0.05)


@contextlib.contextmanager
def running_collector(tmp_dir: Path) -> Iterator[Collector]:
    """A collector on a free loopback port, writing to ``tmp_dir``; stopped on exit."""
    binary = collector_bin()
    port = free_port()
    spans_file = tmp_dir / "spans.json"
    config = tmp_dir / "otelcol.yaml"
    log_file = tmp_dir / "otelcol.log"
    # JSON is YAML, and needs no quoting rules for the paths.
    config.write_text(json.dumps(collector_config(port, spans_file), indent=2))
    with log_file.open("wb") as log:
        # The log goes to a file, not a pipe nobody drains, so the collector never blocks on it.
        proc = subprocess.Popen(
            [str(binary), f"--config=file:{config}"], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    try:
        wait_for_port(proc, port, log_file)
        yield Collector(f"http://127.0.0.1:{port}", spans_file, log_file, proc)
    finally:
        stop(proc)


def collector_config(port: int, spans_file: Path) -> dict[str, Any]:
    """The collector's configuration: OTLP/HTTP on loopback ``port`` into the file exporter."""
    return {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{port}"}}}},
        "exporters": {
            # No `rotation` key: unrotated output is buffered and flushed on this interval (1 s by
            # default), so the spans show up in the file promptly.
            "file": {"path": str(spans_file), "format": "json", "flush_interval": "100ms"},
        },
        "service": {
            # The collector's own metrics would listen on localhost:8888 by default: off, so that
            # collectors in parallel do not collide.
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
        },
    }


def free_port() -> int:
    """A loopback port free right now (the collector binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(proc: subprocess.Popen[bytes], port: int, log_file: Path) -> None:
    """Until the receiver accepts on ``port``: RuntimeError if the collector exits or START_TIMEOUT_S
    passes first. The receiver starts after the exporters, so an accepting port means a ready pipeline."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the collector exited ({proc.returncode}) before listening on 127.0.0.1:{port}:\n"
                f"{log_tail(log_file)}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the collector was not listening on 127.0.0.1:{port} after {START_TIMEOUT_S:g}s:\n"
                f"{log_tail(log_file)}"
            )
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the collector shuts down gracefully, flushing the file), SIGKILL if that takes too long."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


def log_tail(log_file: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ------------------------------------------------------------------------------ the file exporter's JSON


def read_spans(spans_file: Path) -> list[dict[str, Any]]:
    """The spans in the file exporter's output: one OTLP JSON ExportTraceServiceRequest a line. A last
    line without its newline is still being written (the exporter's buffer was flushed mid-line) and is
    left for the next read."""
    try:
        text = spans_file.read_text()
    except FileNotFoundError:  # the exporter creates it when it starts
        return []
    out: list[dict[str, Any]] = []
    for line in text.split("\n")[:-1]:
        if not line.strip():
            continue
        for resource_spans in json.loads(line).get("resourceSpans", []):
            resource = attributes(resource_spans.get("resource", {}).get("attributes", []))
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    flat = attributes(span.get("attributes", []))
                    out.append({**span, "attributes": flat, "resource": resource})
    return out


def attributes(key_values: list[dict[str, Any]]) -> dict[str, Any]:
    """OTLP JSON attributes (``[{"key": k, "value": AnyValue}]``) as a plain ``{k: value}`` dict."""
    return {kv["key"]: any_value(kv.get("value", {})) for kv in key_values}


def any_value(value: dict[str, Any]) -> Any:
    """One OTLP JSON AnyValue as Python: 64-bit ints are strings in OTLP JSON, bytes are base64, and an
    empty array or kvlist may come without its ``values``."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])  # float() also takes the "NaN"/"Infinity" spellings
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None  # an empty AnyValue
