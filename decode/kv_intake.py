"""Takes KV from prefill workers into a decode engine: reserve, wait for the data, start decoding.

A reservation reuses what the engine's own prefix cache holds of the prompt (Engine.reserve): the
handle names those leading blocks as held, and the prefill worker writes only the blocks after
them. A conversation's next turn, whose prompt begins with the last turn's prompt and answer,
thus moves only its new tokens' KV."""

from pdserve.engine.engine import Engine
from pdserve.protocol import TokenLogprob
from pdserve.messages import Request

from pdserve.kvtransfer import DecodeConnector, ReserveHandle


class KVIntake:
    def __init__(self, engine: Engine, connector: DecodeConnector, lease_s: float = 30.0):
        assert engine.config.role == "decode"
        self.engine = engine
        self.connector = connector
        self.lease_s = lease_s
        self._aborted: set[str] = set()  # aborted here, their blocks waiting for the lease to settle
        # Counted as each request's KV arrives (cumulative; ReplicaStats): blocks the prefix cache
        # had, so nothing moved for them, and the bytes prefill workers wrote into the others.
        self.blocks_reused = 0
        self.bytes_received = 0
        layout = engine.layout
        self._block_bytes = layout.bytes_per_token * layout.block_size  # one block, every layer and plane

    def reserve(self, request: Request, prefill_id: str | None = None) -> ReserveHandle | None:
        """Blocks for the KV of the prompt (and of a resumed request's `output_ids`) under a lease,
        or None when this replica is full. The handle lists only the blocks to be written, after
        the `cached_blocks` this engine holds already."""
        r = self.engine.reserve(request)
        if r is None:
            return None
        return self.connector.reserve(request.request_id, r.new_block_ids, self.lease_s, prefill_id, r.cached_blocks)

    def abort(self, request_id: str) -> None:
        if self.connector.release(request_id):
            # Its KV may still be on the way: the reservation (and its blocks) stays until poll()
            # hears the lease settled, then goes; the request itself is over now.
            self._aborted.add(request_id)
        else:
            self.engine.abort(request_id)

    def busy(self) -> bool:
        """Leases open or settling: poll() has work."""
        return self.connector.busy()

    def poll(self) -> list[tuple[str, str]]:
        """Start the requests whose KV arrived, free the blocks of leases that settled; returns the
        requests that failed (their KV will not come) and why, aborted ones left out."""
        p = self.connector.poll()
        for f in p.done:
            seq = self.engine.seqs[f.request_id]
            cached = seq.num_cached_tokens // self.engine.config.block_size
            self.blocks_reused += cached
            self.bytes_received += (len(seq.block_ids) - cached) * self._block_bytes
            lp = f.first_logprob
            self.engine.start_decode(f.request_id, f.first_token,
                                     None if lp is None else TokenLogprob(f.first_token, lp[0], lp[1]))
        for rid in p.settled:
            self.engine.release(rid)
            self._aborted.discard(rid)
        return [(rid, p.why.get(rid, "the KV transfer failed")) for rid in p.failed if rid not in self._aborted]
