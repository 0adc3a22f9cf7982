"""A sampler whose broker keeps failing says so loudly, with the broker's own reason."""

import logging

from echorl.client import BrokerUnavailable
from echorl.sampler import loop
from echorl.sampler.loop import Outage


def test_a_long_outage_is_an_error_with_the_brokers_reason(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    outage = Outage("s1")
    failure = BrokerUnavailable(500, "Internal Server Error: task 'x' raised KeyError")
    with caplog.at_level(logging.WARNING, logger="echorl.sampler"):
        outage.failed(failure)  # the first failure: a warning, retried
        clock[0] += 30
        outage.failed(failure)
        assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
        clock[0] += 31  # a minute of nothing but failures
        outage.failed(failure)
        clock[0] += 10  # then not again for a minute
        outage.failed(failure)
        clock[0] += 60
        outage.failed(failure)
    levels = [r.levelname for r in caplog.records]
    assert levels == ["WARNING", "WARNING", "ERROR", "WARNING", "ERROR"]
    alarm = caplog.records[2].getMessage()
    assert "FAILED EVERY CALL FOR 61 s" in alarm and "task 'x' raised KeyError" in alarm
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="echorl.sampler"):
        outage.over()  # the broker answers again: said once, and the clock is reset
        outage.failed(failure)
    assert "answers again" in caplog.records[0].getMessage()
    assert outage.since == clock[0]  # a new outage starts counting from now
