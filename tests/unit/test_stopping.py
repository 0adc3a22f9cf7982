"""A stop signal: outside an idle section it only sets the event (the role finishes what it
holds); inside one it also cuts the blocking call short."""

import signal
import socket
import threading

import pytest

from echorl.stopping import Interrupted, Stop


@pytest.fixture
def stop():
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield Stop().on_signals()
    signal.signal(signal.SIGTERM, handlers[0])
    signal.signal(signal.SIGINT, handlers[1])


def test_a_signal_while_working_only_sets_the_event(stop):
    signal.raise_signal(signal.SIGTERM)
    assert stop.is_set()
    with pytest.raises(Interrupted), stop.idle():  # an idle section is not entered any more
        pass


def test_a_signal_while_idle_cuts_a_blocking_read_short(stop):
    left, right = socket.socketpair()
    main = threading.main_thread().ident  # as the kernel delivers a process's SIGTERM to it
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(Interrupted), stop.idle():
            left.settimeout(30.0)
            left.recv(1)  # nothing ever comes: only the signal ends it
    finally:
        timer.cancel()
        left.close()
        right.close()
    assert stop.is_set()
    signal.raise_signal(signal.SIGTERM)  # once out of the idle section, a signal is harmless
