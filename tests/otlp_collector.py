"""A minimal OpenTelemetry collector for tests: an HTTP server that takes OTLP/HTTP JSON trace
exports (``POST /v1/traces``) and keeps the spans, each with its resource's attributes."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def attrs(items: list[dict]) -> dict:
    """OTLP JSON attributes as a plain dict (ints back from their strings)."""
    out = {}
    for a in items:
        (kind, v), = a["value"].items()
        out[a["key"]] = int(v) if kind == "intValue" else v
    return out


class Collector:
    def __init__(self) -> None:
        self.spans: list[dict] = []  # each span as sent, plus "service" (its resource's service.name)
        self.requests: list[tuple[str, dict]] = []  # (path, headers with lowercase names)
        # the answers to give the next exports instead of taking them: (status, Retry-After or None)
        self.refusals: list[tuple[int, str | None]] = []
        lock = threading.Lock()
        spans, requests, refusals = self.spans, self.requests, self.refusals

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                    if refusals:
                        status, retry_after = refusals.pop(0)
                        self.send_response(status)
                        if retry_after is not None:
                            self.send_header("Retry-After", retry_after)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    for rs in body["resourceSpans"]:
                        resource = attrs(rs["resource"]["attributes"])
                        for ss in rs["scopeSpans"]:
                            for span in ss["spans"]:
                                spans.append({**span, "service": resource.get("service.name"),
                                              "attrs": attrs(span.get("attributes", []))})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, found, what: str, timeout: float = 30.0):
        """``found(spans)`` once it is truthy (spans: every span so far)."""
        deadline = time.monotonic() + timeout
        while not (got := found(list(self.spans))):
            assert time.monotonic() < deadline, f"no {what} in {len(self.spans)} spans"
            time.sleep(0.1)
        return got

    def trace(self, trace_id: str, names: set[str], timeout: float = 30.0) -> dict[str, dict]:
        """The spans of ``trace_id`` by name, once every one of ``names`` has come."""
        def found(spans):
            got = {s["name"]: s for s in spans if s["traceId"] == trace_id}
            return got if names <= got.keys() else None

        return self.wait(found, f"{sorted(names)} of trace {trace_id}", timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
