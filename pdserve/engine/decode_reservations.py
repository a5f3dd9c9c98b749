"""The decode role's seam (mixed into Engine): a reservation of blocks for a prompt whose KV another
replica computes, the start of its decoding once that KV is placed, and the release of a request's
blocks (a prefilled request whose KV was sent, or a reservation given up). It reads the engine's
pool, scheduler, sequences and config, and ends a sequence through the engine's `_finish`."""

from typing import NamedTuple

from pdserve.engine.block_pool import HashChain, NoFreeBlocksError
from pdserve.engine.sequence import Sequence
from pdserve.messages import Request
from pdserve.protocol import TokenLogprob


class Reservation(NamedTuple):
    """A decode reservation's blocks: every block of the sequence, in order, the first
    `cached_blocks` of them found in this engine's prefix cache (their KV is here already, shared
    with whoever else uses them: nothing may write there); the KV of the rest is to be placed."""

    block_ids: list[int]
    cached_blocks: int

    @property
    def new_block_ids(self) -> list[int]:
        """The blocks whose KV comes from outside: fresh, this reservation's alone."""
        return self.block_ids[self.cached_blocks:]


class DecodeReservations:
    """Engine's methods of the disaggregation seam (mixed into Engine)."""

    @property
    def num_reserved(self) -> int:
        """Decode role: reservations waiting for their KV (each holds a sequence slot)."""
        return len(self._reserved)

    def reserve(self, request: Request) -> Reservation | None:
        """Decode role: blocks for the KV of the prompt and of `output_ids` (a resumed request's
        tokens so far; same ids in every layer), or None if full. The longest prefix of full blocks
        this engine's prefix cache holds is reused (a reference taken on each, as a colocated
        admission does), so only the rest's KV has to come: a conversation's next turn moves only
        its new tokens' KV. As in a colocated admission the last token is not looked up: at least
        one block is always placed, and with it comes the finish that says the KV is complete.
        Its `priority` as add's: once decoding, a lower priority is preempted first — and to
        make room for this reservation, where it outranks them (vLLM's priority scheduling: the
        victims recompute their KV here later, as any preempted sequence does)."""
        seq = self._new_sequence(request)
        cached: list[int] = []
        try:
            bs = self.config.block_size
            # Hashed as the lookup reads it: the rest when start_decode registers the blocks, not
            # before this reservation's answer (the prompt's prefill waits for it).
            hashes = HashChain(seq.token_ids[:seq.num_tokens - 1], bs, seq.cache_root)
            cached = self.pool.lookup(hashes)
            need = -(-seq.num_tokens // bs) - len(cached)
            for _ in range(self._victims_for(seq, need)):
                self.scheduler.preempt_below(seq)
            fresh = self.pool.allocate(need)
        except NoFreeBlocksError:
            self.pool.free(cached)  # refused halfway: the references looked up go back
            self._forget(seq)
            return None
        seq.block_ids = cached + fresh
        # Registered already: start_decode registers the blocks after them, each once.
        seq.block_hashes = hashes.prefix(len(cached))
        seq.lookup_hashes = hashes  # (a fresh prompt: no PENDING token among them)
        seq.num_cached_tokens = len(cached) * bs
        self._reserved.add(seq.request_id)
        self.grammars.compile(seq)  # while its KV comes (not for a refused reservation, tried elsewhere)
        return Reservation(list(seq.block_ids), len(cached))

    def _victims_for(self, seq: Sequence, need: int) -> int:
        """How many running sequences a reservation for `seq` (needing `need` fresh blocks) must
        preempt — the last of them, each ranked below it — for a sequence slot and the blocks; raises
        NoFreeBlocksError, preempting none, when even all of those would not do. Sequences waiting
        behind it (a lower priority) hold no slot against it."""
        running = self.scheduler.running
        slots = (len(running) + len(self._reserved) + sum(1 for w in self.scheduler.waiting if w.order <= seq.order)
                 - self.config.max_num_seqs + 1)
        free = self.pool.num_free_blocks
        k = 0
        while k < max(0, slots) or free < need:
            if k == len(running) or running[-1 - k].order <= seq.order:
                raise NoFreeBlocksError("no free sequence slot" if k < slots else f"need {need} blocks, {free} free")
            # A victim's blocks come free but for those another sequence shares (this one's cached prefix too).
            free += sum(1 for b in running[-1 - k].block_ids if self.pool.ref_counts[b] == 1)
            k += 1
        return k

    def start_decode(self, request_id: str, first_token: int,
                     first_logprob: TokenLogprob | None = None) -> None:
        """Decode role: the KV of every token so far (the prompt's, a resumed request's output_ids')
        is in the reserved blocks (placed, or cached here already); generate from `first_token` on."""
        seq = self.seqs[request_id]
        assert seq.block_ids and seq.num_computed_tokens == 0, f"{request_id} was not reserved"
        if self._gate.holds_start(seq, first_token, first_logprob):
            return  # (its grammar's matcher must consume the first token: called again once compiled)
        self._reserved.discard(request_id)  # (a held one keeps its sequence slot)
        seq.num_computed_tokens = seq.num_tokens
        self.scheduler.register_full_blocks(seq)
        out = self._append_token(seq, first_token, first_logprob)
        self._ready.append(out)
        if not out.finished:
            self.scheduler.add_running(seq)

    def release(self, request_id: str) -> None:
        """Free a request's blocks: a prefilled request whose KV has been sent, or a reservation."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.scheduler.remove(seq)
            self._finish(seq)
