"""tests/serial_lock.py: tests share the main lock, a serial one waits for the others and holds back those that
come after it (each lock is its own open file, so threads of one process contend as the workers do)."""

import threading
import time

from tests.serial_lock import turn


def _enter(folder, alone: bool, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def body() -> None:
        with turn(folder, alone=alone):
            entered.set()
            leave.wait(10)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_shared_turns_run_together_and_an_alone_one_waits_for_them(tmp_path):
    first, second, alone, late = (threading.Event() for _ in range(4))
    leave_first, leave_second, leave_alone, leave_late = (threading.Event() for _ in range(4))
    threads = [_enter(tmp_path, False, first, leave_first), _enter(tmp_path, False, second, leave_second)]
    assert first.wait(5) and second.wait(5), "two shared turns did not run together"
    threads.append(_enter(tmp_path, True, alone, leave_alone))
    time.sleep(0.2)
    assert not alone.is_set(), "a serial test ran beside others"
    threads.append(_enter(tmp_path, False, late, leave_late))
    time.sleep(0.2)
    assert not late.is_set(), "a test that came after the waiting serial one went before it"
    leave_first.set()
    time.sleep(0.2)
    assert not alone.is_set(), "a serial test ran beside one still running"
    leave_second.set()
    assert alone.wait(5), "the serial test never ran"
    time.sleep(0.2)
    assert not late.is_set(), "a test ran beside the serial one"
    leave_alone.set()
    assert late.wait(5), "the test behind the serial one never ran"
    leave_late.set()
    for thread in threads:
        thread.join(5)
