"""The engine loop takes work between its steps: items submitted to its inbox in the order they
came, on its own thread, before the next step (a napping loop wakes for them); and calls that must
touch the engine otherwise (a KV handshake) get the lock at the next step boundary, not when the
loop happens to nap (with a plain lock, the loop won every time)."""

import threading
import time

from pdserve.worker.engine_loop import EngineLoop


def test_a_call_gets_the_lock_at_the_next_step_boundary():
    steps = 0

    def step():  # always more to do right away, like a busy engine
        nonlocal steps
        steps += 1
        time.sleep(0.002)  # the GIL is free meanwhile, as during a GPU step
        return None

    loop = EngineLoop(step, lambda item: None, "busy-loop")
    try:
        while steps < 3:
            time.sleep(0.001)
        waited = []
        for _ in range(20):
            before = steps
            with loop.lock:
                waited.append(steps - before)  # steps the loop began while this call waited
            time.sleep(0.003)
        assert max(waited) <= 2, f"steps run while a call waited for the lock: {waited}"
        assert loop.alive()
    finally:
        loop.stop()


def test_lock_is_exclusive_and_first_come_first_served():
    loop = EngineLoop(lambda: 1.0, lambda item: None, "idle-loop")  # naps: the lock is free
    inside, order = [], []
    try:
        loop.lock.acquire()  # hold it while three callers line up
        started = []

        def call(i):
            started.append(i)
            with loop.lock:
                inside.append(i)
                assert len(inside) == 1, "two holders at once"
                order.append(i)
                time.sleep(0.001)
                inside.remove(i)

        threads = []
        for i in range(3):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            while len(started) <= i:  # the next one asks only after this one asked
                time.sleep(0.001)
            time.sleep(0.01)
        loop.lock.release()
        for t in threads:
            t.join(timeout=5)
        assert order == [0, 1, 2]
    finally:
        loop.stop()


def test_submitted_work_is_taken_in_order_on_the_loops_thread_before_the_next_step():
    taken, steps = [], []

    def take(item):
        taken.append((item, threading.current_thread().name))

    def step():
        steps.append(len(taken))
        return 10.0  # a long nap: only new work ends it early

    loop = EngineLoop(step, take, "inbox-loop")
    try:
        while not steps:
            time.sleep(0.001)
        t0 = time.monotonic()
        for i in range(5):
            loop.submit(i)
        while len(steps) < 2:
            assert time.monotonic() - t0 < 2, "the napping loop did not wake for new work"
            time.sleep(0.001)
        assert [i for i, _ in taken] == [0, 1, 2, 3, 4]
        assert {name for _, name in taken} == {"inbox-loop"}
        assert steps[1] == 5  # all five were taken before the step that followed
    finally:
        loop.stop()


def test_a_loop_that_dies_says_so_once_and_stops():
    # A worker passes on_death = exit its process (the controller then replaces it); here, a record.
    died = []

    def step():
        raise RuntimeError("a kernel failed")

    loop = EngineLoop(step, lambda item: None, "dying-loop", on_death=died.append)
    deadline = time.monotonic() + 5
    while loop.alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(died) == 1 and isinstance(died[0], RuntimeError) and loop.error is died[0]
