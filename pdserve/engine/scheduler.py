"""The scheduler: one token budget per step, no prefill/decode phases.

Every running sequence asks for the tokens it has that have no KV yet: one for a decoding
sequence, a chunk for a prefilling one. Both queues are kept in scheduling order (Sequence.order:
the lower priority value first, then the earlier arrival — vLLM's `priority`). Running sequences go
first in that order; when blocks run out the last of them — the lowest priority, the latest
arrival — is preempted (its blocks freed, recomputed later). Waiting sequences are admitted in
that order while budget, sequence slots and blocks last, reusing prefix-cached blocks; one that
finds no slot or no blocks preempts a running sequence of a lower priority (never of its own: that
would only trade places); so does a decode engine's reservation (`preempt_below`, from
Engine.reserve). A prefill-role engine admits a prompt only with all of its blocks, so it never
preempts.

With a TPOT guard (engine/tpot_guard.py: a decode or colocated engine under slo.tpot_ms) a step that
carries decoding sequences takes prompt tokens only up to the guard's budget for that many
decoders and the next prompt's chunk (none in a step whose decoders bank their slack for it);
prompts beyond it wait.

Speculative decoding (engine/spec_decode.py): a decoding sequence may carry draft tokens after its
last one (`ScheduledSeq.draft`, from the engine's drafter), counted in the step's budget and given
blocks like any other token; where the blocks are short the drafts are dropped, never a sequence
preempted for them.

Where CUDA graphs cover both kinds of step (`graph_limits`), a step that mixes a fresh prompt with
decoding sequences replays a `varlen` prefill graph when it holds few enough sequences (its decoding
rows go through the prefill kernel); such a step was measured the better one under a light load (one
H200, 1 req/s of 128-token prompts: e2e p99 197-202 ms against 235 stepping apart; docs/benchmarks.md).
Where the mixed step would not fit one (MLA's prefill graphs hold one fresh prompt each), it runs
eagerly, and its time was more than the prefill graph's and then the decode graph's together, for the
newcomer and for the decoders alike (docs/benchmarks-history.md, light load and first requests): the
prompt then goes in a step of its own, and the step after it is the decoders' alone (no two
prompt-only steps in a row: decoding never waits more than one). Only under a light load
(APART_MAX_DECODERS): under many streams stepping apart delivered fewer tokens than mixing, whose
steps carry many decoders with each prompt (docs/benchmarks-history.md, control plane under load).
"""

import bisect
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool, HashChain, NoFreeBlocksError, block_hashes
from pdserve.engine.sequence import PENDING, Sequence, SeqStatus
from pdserve.engine.step_profile import StepProfile
from pdserve.engine.tpot_guard import TPOTGuard

