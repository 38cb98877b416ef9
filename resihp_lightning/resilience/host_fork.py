"""Starts the store host by forking the process that needs it, instead of a new interpreter.

A new interpreter spends about 1.5 s of CPU importing torch before its ``TCPStore`` server listens,
and every job start waits for that. A process that already imported torch can fork the host instead:
it listens at once and costs nothing to start. The price is memory: the host keeps every page the
process had at the fork for as long as it lives (the pages stay shared until one side writes them,
but the process can no longer give them back to the system). So this is for processes that hold
little at that point (a test's ranks), not for a job whose model is already in memory when the
strategy sets up; :class:`~resihp_lightning.resilience.store.StoreConfig` (``start_method``) chooses.

The forked host is what ``python -m resihp_lightning.resilience.store_host --detach`` would be: a
grandchild in a session of its own (its parent exits at once, so nobody has to reap it), stdin from
``/dev/null``, stdout and stderr into the host's log, no other file descriptor of the process, default
signal handling and its own logging; it ends with ``os._exit`` (no ``atexit`` handler of the process
runs in it).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

#: Signals whose handlers the process may have set (Lightning, the launcher, the application).
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
            signal.SIGALRM)


def fork_store_host(argv: list[str], log_path: Path) -> None:
    """Forks a store host that runs ``resihp_lightning.resilience.store_host.main(argv)``.

    Returns once the intermediate child has exited (at once); the host runs on by itself.

    Args:
        argv: the host's command-line arguments, without ``--detach``.
        log_path: the host's log file (appended to).
    """
    from resihp_lightning.resilience import store_host

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                if os.fork() == 0:
                    _leave_the_process(log_fd)
                    code = store_host.main(argv)
                else:
                    code = 0
            except BaseException:  # noqa: BLE001 - reported in the log; a forked child must never return
                logging.getLogger("resihp_lightning.resilience.store_host").exception("the forked store host failed")
            finally:
                os._exit(code)
        os.waitpid(pid, 0)
    finally:
        os.close(log_fd)


def _leave_the_process(log_fd: int) -> None:
    """Drops what the forked host inherited from the process: its files, signal handlers and logging."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, _max_fd())
    for signum in _HANDLED:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    faulthandler.cancel_dump_traceback_later()
    faulthandler.disable()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own standard streams from now on
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # The process's handlers write to its files (now closed): the host configures its own.
    for logger in [logging.getLogger()] + [
        item for item in logging.Logger.manager.loggerDict.values() if isinstance(item, logging.Logger)
    ]:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    logging.getLogger("resihp_lightning").addHandler(logging.NullHandler())


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1 << 16
