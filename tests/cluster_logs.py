"""What a failed test shows of its cluster's logs, so that a failure in CI explains itself.

A cluster's processes log to ``<log_dir>/<name>.log``, which CI does not keep;
the report of a failed test carries, per log, every warning and error (with
its traceback) and the last records.
"""

from __future__ import annotations

import re
from pathlib import Path

# A record's first line: "2026-11-27 20:56:04,396 INFO name message".
_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ")
_NOTABLE_LEVELS = {"WARNING", "ERROR", "CRITICAL"}


def log_records(text: str) -> list[str]:
    """The log's records, each with its continuation lines (a traceback)."""
    records: list[str] = []
    for line in text.splitlines():
        if _RECORD_START.match(line) or not records:
            records.append(line)
        else:
            records[-1] += "\n" + line
    return records


def log_excerpt(text: str, num_last: int = 15, max_chars: int = 6000) -> str:
    """The warnings and errors, then the last ``num_last`` records (each once, in
    order), cut to the last ``max_chars`` characters."""
    records = log_records(text)
    last = len(records) - num_last
    kept = [r for i, r in enumerate(records)
            if i >= last or (m := _RECORD_START.match(r)) and m.group(1) in _NOTABLE_LEVELS]
    excerpt = "\n".join(kept)
    return excerpt if len(excerpt) <= max_chars else "..." + excerpt[-max_chars:]


def cluster_log_sections(log_dir: Path) -> list[tuple[str, str]]:
    """One (title, excerpt) per process log under ``log_dir``."""
    return [(f"log {path.name}", log_excerpt(path.read_text(errors="replace")))
            for path in sorted(log_dir.glob("*.log"))]
