"""Structured outputs in the sampler: each constrained request's grammar matcher (llguidance) and the
token masks of a step's constrained rows.

A request's grammar (`SamplingParams.grammar`, an llguidance grammar the front end built from
response_format / structured_outputs / tool_choice) is compiled as the request arrives on this engine
(`compile`), on a pool of threads: a large JSON schema takes seconds to compile, and llguidance does it
without the GIL, so the engine's steps go on meanwhile. The engine holds the request out of its
scheduler until then (engine/grammar_gate.py). Its matcher is installed (`install`) advanced over the
tokens it generated before (on a decode replica: the first token the prefill replica sampled under the
same grammar, and a moved request's tokens so far), so no grammar state crosses the prefill → decode
hand-off or a migration.

The tokens a step samples are consumed late (`defer`, then `_settle`): by the next step's masks, once
that step's forward is queued, or by `ended_at`, when the engine reads the step's outputs. Never
later: a mask is always filled from matchers that saw every token before.

A step's masks are one batched fill (llguidance's executor, on its own threads, into one packed
bitmask [rows, ceil(vocab / 32)] int32 on the host) and one tensor op on the logits. The fill runs on
a thread of its own (`begin_mask`), started once the step's forward is queued; the sampler queues the
step's sampling (`apply_mask` first) only when the next step's batch or the step's result needs it
(sampler.SampledLater). So under overlap scheduling the fill runs beside the device's forward *and*
beside the engine thread's reading of the step before and building of the next — at a batch of 256
and a 152k vocabulary it is milliseconds, which on the engine's thread made the step host-bound.
The masks reach the device on a copy stream of their own (mask_words.py)."""

import logging
import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import torch

from pdserve.engine.host_lists import on_device
from pdserve.engine.mask_words import WordSlot, WordSlots
from pdserve.engine.sequence import PENDING, Sequence
from pdserve.structured_outputs import GrammarTokenizer


log = logging.getLogger(__name__)


