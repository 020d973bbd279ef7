"""The stop-signal helpers of `peerloom up` and `peerloom demo` (peerloom/experiment.py): a stop signal that
comes while a node process is being started and recorded waits until it is recorded, then is handled as
it would have been (a fleet must never hold a process it does not know of)."""

import os
import signal
import time

import pytest

from peerloom.experiment import signals_deferred, signals_ignored, signals_interrupt


def test_a_signal_inside_a_deferred_block_is_handled_when_the_block_ends():
    steps = []
    with signals_interrupt():
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                steps.append("recorded")  # the block finishes: the process it started is recorded
            steps.append("after")  # not reached: the signal interrupts here
    assert steps == ["recorded"]


def test_a_deferred_signal_that_was_ignored_stays_ignored():
    """Inside `signals_ignored` (a bounded stop) a deferred signal is delivered again to SIG_IGN: the stop goes on."""
    steps = []
    with signals_ignored():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        time.sleep(0.05)
        steps.append("stop went on")
    assert steps == ["stop went on"]