# Prompts whose mixed step no graph takes step apart from at most this many decoding sequences.
# PDSERVE_APART_MAX_DECODERS=0 mixes always: an A/B switch (gpu_figures.sh light).
APART_MAX_DECODERS = int(os.environ.get("PDSERVE_APART_MAX_DECODERS", "8"))
# Where prefill graphs take a long prompt whole, a cached prefix under this share of it is not used:
# the prompt is computed fresh (SDPA) rather than after its prefix, whose keys the `varlen` path's
# paged attention reads through the block table at ~1.45x SDPA's cost a layer. One H200, 4,096
# tokens (docs/benchmarks.md, "A cached prefix"): 256 cached took 65.8 ms against 62.7 fresh, 1,024
# cached 56.8 ms. Short prompts always use it (attention is a small part of them: 112 of 128 cached,
# 0.65x fresh).
SHORT_PREFIX_SHARE = 1 / 8
SHORT_PREFIX_FROM_TOKENS = 2048


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (drafts included)
    samples: bool = False  # this step reaches the sequence's last known token: it yields a new one
    # Draft tokens after its last token, checked in this step (speculative decoding): they are not
    # in seq.token_ids until accepted, but are counted in num_new_tokens and have slots.
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        known = self.num_new_tokens - len(self.draft)
        self.samples = self.seq.num_computed_tokens + known == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, chunk_size: int, whole_prompt: bool = False,
                 profile: StepProfile | None = None, guard: TPOTGuard | None = None):
        self.pool = pool
        # Sequences whose prompt chain the lookup hashed only in part: hash_launched finishes those
        # that were launched.
        self._unhashed: list[Sequence] = []
        self.guard = guard  # bounds the prompt tokens of a step with decoders (None: no bound)
        self.profile = profile or StepProfile()  # counts prefix-cache lookups and hits
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        # The prefill role takes a prompt's blocks whole at admission, so a running sequence never
        # grows and is never preempted: preempted, its blocks would go back to the pool (and be
        # written by another request) while the KV writes it posted to a decode replica may still
        # be reading them. Its blocks stay its own until the connector says those writes are over.
        self.whole_prompt = whole_prompt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The largest fresh-prompt step a prefill graph replays (tokens, prompts) and the largest
        # decode graph; 0: no such graphs, every step mixes as it comes (set by the engine).
        self.prompt_graph_tokens = self.prompt_graph_seqs = self.decode_graph_batch = 0
        self._prompts_alone = False  # the last step was prompts alone
        # Speculative decoding: a decoding sequence's draft tokens, at most the given number (the
        # step's budget left), to check in its step; None: none drafted (set by the engine).
        self.drafter: Callable[[Sequence, int], list[int]] | None = None
        self._guarded = False  # the guard was asked for this step's budget

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        _insert(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (placed from outside) joins the batch."""
        seq.status = SeqStatus.RUNNING
        _insert(self.running, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished, aborted, or handed over); frees nothing."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def graph_limits(self, prompt_tokens: int, prompt_seqs: int, decode_batch: int) -> None:
        """The engine's CUDA graphs: fresh-prompt steps up to prompt_tokens tokens of prompt_seqs
        prompts (a `varlen` step of prompt_seqs sequences takes decoders beside a prompt), decode steps
        up to decode_batch sequences (of which APART_MAX_DECODERS count here)."""
        self.prompt_graph_tokens, self.prompt_graph_seqs = prompt_tokens, prompt_seqs
        self.decode_graph_batch = min(decode_batch, APART_MAX_DECODERS)

    def _graphs_apart(self) -> bool:
        """Decoders that one decode graph takes, and a prompt waiting (not begun) that a prefill graph
        may take, but no `varlen` graph with them: the two go in steps of their own."""
        return (self.prompt_graph_tokens > 0 and bool(self.waiting) and bool(self.running)
                and self.waiting[0].num_computed_tokens == 0 and len(self.running) <= self.decode_graph_batch
                and len(self.running) + 1 > self.prompt_graph_seqs
                and all(q.num_tokens - q.num_computed_tokens == 1 for q in self.running))

    def _prompts_only(self) -> list[ScheduledSeq]:
        """Prompts from the head of the queue, whole, as one prefill graph takes them; [] when the
        first is not one (too long, no blocks; a cached prefix where the graphs hold one prompt
        each: MLA's read only a fresh prompt's own latents): the step then mixes as usual."""
        out: list[ScheduledSeq] = []
        # Graphs of several prompts read each prompt's keys through its block table, a cached
        # prefix's too (prefill_graphs.py, `varlen`): a prompt whose prefix is cached runs in them.
        cached_ok = self.prompt_graph_seqs > 1
        budget = min(self.max_num_batched_tokens, self.prompt_graph_tokens)
        if (room := self._prompt_room()) is not None:  # (the decoders' step follows this one)
            budget = min(budget, room)
        while (self.waiting and len(out) < self.prompt_graph_seqs
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0:
                self._use_prefix_cache(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if ((seq.num_computed_tokens and not cached_ok) or n > budget or n > self.chunk_size
                    or not self._grow(seq, n)):
                self._drop_blocks(seq)  # (a waiting sequence holds no blocks; the usual path looks again)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            _insert(self.running, seq)
            self.profile.prefix_queries += seq.num_tokens
            self.profile.prefix_hits += seq.num_cached_tokens
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def schedule(self) -> list[ScheduledSeq]:
        self._guarded = False
        out = self._schedule()
        if self._guarded:  # what the step takes of the prompts, the guard's bank pays for
            self.guard.took(sum(s.num_new_tokens for s in out if s.seq.num_tokens - s.seq.num_computed_tokens > 1))
        return out

    def _schedule(self) -> list[ScheduledSeq]:
        apart = self._graphs_apart()
        if apart and not self._prompts_alone:
            if out := self._prompts_only():
                self._prompts_alone = True
                return out
        defer = apart and self._prompts_alone  # the decoders' step: the prompts go alone next
        self._prompts_alone = False
        budget = self.max_num_batched_tokens
        room = self._prompt_room()  # prompt tokens this step may still take (None: no bound)
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_size)
            assert n > 0
            chunk = seq.num_tokens - seq.num_computed_tokens > 1  # a prompt's (a decoder computes one token)
            if chunk and room is not None:
                if room == 0:
                    i += 1
                    continue
                n = min(n, room)
            draft = self._draft(seq, budget) if not chunk else []
            if draft and not self._grow(seq, 1 + len(draft)):
                draft = []  # no blocks for the guesses: not worth preempting anyone for
            n += len(draft)
            while not self._grow(seq, n):
                victim = self.running.pop()  # the lowest priority, latest arrival first
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n, draft=draft))
                budget -= n
                if chunk and room is not None:
                    room -= n
                i += 1
                continue
            break
        # Admitting while preempting would thrash: the victims wait in the queue (in their order).
        while self.waiting and budget > 0 and room != 0 and not preempted and not defer:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if (freed := self._preempt_for(seq, out)) is None:
                    break
                budget += freed
            if seq.num_computed_tokens == 0:
                self._use_prefix_cache(seq)
            rest = seq.num_tokens - seq.num_computed_tokens
            n = min(rest, budget, self.chunk_size, room if room is not None else rest)
            if not self._grow(seq, rest if self.whole_prompt else n):
                self._drop_blocks(seq)
                if (freed := self._preempt_for(seq, out)) is None:
                    break
                budget += freed  # its blocks are free now: look again
                continue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            _insert(self.running, seq)
            self.profile.prefix_queries += seq.num_tokens
            self.profile.prefix_hits += seq.num_cached_tokens
            out.append(ScheduledSeq(seq, n))
            budget -= n
            if room is not None:
                room -= n
        return out

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """A decoding sequence's draft tokens within the step's budget (its own token comes first)."""
        if self.drafter is None or budget < 2 or seq.token_ids[-1] == PENDING:
            return []
        return self.drafter(seq, budget - 1)

    def _prompt_room(self) -> int | None:
        """The TPOT guard's budget of prompt tokens for a step of the running decoders; None: no bound."""
        if self.guard is None:
            return None
        decoders = sum(1 for q in self.running if q.num_tokens - q.num_computed_tokens == 1)
        if not self.waiting and decoders == len(self.running):
            return None  # (decoders alone, the usual step: no prompt to bound, the guard not asked)
        self._guarded = True
        return self.guard.budget(decoders, self._next_chunk())

    def _next_chunk(self) -> int:
        """Prompt tokens the next prompt in line would take in a step unguarded: a running prompt's
        next chunk, else the first waiting one's (its cached prefix, not looked up yet, counted in:
        the guard may wait for more than it needs)."""
        q = next((q for q in self.running if q.num_tokens - q.num_computed_tokens > 1),
                 self.waiting[0] if self.waiting else None)
        rest = q.num_tokens - q.num_computed_tokens if q is not None else 0
        return min(rest, self.chunk_size, self.max_num_batched_tokens)

    def _use_prefix_cache(self, seq: Sequence) -> None:
        # Leave at least one token to compute: its logits give the next token. The chain is hashed
        # as the lookup reads it (a fresh prompt: its first block only); the rest once the step is
        # launched (hash_launched), while the device computes, not before the step.
        hashes = HashChain(seq.token_ids[: seq.num_tokens - 1], self.block_size, seq.cache_root)
        hits = self.pool.lookup(hashes)
        if hits and self._fresh_is_faster(seq.num_tokens, len(hits) * self.block_size):
            self.pool.free(hits)  # (the references lookup took; the blocks stay cached for others)
            hits = []
        seq.block_ids = hits
        seq.block_hashes = hashes.prefix(len(hits))
        # Keys over a PENDING placeholder (a preempted sequence's token still being sampled) are
        # not its content's: none of those is kept for registering.
        known = seq.num_tokens - 1
        while known > 0 and seq.token_ids[known - 1] == PENDING:
            known -= 1
        full = known // self.block_size
        seq.lookup_hashes = hashes if full == len(hashes) else hashes.prefix(full)
        if seq.lookup_hashes is hashes and not hashes.is_complete:
            self._unhashed.append(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size

    def hash_launched(self) -> None:
        """Hash the rest of each admitted prompt's block chain (_use_prefix_cache hashed what its
        lookup read): called once the step is on the device, so that a long prompt's ~250 sha256
        calls (0.46 ms for 4k tokens on the development CPU) run beside its prefill, not before
        it; register_full_blocks then finds them done. (A prompt left waiting looks up again.)"""
        if self._unhashed:
            for seq in self._unhashed:
                if seq.status is SeqStatus.RUNNING and isinstance(seq.lookup_hashes, HashChain):
                    seq.lookup_hashes.complete()
            self._unhashed.clear()

    def _fresh_is_faster(self, num_tokens: int, cached: int) -> bool:
        """Whether a prompt of num_tokens is better computed whole than after its `cached` tokens
        (SHORT_PREFIX_SHARE): only where one prefill graph takes it whole, fresh."""
        return (SHORT_PREFIX_FROM_TOKENS <= num_tokens <= min(self.prompt_graph_tokens, self.chunk_size)
                and cached < num_tokens * SHORT_PREFIX_SHARE)

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Make seq's blocks cover its first num_computed_tokens + n tokens; False if the pool is short."""
        need = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        try:
            seq.block_ids += self.pool.allocate(need, after=seq.block_ids[-1] if seq.block_ids else None)
        except NoFreeBlocksError:
            return False
        return True

    def _preempt_for(self, seq: Sequence, out: list[ScheduledSeq]) -> int | None:
        """Make room for the waiting `seq` by preempting the last running sequence, if that one's
        priority is lower (a higher value); returns the tokens it had in this step's schedule (its
        budget back), or None when nothing may be preempted for `seq`. Every running sequence is
        in `out` here (admission runs once they are all scheduled), but for a prompt the TPOT guard
        left out."""
        if self.whole_prompt or not self.running or self.running[-1].priority <= seq.priority:
            return None
        victim = self.running.pop()
        k = next((k for k, s in enumerate(out) if s.seq is victim), None)
        self._preempt(victim)
        return 0 if k is None else out.pop(k).num_new_tokens  # (None: the guard left it out of this step)

    def preempt_below(self, seq: Sequence) -> bool:
        """Preempt the last running sequence if it ranks below `seq` (a decode reservation's
        sequence, not yet scheduled): its blocks go back to the pool, it waits to recompute. False
        when none ranks below. Called between steps, as schedule() is."""
        if self.whole_prompt or not self.running or self.running[-1].order <= seq.order:
            return False
        self._preempt(self.running.pop())
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        _insert(self.waiting, seq)  # (ahead of the later arrivals of its priority)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: put the blocks this step filled into the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        done = len(seq.block_hashes)
        if full > done:
            # The lookup's keys where it hashed these blocks (their tokens were known then: it
            # hashes only what precedes a sequence's newest token), the rest hashed now.
            new = seq.lookup_hashes[done:full]
            if done + len(new) < full:
                parent = new[-1] if new else seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
                new += block_hashes(seq.token_ids[: full * self.block_size], self.block_size, parent,
                                    start=done + len(new))
            for k, h in enumerate(new, start=done):
                self.pool.register(seq.block_ids[k], h)
            seq.block_hashes += new


def _insert(queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
    """Put `seq` in a queue kept in scheduling order (Sequence.order)."""
    if not queue or queue[-1].order <= seq.order:  # the usual case: one priority, arrivals in order
        queue.append(seq)
    else:
        bisect.insort(queue, seq, key=lambda q: q.order)
