"""Logging setup for the daemon: one line per event, text or JSON, stderr or a file.

Under systemd, stderr goes to the journal (the default). ``--log-file`` writes to a file
instead; :func:`reopen_logs` (called on SIGHUP) reopens it, so logrotate can move the
file away and signal the server (``postrotate``/``systemctl reload``).
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and exception)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str = "text", log_file: str = "") -> None:
    """Route every log record to stderr, or append to ``log_file`` if given.

    Raises ``OSError`` if ``log_file`` cannot be opened for appending.
    """
    handler: logging.Handler
    if log_file:
        handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())


def reopen_logs() -> list[str]:
    """Reopen every log file of the root logger (after rotation); returns their paths.

    A file that cannot be reopened keeps its old stream, and the error is logged
    there, so logging never stops.
    """
    reopened = []
    for h in logging.getLogger().handlers:
        if not isinstance(h, logging.FileHandler):
            continue
        try:
            stream = open(h.baseFilename, "a", encoding=h.encoding)
        except OSError as e:
            logging.getLogger(__name__).error("cannot reopen log file %s: %s", h.baseFilename, e)
            continue
        old = h.setStream(stream)
        if old is not None:
            old.close()
        reopened.append(h.baseFilename)
    return reopened
