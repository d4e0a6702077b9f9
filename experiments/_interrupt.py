"""Ctrl-C as one line and exit status 130, from the first import of a command on.

Standard library only, so that a command can install it before it imports torch (an import
of torch is where a Ctrl-C most often lands)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C

_interrupted = False  # set once `exit_on_interrupt`'s handler has run


def exit_on_interrupt(prog: str) -> None:
    """Make SIGINT raise ``SystemExit(130)`` after one line on stderr naming ``prog``.

    SystemExit unwinds like any exception, so ``finally`` blocks run (an atomic write removes
    its temporary file) and no traceback is printed. A library that catches every exception
    (a bare ``except:`` around an optional import) can swallow it: the process then still
    exits with 130 when it ends, a second Ctrl-C ends it at once, and the atomic writers
    (`raise_if_interrupted`) refuse to put a file under its final name. Only from the main
    thread (Python delivers signals there alone)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        global _interrupted
        if _interrupted:  # the first one was swallowed, or unwinding hangs: stop now
            _exit_interrupted()
        _interrupted = True
        raise SystemExit(report_interrupt(prog))

    def keep_the_status():  # registered first, so it runs after every other exit handler
        if _interrupted:
            _exit_interrupted()

    atexit.register(keep_the_status)
    signal.signal(signal.SIGINT, handle)


def raise_if_interrupted() -> None:
    """``SystemExit(130)`` if a Ctrl-C came and was swallowed: an atomic writer calls this
    just before its rename, so a run that went on after one never publishes its file (the
    writer's cleanup removes the temporary). The one line was printed when the signal came."""
    if _interrupted:
        raise SystemExit(INTERRUPTED_STATUS)


def report_interrupt(prog: str) -> int:
    """The one line a Ctrl-C prints (stderr); returns the status to exit with."""
    sys.stderr.write(f"{prog}: interrupted (Ctrl-C); no file was left half-written\n")
    return INTERRUPTED_STATUS


@contextlib.contextmanager
def ctrl_c_as_keyboard_interrupt():
    """Within: Ctrl-C raises KeyboardInterrupt, for code that stops cleanly on it (a sweep
    that keeps what it finished); outside, `exit_on_interrupt`'s handler again. Only from the
    main thread; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_interrupted() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to say
            pass
    os._exit(INTERRUPTED_STATUS)
