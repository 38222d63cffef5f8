"""stepguard.otel: off by default; on but without the OpenTelemetry
packages, one warning and nothing else; with them, a handler per logger
whose records reach the console and an OTLP/HTTP collector with the
resource attributes from the JSON file.  Each case runs in a fresh
interpreter, since the module keeps which loggers it has set up."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

PROBE = textwrap.dedent("""
    import json, logging, os, sys
    if os.environ.get("PROBE_BLOCK_OTEL"):
        sys.modules["opentelemetry"] = None  # import fails as if not installed
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    import stepguard
    from stepguard import otel
    for name in ("torchft_quorums", "torchft_commits", "torchft_errors", "torchft_quorums"):
        otel.setup_logger(name)
    log = logging.getLogger("torchft_commits")
    log.info("", extra={"step": 3, "commit_result": True})
    otel.shutdown()
    print(json.dumps({n: len(logging.getLogger(n).handlers)
                      for n in ("torchft_quorums", "torchft_commits", "torchft_errors")}))
    print(json.dumps({"torch_imported": "torch" in sys.modules}))
""")


def run_probe(env_extra: dict[str, str], *, block_otel: bool = False,
              with_stdout: bool = False) -> Any:
    """Runs PROBE in a fresh interpreter; ``block_otel`` makes the
    opentelemetry packages unimportable there, as if not installed."""
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("USE_OTEL") and not k.endswith("OTEL_RESOURCE_ATTRIBUTES_JSON")}
    env.update(env_extra)
    if block_otel:
        env["PROBE_BLOCK_OTEL"] = "1"
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    result = (json.loads(lines[-2]), json.loads(lines[-1]), p.stderr)
    return (*result, p.stdout) if with_stdout else result


def test_off_by_default() -> None:
    handlers, info, err = run_probe({})
    assert handlers == {"torchft_quorums": 0, "torchft_commits": 0, "torchft_errors": 0}
    assert "OpenTelemetry" not in err
    assert not info["torch_imported"], "stepguard.otel imported torch"


@pytest.mark.parametrize("var", ["TORCHFT_USE_OTEL", "STEPGUARD_USE_OTEL"])
def test_explicit_false_is_off(var: str) -> None:
    handlers, _, err = run_probe({var: "false"})
    assert sum(handlers.values()) == 0
    assert "OpenTelemetry" not in err


@pytest.mark.parametrize("var", ["TORCHFT_USE_OTEL", "STEPGUARD_USE_OTEL"])
def test_on_without_packages_warns_once(var: str) -> None:
    handlers, info, err = run_probe({var: "true"}, block_otel=True)
    assert sum(handlers.values()) == 0
    warnings = [ln for ln in err.splitlines() if "OpenTelemetry is not installed" in ln]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("WARNING stepguard.otel")
    assert "opentelemetry-sdk" in warnings[0] and "opentelemetry-exporter-otlp-proto-http" in warnings[0]
    assert not info["torch_imported"]


class Collector:
    """An OTLP/HTTP endpoint on 127.0.0.1 (port 0) that keeps what it is
    sent."""

    def __init__(self) -> None:
        bodies = self.bodies = []
        paths = self.paths = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                bodies.append(body)
                paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/logs"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_on_with_packages_exports(tmp_path: Path) -> None:
    """With the real OpenTelemetry packages: one handler per logger although
    one is set up twice, and a record reaches the console exporter and an
    OTLP/HTTP collector with the logger's resource attributes."""
    pytest.importorskip("opentelemetry.sdk._logs",
                        reason="the OpenTelemetry packages are not installed")
    attrs = tmp_path / "attrs.json"
    attrs.write_text(json.dumps({"torchft_commits": {"service.name": "trainer-7"}}))
    collector = Collector()
    try:
        handlers, _, err, out = run_probe(
            {"TORCHFT_USE_OTEL": "true",
             "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON": str(attrs),
             "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": collector.url},
            with_stdout=True)
    finally:
        collector.close()
    assert "not installed" not in err, err
    assert handlers == {"torchft_quorums": 1, "torchft_commits": 1, "torchft_errors": 1}
    assert collector.paths == ["/v1/logs"], err[-2000:]
    body = collector.bodies[0]
    assert b"trainer-7" in body and b"commit_result" in body
    assert '"commit_result": true' in out and "trainer-7" in out


def test_bad_attributes_file_does_not_fail(tmp_path: Path) -> None:
    """An unreadable attributes file is a warning, not an import error."""
    bad = tmp_path / "attrs.json"
    bad.write_text("{not json")
    handlers, _, err = run_probe({"TORCHFT_USE_OTEL": "true",
                                  "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON": str(bad)},
                                 block_otel=True)
    assert sum(handlers.values()) == 0
    assert "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON" in err
