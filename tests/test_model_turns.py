"""``batching.model_turns.ModelTurns``: work held alone never overlaps an engine step
nor another such block, and a waiter goes before the engine's next step even when the
engine steps back to back."""

from __future__ import annotations

import threading

from mlxvlm.batching.model_turns import ModelTurns

TIMEOUT = 60.0


def test_work_alone_runs_between_steps_and_before_the_next_one():
    turns = ModelTurns()
    log: list[str] = []
    inside = threading.Event()
    release = threading.Event()
    stop = threading.Event()

    def engine():
        first = True
        while not stop.is_set():
            with turns.step():
                log.append("step")
                if first:  # the waiter arrives while this step runs
                    first = False
                    inside.set()
                    assert release.wait(TIMEOUT)

    def alone():
        with turns.alone():
            log.append("alone-start")
            log.append("alone-end")

    engine_thread = threading.Thread(target=engine)
    engine_thread.start()
    assert inside.wait(TIMEOUT)
    waiter = threading.Thread(target=alone)
    waiter.start()
    while not turns._waiting:  # the waiter is queued behind the running step
        threading.Event().wait(0.01)
    release.set()
    waiter.join(TIMEOUT)
    stop.set()
    engine_thread.join(TIMEOUT)
    # the engine stepped in a tight loop, yet the waiter came right after the first step
    assert log[:3] == ["step", "alone-start", "alone-end"]


def test_two_blocks_alone_do_not_overlap():
    turns = ModelTurns()
    holders = []
    most = []
    lock = threading.Lock()

    def alone():
        for _ in range(50):
            with turns.alone():
                with lock:
                    holders.append(1)
                    most.append(len(holders))
                threading.Event().wait(0.001)
                with lock:
                    holders.pop()

    threads = [threading.Thread(target=alone) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert max(most) == 1 and len(most) == 150
