"""A router's streamed tokens, counted once per turn of its event loop instead of once per token.

Every streamed token used to add to vLLM's generation-token counter and, from a stream's second
wake on, observe its gap in two inter-token histograms (pdserve's and vLLM's), each a method call
with its own checks: about 1 us a token, a tenth of what the router spends on one where it keeps up
with its workers (docs/benchmarks.md, "Router streaming ceiling"). One worker frame brings a token
for hundreds of streams in one turn of the loop, so the tally keeps them and adds them in one pass
at the end of that turn (loop.call_soon). The series get the same observations in the same order,
and no reader sees them late: the tally is a collector of the registry, registered before the
series, so a collection (a scrape, get_sample_value) flushes it first; a reader of a series itself
(Metrics.traffic) flushes first."""

import asyncio

from pdserve.router.loop_metrics import LoopCounter, LoopHistogram


class TokenTally:
    def __init__(self):
        self._tokens_series: LoopCounter | None = None
        self._gap_series: tuple[LoopHistogram, ...] = ()
        self._tokens = 0
        self._gaps: list[float] = []
        self._due = False  # a flush is scheduled for the end of this turn

    def feed(self, tokens: LoopCounter, gaps: tuple[LoopHistogram, ...]) -> None:
        """The series it adds to (made after it is registered): tokens counts every token; each of
        gaps observes every inter-token gap."""
        self._tokens_series, self._gap_series = tokens, gaps

    # A collector of no series of its own (CollectorRegistry.register asks describe(), collect() flushes).
    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.flush()
        return []

    def add(self, n: int, gap: float | None = None) -> None:
        """`n` tokens of one stream's wake; gap: the wake's inter-token gap (None for the first)."""
        self._tokens += n
        if gap is not None:
            self._gaps.append(gap)
        if not self._due:
            self._due = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a test, a script): at once
                self.flush()

    def flush(self) -> None:
        self._due = False
        if self._tokens:
            self._tokens_series.inc(self._tokens)
            self._tokens = 0
        gaps, self._gaps = self._gaps, []
        for series in self._gap_series:
            series.observe_all(gaps)