class Grammars:
    """The matchers of this engine's constrained requests, by request id."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size  # the model's (its logits' width), which may exceed the tokenizer's
        self._ll = GrammarTokenizer(tokenizer, vocab_size)  # built by the first compile
        # llguidance's fill and consume threads, started with the first compile (every matcher comes
        # through compile): an engine that never sees a grammar starts none.
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None  # the compiles, started on first use
        self._compiling: dict[str, Future] = {}  # request id -> its matcher being built, not installed yet
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._ended: dict[str, int] = {}  # request id -> output tokens at which its grammar completed
        self._bitmask = torch.zeros(0, (vocab_size + 31) // 32, dtype=torch.int32)
        self._filler: ThreadPoolExecutor | None = None  # the fill thread (begin_mask), started on first use
        self._words = WordSlots((vocab_size + 31) // 32)
        self._bit_values: dict[torch.device, torch.Tensor] = {}  # bit_values() on each device
        # Steps' sampled tokens not consumed yet, oldest first: ((sequence, output index, matcher) per row,
        # host tokens, ready event).
        self._pending: list[tuple[list[tuple], torch.Tensor, torch.cuda.Event | None]] = []

    def forget(self, request_id: str) -> None:
        f = self._compiling.pop(request_id, None)
        if f is not None:
            f.cancel()  # (one already running finishes on its thread, its matcher dropped)
        self._matchers.pop(request_id, None)
        self._ended.pop(request_id, None)

    def compile(self, seq: Sequence) -> None:
        """Start building the request's matcher on the pool (a request without a grammar: nothing)."""
        rid = seq.request_id
        if seq.params.grammar is None or rid in self._matchers or rid in self._compiling:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(executor_threads(), thread_name_prefix="grammar")
            self._executor = llguidance.LLExecutor(executor_threads())
        self._compiling[rid] = self._pool.submit(self._build, seq.params.grammar)

    def compiling(self, request_id: str) -> bool:
        """The request's matcher was started by `compile` and is not installed yet (done or not)."""
        return request_id in self._compiling

    def compiled(self, request_id: str) -> bool:
        f = self._compiling.get(request_id)
        return f is not None and f.done()

    def wait(self, timeout: float) -> None:
        """Nap until a compile ends, at most `timeout` seconds (the engine has nothing else to do)."""
        if self._compiling:
            wait(list(self._compiling.values()), timeout, return_when=FIRST_COMPLETED)

    def install(self, seq: Sequence, then: tuple[int, ...] = ()) -> str | None:
        """Install the request's compiled matcher (waits for it, if still compiling), advanced over
        its tokens so far and `then` (a decode reservation's first token, not in the sequence yet);
        returns why its grammar does not compile (the request cannot run), or None."""
        try:
            m = self._compiling.pop(seq.request_id).result()
        except Exception as e:  # (llguidance reports a bad grammar in the matcher; anything else here)
            return f"the grammar did not compile: {e}"
        if m.is_error():
            return f"the grammar did not compile: {m.get_error().strip()}"
        self._matchers[seq.request_id] = m
        done = [t for t in seq.output_ids if t != PENDING] + list(then)
        if done:
            m.consume_tokens(done)
        self._note_end(seq, m, len(done))
        return None

    def mask(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """In place: logits [N, vocab] at -inf for every token the grammar of each listed row
        (seqs[k] is rows[k]'s) does not allow next. (begin_mask then apply_mask, in one call.)"""
        self.apply_mask(logits, rows, self.begin_mask(seqs, logits.device))

    def begin_mask(self, seqs: list[Sequence], device: torch.device) -> Future:
        """Start filling these sequences' next-token masks, on the fill thread; the future's result
        is what apply_mask takes. Called once the step's forward is queued: the fill (milliseconds at
        a large batch and vocabulary) runs while the device computes the forward and the engine's
        thread reads the step before, and the step's sampling waits for it only when it is queued."""
        # Every earlier step's tokens first (waiting for them: this step's forward is queued already).
        # The fill thread is idle here: the step before applied its masks before this one was prepared.
        self._settle(wait=True)
        matchers = [self._matcher(s) for s in seqs]
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        slot = self._words.take(len(seqs), device)
        return self._filler.submit(self._fill, matchers, self._host_bitmask(len(seqs)), slot)

    def apply_mask(self, logits: torch.Tensor, rows: list[int], filled: Future) -> None:
        """In place: the masks begin_mask filled (for the sequences of `rows`, in order) on the logits."""
        slot = filled.result()
        words = slot.ready_on(logits.device)
        if len(rows) == logits.shape[0]:  # every row constrained (rows are in order): in place, no gather
            logits.masked_fill_(disallowed(words, self._bits(logits.device), logits.shape[-1]), float("-inf"))
        else:
            at = on_device(rows, logits.device)
            logits[at] = masked(logits[at], words, self._bits(logits.device))
        slot.used()

    def _fill(self, matchers: list, host: torch.Tensor, slot: "WordSlot") -> "WordSlot":
        """On the fill thread: llguidance's batched fill (its own threads, without the GIL), then the
        copy to the device on a stream of its own, so that the forward's stream does not wait for it."""
        # (llguidance.torch's fill_next_token_bitmask_par is this call. Importing that module applies
        # torch.compile to a helper pdserve does not use, loading torch._dynamo and inductor: about half
        # the CPU of a worker's imports, docs/benchmarks.md "a worker's imports".)
        assert host.dtype == torch.int32 and host.dim() == 2 and host.is_contiguous() and host.is_cpu
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], host.data_ptr(),
                                               host.shape[1] * 4, host.shape[0])
        slot.load(host)  # (returns once the host buffer is read: the next fill may overwrite it)
        return slot

    def defer(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens just sampled for these sequences (on the device), to be consumed by the next
        mask or ended_at. Their copy to the host starts now."""
        host = tokens.to("cpu", non_blocking=tokens.is_cuda)
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        # Each sequence's output index now (the token is not in the sequence yet), and its matcher: a
        # request may end (and be forgotten) before its last token is consumed, and its id come back.
        self._pending.append(([(s, s.num_output_tokens + 1, self._matchers.get(s.request_id)) for s in seqs],
                              host, event))

    def _settle(self, wait: bool) -> None:
        """Consume the pending steps' tokens, oldest first. wait=False: the newest only if its tokens
        are on the host already (the engine reading a step's outputs has waited for that step, not
        for the one overlap scheduling queued after it)."""
        while self._pending:
            rows, host, event = self._pending[0]
            if event is not None:
                if not wait and len(self._pending) == 1 and not event.query():
                    return
                event.synchronize()
            self._pending.pop(0)
            live = [(s, n, m, t) for (s, n, m), t in zip(rows, host.tolist())
                    if m is not None and self._matchers.get(s.request_id) is m and s.request_id not in self._ended]
            if live:
                self._executor.consume_token_par([(m, t) for _, _, m, t in live])
            for s, n, m, _ in live:
                self._note_end(s, m, n)

    def ended_at(self, seq: Sequence) -> int | None:
        """How many output tokens completed the request's grammar (None while it goes on): a
        sequence ends there (finish_reason stop), as vLLM ends one whose grammar is done."""
        self._settle(wait=False)
        if seq.request_id not in self._matchers:
            self._matcher(seq)  # (a decode replica's first token: its matcher is built from the tokens)
        return self._ended.get(seq.request_id)

    def _matcher(self, seq: Sequence) -> llguidance.LLMatcher:
        m = self._matchers.get(seq.request_id)
        if m is not None:
            return m
        # A sequence the engine did not hold back (a caller of the sampler alone): compiled here, now.
        self.compile(seq)
        error = self.install(seq)
        if error is not None:
            raise ValueError(f"{seq.request_id}: {error}")
        return self._matchers[seq.request_id]

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        """On a pool thread: the grammar compiled against the tokenizer, and its first mask computed
        (the lexer's first states are built lazily: a big schema's take tens of ms)."""
        m = llguidance.LLMatcher(self._ll.get(), grammar)
        if not m.is_error():
            m.compute_bitmask()
        return m

    def _note_end(self, seq: Sequence, m: llguidance.LLMatcher, n_output: int) -> None:
        if seq.request_id in self._ended:
            return
        if m.is_error():
            # The router validated the grammar; what fails here (a token it did not allow, a limit of
            # the parser) ends the request rather than letting it run unconstrained.
            log.warning("grammar of %s: %s", seq.request_id, m.get_error())
            self._ended[seq.request_id] = n_output
        elif m.is_stopped():
            self._ended[seq.request_id] = n_output

    def _host_bitmask(self, n: int) -> torch.Tensor:
        if self._bitmask.shape[0] < n:
            # Pinned on a GPU host, so the copy to the device can be asynchronous.
            self._bitmask = torch.zeros(max(n, 2 * self._bitmask.shape[0]), self._bitmask.shape[1],
                                        dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self._bitmask[:n]

    def _bits(self, device: torch.device) -> torch.Tensor:
        b = self._bit_values.get(device)
        if b is None:
            b = self._bit_values[device] = bit_values(device)
        return b


def executor_threads() -> int:
    """Threads of llguidance's executor: half the CPUs this process may run on. Its default (most of
    them) competes with torch's own threads and the worker's: on a 2-CPU host a step of 256
    constrained sequences took 12× longer with it than with one thread (docs/benchmarks.md).
    PDSERVE_GRAMMAR_THREADS sets it."""
    if (n := os.environ.get("PDSERVE_GRAMMAR_THREADS")):
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"PDSERVE_GRAMMAR_THREADS={n!r}: a whole number of threads, at least 1")
        return int(n)
    return max(1, min(32, len(os.sched_getaffinity(0)) // 2))


def bit_values(device: torch.device) -> torch.Tensor:
    """[8] uint8: the value of each bit of a byte."""
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def disallowed(bitmask: torch.Tensor, bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, vocab] bool: the tokens whose bit is 0 in bitmask [M, ceil(vocab / 32)] int32 (llguidance's
    layout: token t is bit t % 32 of word t // 32, so on a little-endian host bit t % 8 of byte
    t // 8). Unpacked byte-wise: a [M, vocab] uint8 in between, not an int32 one four times its size."""
    return (bitmask.view(torch.uint8)[:, :, None] & bits).eq(0).flatten(1)[:, :vocab]


def masked(logits: torch.Tensor, bitmask: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [M, vocab] with every token disallowed by bitmask at -inf."""
    return logits.masked_fill(disallowed(bitmask, bits, logits.shape[-1]), float("-inf"))

