"""prometheus_client's Histogram and Counter, written without their locks: the router writes its
metrics from its one event loop only (HTTP, gRPC and the Ray calls all run there), so no two
writers ever race.

A request is observed seven times (its prompt, phases, first token, inter-token gaps, end) and
counted twice. prometheus_client takes a lock for each add, and finds a histogram's bucket with
a Python loop over its bounds: on the loop that takes in a burst, that was most of what the metrics
cost a request. These add to the same values without the lock and find the bucket by bisection;
everything else — children, collection, the exposition — is prometheus_client's own
(tests/test_loop_metrics.py compares the two). Where values are not plain floats behind a mutex
(prometheus_client's multiprocess mode) they add as prometheus_client does."""

from bisect import bisect_left

from prometheus_client import Counter, Histogram, values


def _plain() -> bool:
    return values.ValueClass is values.MutexValue


class LoopHistogram(Histogram):
    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount != amount or not _plain():  # (NaN falls in no bucket)
            return super().observe(amount, exemplar)
        self._raise_if_not_observable()
        self._sum._value += amount
        # The first bucket whose bound is >= amount, as Histogram.observe's loop finds it (the last is +Inf).
        self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1

    def observe_all(self, amounts: list[float]) -> None:
        """observe() each of `amounts`, in order (the sum added in the same order), with the checks
        and lookups paid once and each bucket's count added once: a turn of the loop's streamed
        tokens' gaps (router/token_tally.py)."""
        if not amounts:
            return
        total = self._sum._value
        for a in amounts:
            total += a
        if total != total or not _plain():  # a NaN among them (it falls in no bucket): one at a time
            for a in amounts:
                self.observe(a)
            return
        self._raise_if_not_observable()
        bounds, counts = self._upper_bounds, [0] * len(self._buckets)
        for a in amounts:
            counts[bisect_left(bounds, a)] += 1
        for bucket, n in zip(self._buckets, counts):
            if n:
                bucket._value += n
        self._sum._value = total


class LoopCounter(Counter):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount < 0 or not _plain():  # (a negative amount: Counter.inc's error)
            return super().inc(amount, exemplar)
        self._raise_if_not_observable()
        self._value._value += amount
