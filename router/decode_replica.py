"""A decode replica as the router sees it: one DecodeWorker, or the N ranks of an expert-parallel
group. Each rank owns the requests reserved on it and their KV, so a reservation picks a rank,
the prefill replica streams to that rank, and an abort goes to it; load figures are the sums."""

import asyncio
from dataclasses import dataclass, field

from pdserve.messages import ReplicaStats


@dataclass
class DecodeReplica:
    name: str
    ranks: dict[str, object]  # rank (actor) name -> actor handle; one entry unless expert parallel
    rank_stats: dict[str, ReplicaStats] = field(default_factory=dict)  # as last reported

    def rank_order(self) -> list[str]:
        """Ranks to try for a reservation: most free KV blocks first (unknown ones last)."""
        return sorted(self.ranks, key=lambda r: -getattr(self.rank_stats.get(r), "free_blocks", -1))

    async def fetch_stats(self, timeout_s: float) -> ReplicaStats:
        """Every rank's stats, combined; raises if any rank does not answer (the replica is down)."""
        parts = await asyncio.gather(*(asyncio.wait_for(h.stats.remote(), timeout=timeout_s)
                                       for h in self.ranks.values()))
        self.rank_stats = dict(zip(self.ranks, parts))
        return parts[0] if len(parts) == 1 else ReplicaStats.combine(self.name, parts)
