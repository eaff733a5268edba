"""Prometheus text exposition (format 0.0.4), written here so names come out
exactly as given: Triton's counters carry no `_total` suffix
(`nv_inference_request_success`), which prometheus_client would add, and
Triton's dashboards and alerts look for them by those names.

`Family` is one metric with its samples; `render` writes families as text;
`serve` answers `/metrics` from a function that returns them, on its own
thread. Pure apart from `serve`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tiered.telemetry.histogram import CumulativeHistogram

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = Mapping[str, str]


@dataclass
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def add(self, labels: Labels, value: float, suffix: str = "") -> None:
        self.samples.append((self.name + suffix, dict(labels), float(value)))

    def add_histogram(self, labels: Labels, histogram: CumulativeHistogram) -> None:
        running = 0
        for bound, count in zip((*histogram.bounds, math.inf), histogram.counts):
            running += count
            self.add({**labels, "le": _number(bound)}, running, "_bucket")
        self.add(labels, histogram.sum, "_sum")
        self.add(labels, running, "_count")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def _escape(value: str, quote: bool) -> str:
    value = value.replace("\\", "\\\\").replace("\n", "\\n")
    return value.replace('"', '\\"') if quote else value


def render(families: Iterable[Family]) -> str:
    lines = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape(family.help, quote=False)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for name, labels, value in family.samples:
            text = ",".join(f'{k}="{_escape(v, quote=True)}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {_number(value)}" if text
                         else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def serve(families: Callable[[], Sequence[Family]], host: str, port: int) -> ThreadingHTTPServer:
    """Answer GET /metrics on a daemon thread; the server knows its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = render(families()).encode()
            except Exception as error:  # a scrape never takes the server down
                log.exception("metrics could not be collected")
                self.send_error(500, f"metrics could not be collected: {error}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # scrapes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
