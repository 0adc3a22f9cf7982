"""Stopping a role on SIGTERM or SIGINT: it finishes what it holds, then exits.

A role that is only waiting (a sampler's lease long poll, which holds no work until it answers)
need not wait the poll out: inside `Stop.idle()` the signal also raises `Interrupted` in the
main thread, which cuts the blocking call short. Anything the broker handed out in that instant
goes back when the role leaves.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """A stop signal that arrived while the main thread was idle (not an error: the role
    stops). A BaseException, as KeyboardInterrupt: no `except Exception` swallows it."""


class Stop(threading.Event):
    """Set by SIGTERM or SIGINT once `on_signals()` installed its handlers (main thread only)."""

    def __init__(self) -> None:
        super().__init__()
        self._idle = False

    def on_signals(self) -> Stop:
        signal.signal(signal.SIGTERM, self._signalled)
        signal.signal(signal.SIGINT, self._signalled)
        return self

    def _signalled(self, *_) -> None:
        self.set()
        if self._idle:
            self._idle = False  # once: what handles it may block again (e.g. leaving)
            raise Interrupted

    @contextmanager
    def idle(self) -> Iterator[None]:
        """A section that holds nothing: a stop signal inside it raises `Interrupted` here and
        now (the section is abandoned) instead of waiting for it to end."""
        if self.is_set():
            raise Interrupted
        self._idle = True
        try:
            yield
        finally:
            self._idle = False


def die_with_parent() -> None:
    """Linux: the kernel kills this (helper) process when its parent dies, however it dies
    (SIGKILL, or a signal re-raised after a graceful stop, which runs no exit handlers): no
    worker outlives the role it serves. Elsewhere a no-op (a pipe's EOF must end it). A
    parent that died before this call (a role killed while it starts its workers) is seen
    here: the worker exits at once."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # orphaned already
        os._exit(1)
