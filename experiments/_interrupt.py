"""Ctrl-C as one line and exit status 130, from the first import of a command on.

Standard library only, so that a command can install it before it imports torch (an import
of torch is where a Ctrl-C most often lands)."""

from __future__ import annotations

import signal
import sys
import threading

INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


def exit_on_interrupt(prog: str) -> None:
    """Make SIGINT raise ``SystemExit(130)`` after one line on stderr naming ``prog``.

    SystemExit unwinds like any exception, so ``finally`` blocks run (an atomic write removes
    its temporary file) and no traceback is printed. Only from the main thread (Python
    delivers signals there alone)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no second line
        sys.stderr.write(f"{prog}: interrupted (Ctrl-C); no file was left half-written\n")
        raise SystemExit(INTERRUPTED_STATUS)

    signal.signal(signal.SIGINT, handle)
