"""Every kind of step a replica's scheduler can produce, run once before the replica says it is ready.

On a GPU, the first step of each new shape pays for its kernels: Triton compiles a kernel for every
new specialization of its integer arguments (a value of 1, a multiple of 16, anything else), the
tile configuration picked by the longest prompt, a paged prefill over a cached prefix rather than
a fresh prompt's attention, a mixed prefill + decode step, an eager decode batch beyond the CUDA
graphs. Without this, the first request after "ready" took many times as long as the next ones,
and lone long prompts after others still spent a good part of the worker's time compiling (a
prompt with a cached prefix) (docs/benchmarks-history.md: light load and first requests, control
plane under load). Those costs belong before "ready", not on a user's request.

So a worker runs this script on its engine before its loop starts (pdserve/worker/engine_worker.py): real
requests through the engine's own entry points — `add_request` (colocated, prefill) or
`reserve` + `start_decode` (a decode replica's decoders, whose KV would come from a prefill replica;
here the reserved blocks hold whatever they hold: only the shapes matter) — sized to reach each kind and each
integer class the scheduler can produce for this engine's limits. Afterwards nothing of it is
left: every request finished, every block free, the prefix cache empty, the step profile zeroed
(the planner must not count warm-up steps as traffic).

Not run for an expert-parallel rank: its steps are collectives agreed with the other ranks, and a
script of its own would run out of step with theirs (the DecodeGraphs capture, which the ranks do
together, covers their graphed batches).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.messages import Request
from pdserve.protocol import SamplingParams

_FIRST_ID = 3  # token ids from here: below every vocabulary's size, clear of the usual specials 0..2
_LONG = 200  # query tokens past which the paged prefill kernel takes its larger tiles (rows = tokens x group >= 128)


def size_class(n: int) -> str:
    """How Triton specializes an integer argument: 1, a multiple of 16, or neither."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "n"


def signature(engine, scheduled) -> tuple:
    """The kernels a step's shape selects, as the attention backend dispatches (ops/triton_attention):
    one token per sequence -> the decode kernel (replayed from a CUDA graph when a bucket holds the
    batch); prompts with nothing cached before them -> fresh prompts' attention (replayed from the
    CUDA graph of its token bucket and layout when one holds the step: engine/prefill_graphs.py);
    anything else (a cached prefix, a later chunk, decode tokens beside prompt tokens) -> the paged
    prefill kernel, whose tiles grow with the longest query. With the size classes of the step's
    tokens and sequences, which the other kernels (norms, MoE, KV writes) specialize on."""
    seqs = len(scheduled)
    tokens = sum(s.num_new_tokens for s in scheduled)
    if tokens == seqs:
        graphs = engine.runner.graphs
        if graphs is not None and seqs <= graphs.buckets[-1] and engine.config.role != "prefill":
            return ("decode", "graph")
        return ("decode", size_class(seqs))
    if all(s.seq.num_computed_tokens == 0 for s in scheduled):
        return _fresh_signature(engine, tokens, seqs)
    longest = max(s.num_new_tokens for s in scheduled)
    return ("paged", size_class(tokens), size_class(seqs), "long" if longest >= _LONG else "short")


def _fresh_signature(engine, tokens: int, seqs: int) -> tuple:
    """A step of `seqs` fresh prompts, `tokens` in all (more than one per prompt): its graph's
    bucket and layout, or, eager, its size classes."""
    graphs = engine.runner.prefill_graphs
    choice = graphs.shape(tokens, seqs) if graphs is not None else None
    if choice is not None:
        return ("fresh", "graph", *choice)
    return ("fresh", size_class(tokens), size_class(seqs))


@dataclass
class WarmUp:
    """What the script ran: the shapes (signatures) of its steps, for the log and for tests of its cover."""

    shapes: set[tuple] = field(default_factory=set)
    steps: int = 0
    attention_lengths: int = 0  # padded lengths the attention backend prepared (triton_attention.warm_up)
    seconds: float = 0.0


