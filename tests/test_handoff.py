"""The router's hand-offs: the requests of one turn of its event loop go to a worker as one call,
each gets its own answer, and a failed call fails every request of its batch."""

import asyncio

import pytest

from pdserve.router.handoff import HandOff


class FakeWorker:
    """Records each call's batch; answers every item with its double, or fails the whole call."""

    def __init__(self, fail: bool = False):
        self.batches: list[list] = []
        self.fail = fail

    def send(self, items: list):
        self.batches.append(list(items))

        async def answer():
            await asyncio.sleep(0.01)
            if self.fail:
                raise RuntimeError("the worker died")
            return [2 * i for i in items]
        return answer()


def test_a_turns_requests_go_in_one_call_and_each_gets_its_answer():
    async def main():
        worker = FakeWorker()
        handoff = HandOff(worker.send)
        answers = await asyncio.gather(*(handoff(i) for i in range(5)))
        later = await handoff(7)  # a later turn: a batch of its own
        return worker.batches, answers, later

    batches, answers, later = asyncio.run(main())
    assert batches == [[0, 1, 2, 3, 4], [7]]
    assert answers == [0, 2, 4, 6, 8] and later == 14


def test_a_failed_call_fails_every_request_of_its_batch():
    async def main():
        handoff = HandOff(FakeWorker(fail=True).send)
        return await asyncio.gather(*(handoff(i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) for r in results)


def test_unanswered_calls_are_batched_and_return_nothing():
    async def main():
        batches = []
        handoff = HandOff(batches.append, answered=False)  # like an abort's call: nothing comes back
        assert handoff("a") is None and handoff("b") is None
        await asyncio.sleep(0.05)
        return batches

    assert asyncio.run(main()) == [["a", "b"]]
