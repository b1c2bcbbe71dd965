"""What every service process does the same way: log lines, shutdown signals,
and dying with the process that started it."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


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


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """``argv``, run so that it gets SIGTERM when the calling process dies, however
    it dies (Linux; elsewhere ``argv`` as it is).

    A small launcher (``python -m services.common.process``) sets the signal on
    itself and then execs ``argv``, which keeps it: no Python runs between fork
    and exec, where gRPC's fork handlers make that unsafe.
    """
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-m", "services.common.process", str(os.getpid()), *argv]


def _launch(parent_pid: int, argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _launch(int(sys.argv[1]), sys.argv[2:])