def warm_up_attention(engine, log: Callable[[str], None] = lambda msg: None) -> int:
    """The attention backend's own per-length plans for fresh prompts (every role prefills), at the
    heads this rank holds (a tensor-parallel rank's share); how many lengths it prepared. A
    tensor-parallel follower runs this alone: its steps are rank 0's warm-up steps."""
    from pdserve.models.tensor_parallel import rank_heads

    attention = engine.model.attn_backend
    if not hasattr(attention, "warm_up"):
        return 0
    log("warm-up: fresh prompts' attention at every padded length")
    a, tp = engine.args, engine.tp
    heads = rank_heads(a.num_heads, tp)
    kv_heads = len(tp.kv_heads(a.num_heads, a.num_kv_heads)) if tp is not None else a.num_kv_heads
    return attention.warm_up(min(engine.max_model_len, engine.config.chunk_size, engine.config.max_num_batched_tokens),
                             heads, kv_heads, a.head_dim, next(engine.model.parameters()).dtype, engine.device)


def warm_up(engine, log: Callable[[str], None] = lambda msg: None) -> WarmUp:
    """Run the script on `engine` (idle, nothing queued); returns what it ran."""
    assert not engine.seqs, "warm-up runs on an idle engine, before it takes requests"
    t0 = time.perf_counter()
    done = WarmUp()
    phases = _phases(engine)
    for i, (what, run) in enumerate(phases, 1):
        log(f"warm-up {i}/{len(phases)}: {what}")
        run(_Stepper(engine, done))
    done.attention_lengths = warm_up_attention(engine, log)
    _settle(engine)
    done.seconds = time.perf_counter() - t0
    log(f"warm-up: {done.steps} steps of {len(done.shapes)} shapes"
        + (f", attention at {done.attention_lengths} prompt lengths" if done.attention_lengths else "")
        + f" in {done.seconds:.1f} s")
    return done


class _Stepper:
    """Steps the engine, recording each step's shape."""

    def __init__(self, engine, done: WarmUp):
        self.engine, self.done = engine, done

    def step(self) -> None:
        scheduled = self.engine.scheduler.schedule()
        if scheduled:
            self.done.shapes.add(signature(self.engine, scheduled))
            self.done.steps += 1
        self.engine.step(scheduled)

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()
        for rid in list(self.engine.seqs):  # prefill role: prefilled requests hold their blocks until released
            self.engine.release(rid)


