"""OpenTelemetry export of the structured log records (opt-in).

The Manager writes one record per quorum change to ``torchft_quorums``, one
per commit vote to ``torchft_commits``, and process-group aborts go to
``torchft_errors``; each carries its fields (job, replica, rank, quorum,
step, ...) as ``extra``.  :func:`setup_logger` attaches an OpenTelemetry
handler to such a logger, exporting to the console and over OTLP/HTTP, when

* ``TORCHFT_USE_OTEL`` (or ``STEPGUARD_USE_OTEL``) is set to anything but
  ``false`` (torchft's rule; ``false`` is the default), and
* the ``opentelemetry-api``, ``-sdk`` and ``-exporter-otlp-proto-http``
  packages are installed.

Without the packages it logs one warning saying what to install and does
nothing: importing stepguard never fails for want of them.
``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON`` (or ``STEPGUARD_...``) names a
JSON file ``{logger_name: {attribute: value}}`` whose entry for the logger
becomes the OpenTelemetry resource's attributes.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Dict, List, Optional

from stepguard import config

__all__ = ["TeeLogExporter", "main", "setup_logger", "shutdown"]

USE_OTEL_ENV: str = "TORCHFT_USE_OTEL"
TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON: str = "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON"

_log: logging.Logger = logging.getLogger(__name__)


class _Registry:
    """The providers made so far, by logger name, and whether the
    missing-package warning was given (module state, under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.providers: Dict[str, Any] = {}
        self.warned = False


_REGISTRY = _Registry()


def _enabled() -> bool:
    return bool(config.get("TORCHFT_USE_OTEL"))


def _resource_attributes(name: str) -> Optional[Dict[str, Any]]:
    """The logger's entry in the attributes file, None without one."""
    path = config.get("TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON")
    if not path:
        return None
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object of logger names")
    entry = table.get(name)
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: the entry for {name!r} must be an object")
    return entry


class TeeLogExporter:
    """Hands each batch of log records to every one of ``exporters``
    (duck-typed as an OpenTelemetry ``LogRecordExporter``, so that this
    module imports without OpenTelemetry).

    Args:
        exporters: the exporters, called in order.
    """

    def __init__(self, exporters: List[Any]) -> None:
        self._exporters = list(exporters)

    def export(self, batch: Any) -> Any:
        """Exports ``batch`` with every exporter; the first failure's
        result, else the first result."""
        results = [e.export(batch) for e in self._exporters]
        for r in results:
            if getattr(r, "name", "SUCCESS") != "SUCCESS":
                return r
        return results[0] if results else None

    def shutdown(self) -> None:
        for e in self._exporters:
            e.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        ok = True
        for e in self._exporters:
            flush = getattr(e, "force_flush", None)
            if flush is not None:
                ok = bool(flush(timeout_millis)) and ok
        return ok


def _make_provider(attributes: Optional[Dict[str, Any]]) -> Any:
    """A LoggerProvider exporting to the console and OTLP/HTTP in batches.
    Raises ImportError without the OpenTelemetry packages."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs import export
    from opentelemetry.sdk.resources import Resource

    # renamed from ConsoleLogExporter in newer releases
    console = getattr(export, "ConsoleLogRecordExporter", None) or export.ConsoleLogExporter
    tee = TeeLogExporter([console(), OTLPLogExporter(timeout=5)])
    resource = Resource.create(attributes) if attributes is not None else Resource.create()
    provider = LoggerProvider(resource=resource)
    provider.add_log_record_processor(export.BatchLogRecordProcessor(tee))
    return provider


def setup_logger(name: str) -> None:
    """Exports the records of ``logging.getLogger(name)`` with
    OpenTelemetry when enabled (see the module's description); otherwise,
    and on every later call for the same name, does nothing.

    Args:
        name: the logger's name.
    """
    if not _enabled():
        return
    with _REGISTRY.lock:
        if name in _REGISTRY.providers:
            return
        try:
            attributes = _resource_attributes(name)
        except (OSError, ValueError) as e:
            _log.warning(
                "%s: %s; using the default resource attributes for %s",
                TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON,
                e,
                name,
            )
            attributes = None
        try:
            provider = _make_provider(attributes)
            from opentelemetry.sdk._logs import LoggingHandler
        except ImportError as e:
            if not _REGISTRY.warned:
                _REGISTRY.warned = True
                _log.warning(
                    "%s is set but OpenTelemetry is not installed (%s): structured logs "
                    "are not exported; install opentelemetry-api, opentelemetry-sdk and "
                    "opentelemetry-exporter-otlp-proto-http, or unset it",
                    USE_OTEL_ENV,
                    e,
                )
            _REGISTRY.providers[name] = None
            return
        _REGISTRY.providers[name] = provider
    logger = logging.getLogger(name)
    logger.addHandler(LoggingHandler(level=logging.NOTSET, logger_provider=provider))
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def shutdown() -> None:
    """Flushes and shuts down every provider made by :func:`setup_logger`."""
    with _REGISTRY.lock:
        providers = [p for p in _REGISTRY.providers.values() if p is not None]
    for provider in providers:
        provider.shutdown()


def main() -> None:
    """Sends one record through ``torchft_test`` (OTel must be enabled by
    the environment), then shuts down: a check of the export setup."""
    setup_logger("torchft_test")
    logging.getLogger("torchft_test").info(
        "", extra={"job_id": "test", "replica_id": "0", "rank": 0, "step": 0}
    )
    shutdown()


if __name__ == "__main__":
    main()
