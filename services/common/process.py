"""What every service's ``main`` does the same way: log lines and shutdown signals."""

from __future__ import annotations

import asyncio
import logging
import signal

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def configure_logging(level: str = "INFO") -> None:
    """The structured ``event=...`` lines every service writes, at ``level``."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def wait_for_shutdown_signal() -> None:
    """Returns once SIGTERM or SIGINT arrives (call from the main thread's loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in SHUTDOWN_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in SHUTDOWN_SIGNALS:
            loop.remove_signal_handler(sig)
