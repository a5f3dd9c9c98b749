"""Which experts each rank of an expert-parallel group holds, and which rank serves a routed token.

Rank r is home to experts [r * E/N, (r + 1) * E/N). Experts listed in `replicated` (the hot ones)
also have a copy on every rank: a token routed to one of them is served by its own rank, so it
never crosses the link and the hot expert's load is spread over the ranks.
"""

from dataclasses import dataclass

import torch


def allowed_ep_sizes(num_experts: int) -> list[int]:
    """Group sizes that shard `num_experts` evenly."""
    return [n for n in range(1, num_experts + 1) if num_experts % n == 0]


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    ep_size: int
    rank: int
    replicated: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.num_experts % self.ep_size:
            allowed = ", ".join(map(str, allowed_ep_sizes(self.num_experts))) or "1 (the model has no experts)"
            raise ValueError(f"ep_size {self.ep_size} does not divide the model's {self.num_experts} experts; "
                             f"allowed: {allowed}")
        bad = [e for e in self.replicated if not 0 <= e < self.num_experts]
        if bad or len(set(self.replicated)) != len(self.replicated):
            raise ValueError(f"replicated experts {list(self.replicated)} must be distinct ids in "
                             f"[0, {self.num_experts})")
        assert 0 <= self.rank < self.ep_size

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def home(self, expert: int) -> int:
        return expert // self.experts_per_rank

    @property
    def local_experts(self) -> list[int]:
        """Global ids of the experts this rank holds, in slot order: its own, then copies of hot ones."""
        lo = self.rank * self.experts_per_rank
        return list(range(lo, lo + self.experts_per_rank)) + [
            e for e in self.replicated if self.home(e) != self.rank]

    def serving_rank(self) -> torch.Tensor:
        """[ep_size, num_experts] int64: the rank computing expert e for a token that lives on rank s."""
        table = (torch.arange(self.num_experts) // self.experts_per_rank).repeat(self.ep_size, 1)
        for e in self.replicated:
            table[:, e] = torch.arange(self.ep_size)
        return table

    def local_slot(self) -> torch.Tensor:
        """[num_experts] int64: where expert e sits in this rank's weights; -1 when it is not here."""
        slot = torch.full((self.num_experts,), -1, dtype=torch.long)
        slot[self.local_experts] = torch.arange(len(self.local_experts))
        return slot