def _phases(engine) -> list[tuple[str, Callable[[_Stepper], None]]]:
    """What to run for this engine's role and limits: every signature one step can have, each in a
    step of its own: decode batches; fresh prompts and prompts over a cached prefix, by the classes
    of their tokens and sequences (and, over a prefix, short and long queries); the widest prompt."""
    c = engine.config
    room = engine.max_model_len - 2  # a prompt that leaves room for the tokens the script asks for
    budget = min(c.max_num_batched_tokens, engine.pool.num_blocks * c.block_size // 4)
    most = max(1, min(c.max_num_seqs, engine.pool.num_blocks // 4))  # sequences at once, with spare blocks
    batches = [b for b in (1, 16, 17) if b <= most]
    # Decode-shaped steps (one token per sequence): decoding, and on a prefill engine one-token prompts.
    graphs = engine.runner.graphs
    eager = [graphs.buckets[-1] + 1] if graphs is not None and graphs.buckets[-1] < most else []
    phases: list = [(f"decode, batch {b}", lambda st, b=b: _decode(st, b)) for b in batches + eager]
    # Every role prefills: a decode replica computes prompts itself (a local prefill: router.prefill_site
    # adaptive, short prompts, the prefill pool down), alone or beside its decoders, and a flip
    # makes it a prefill replica. Its first local prompts compiled for seconds on an H200 without this
    # (TTFT p90 2.9 s in a sweep's first seconds; docs/benchmarks.md, adaptive disaggregation).
    for b, tokens in _fresh_steps(engine, budget, most, room):
        phases.append((f"{b} fresh prompts, {tokens} tokens", lambda st, b=b, t=tokens: _fresh(st, b, t)))
    for b in batches:
        if not c.enable_prefix_cache:
            continue  # (a prompt's later chunks still take the paged kernel; a prefix cannot be set up here)
        short = 16 * -(-2 * b // 16)  # every prompt at least 2 tokens: not a decode-shaped step
        long = 16 * -(-(2 * (b - 1) + _LONG) // 16)  # one prompt's query long enough for the large tiles
        for tokens in (short, short + 1, long, long + 1):
            if tokens <= min(budget, c.chunk_size) and c.block_size + tokens <= room:
                phases.append((f"{b} prompts after a cached prefix, {tokens} new tokens",
                               lambda st, b=b, t=tokens: _paged(st, b, t)))
    widest = min(room, c.chunk_size, budget)  # the largest activations and tiles a step can have
    if widest > 2 * _LONG:
        phases.append((f"one prompt of {widest} tokens", lambda st: _fresh(st, 1, widest)))
    return phases


def _fresh_steps(engine, budget: int, most: int, room: int) -> list[tuple[int, int]]:
    """(prompts, tokens) of one step of fresh prompts for every signature such steps can have:
    eager ones by the size classes of tokens and prompts; graphed ones, every bucket and layout
    a step can reach (each replayed once before ready). Candidates: 1, 2, 16, 17 prompts and, with
    prefill graphs, the first counts past the prompts a graph holds; tokens just past each bucket's
    lower edge, at its upper edge, just past the largest, and the fewest (2 a prompt)."""
    c = engine.config
    graphs = engine.runner.prefill_graphs
    counts, sizes = {1, 2, 16, 17}, set()
    if graphs is not None:
        over = graphs.max_seqs + 1
        counts |= {over, 16 * -(-over // 16)}
        edges = [0] + graphs.buckets
        sizes |= {t for lo, hi in zip(edges, edges[1:]) for t in (lo + 1, hi)}
        past = 16 * -(-(graphs.buckets[-1] + 1) // 16)
        sizes |= {past, past + 1}
    found: dict[tuple, tuple[int, int]] = {}
    for b in sorted(n for n in counts if n <= most):
        short = 16 * -(-2 * b // 16)  # every prompt at least 2 tokens: not a decode-shaped step
        for tokens in sorted(sizes | {short, short + 1}):
            each, last = tokens // b, tokens // b + tokens % b  # as _fresh splits them
            if each < 2 or tokens > budget or last > min(c.chunk_size, room):
                continue  # (a longer prompt would be chunked: its step is not `tokens` wide)
            found.setdefault(_fresh_signature(engine, tokens, b), (b, tokens))
    return sorted(found.values())


def _ids(engine, n: int, salt: int) -> list[int]:
    """n prompt token ids of the engine's vocabulary, different for each salt (no prefix-cache hits
    between phases)."""
    span = max(1, min(200, engine.args.vocab_size - _FIRST_ID))  # (a tiny test model's vocabulary: 128)
    return [_FIRST_ID + (salt * 7919 + i * 31) % span for i in range(n)]


_salt = iter(range(1, 1 << 30))


def _rid() -> str:
    return f"warm-up-{next(_salt)}"


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _fresh(st: _Stepper, prompts: int, tokens: int) -> None:
    """`prompts` prompts of `tokens` in all (each at least 2), added together: one prefill step
    where they fit (chunks after it for a longer one); one token each."""
    each = [tokens // prompts] * prompts
    each[-1] += tokens - sum(each)
    for n in each:
        st.engine.add_request(_rid(), _ids(st.engine, n, next(_salt)), _params(1))
    st.drain()


def _paged(st: _Stepper, prompts: int, tokens: int) -> None:
    """A block cached by a first prompt, then `prompts` prompts at once that start with it and
    bring `tokens` new tokens in all (the last the most): their prefill reads the prefix through
    the paged cache."""
    prefix = _ids(st.engine, st.engine.config.block_size, next(_salt))
    st.engine.add_request(_rid(), prefix + _ids(st.engine, 1, next(_salt)), _params(1))
    st.drain()
    each = [2] * (prompts - 1) + [tokens - 2 * (prompts - 1)]
    for n in each:
        st.engine.add_request(_rid(), prefix + _ids(st.engine, n, next(_salt)), _params(1))
    st.drain()


def _decode(st: _Stepper, batch: int) -> None:
    """`batch` sequences decoding together. Colocated and prefill: one-token prompts (their first
    step is decode-shaped too; a prefill engine's only one); decode role: reservations started as if their KV had come (the blocks
    hold whatever they hold: only the shapes matter here)."""
    e = st.engine
    if e.config.role == "decode":
        for _ in range(batch):
            rid = _rid()
            if e.reserve(Request(rid, _ids(e, 2, next(_salt)), _params(3))) is None:
                break
            e.start_decode(rid, _FIRST_ID)
    else:
        for _ in range(batch):
            e.add_request(_rid(), _ids(e, 1, next(_salt)), _params(3))
    st.drain()


def _settle(engine) -> None:
    """Nothing of the script left: no request, every block free, no cached prefix, no step counted."""
    assert not engine.seqs and not engine.has_unfinished()
    engine.pool.reset_prefix_cache()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "warm-up left KV blocks in use"
    engine.profile.reset()
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
