"""Ctrl-C through the user's code and a data server's wait.

The trainer's SIGINT handler only asks for a stop after the step (the step finishes, a
checkpoint is saved), which a reward function that never returns, or a data server that never
answers, would hold off for ever (or for online_dataserver_timeout). While such a call runs,
``Interruptible`` makes SIGINT raise KeyboardInterrupt in it instead, and a second SIGINT end the
process at once (exit 130, one line on stderr): a function that swallows the first, or one stuck
in C code where no Python handler runs, cannot hold the run. The second is seen by a watchdog
thread reading the signal wakeup fd (written by the C-level handler whatever the main thread is
doing). Off the main thread (where no handler can be set) it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

EXIT_INTERRUPTED = 130


class Interruptible:
    """``with Interruptible(what) as watch:`` the block as above; ``watch.interrupted``: whether
    a SIGINT came. A SIGINT the block swallowed and returned from is handed to the handler it
    replaced (the trainer's: stop after this step) on the way out."""

    def __init__(self, what: str):
        self.what = what
        self.interrupted = False
        self.began = 0.0
        self._active = False

    def __enter__(self) -> Interruptible:
        self.began = time.monotonic()
        if threading.current_thread() is not threading.main_thread():
            return self
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_handler = signal.signal(signal.SIGINT, self._on_sigint)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watchdog = threading.Thread(target=self._watch, args=(read,), daemon=True)
        self._watchdog.start()
        self._active = True
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if not self._active:
            return
        self._active = False
        signal.set_wakeup_fd(self._old_fd)
        old = self._old_handler
        signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
        os.close(self._write)  # the watchdog reads the end of its pipe and returns
        self._watchdog.join(timeout=5)
        if self.interrupted and kind is None and callable(self._old_handler):
            self._old_handler(signal.SIGINT, None)

    def seconds(self) -> float:
        return time.monotonic() - self.began

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def _watch(self, read: int) -> None:
        seen = 0
        try:
            while data := os.read(read, 512):
                seen += data.count(signal.SIGINT.value)
                if seen >= 2:
                    line = (
                        f"torchneox: interrupted: {self.what} did not return after SIGINT; a "
                        "second SIGINT ended the run (nothing of this step was saved)\n"
                    )
                    os.write(2, line.encode("utf-8", "replace"))
                    os._exit(EXIT_INTERRUPTED)
        finally:
            os.close(read)
