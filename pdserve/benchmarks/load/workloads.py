"""What one rate sends: the prompts, when each is due, and which request each one follows.

- `random` (the default): independent prompts of --input-len random token ids.
- `shared-prefix`: a few-shot mix. --prefixes shared prefixes of --prefix-len tokens; each prompt
  is one of them (uniformly, seeded) followed by its own --input-len tokens.
- `multi-turn`: chat sessions of --turns turns that all begin with one shared system prompt of
  --prefix-len tokens. Turn k's prompt is the system prompt, then each earlier turn's user message
  (--input-len tokens) and assistant answer (--output-len tokens), then its own user message; it is
  sent --think-time after turn k-1 ended (a session waits on its own answers, as a user does), and
  names its session in OpenAI's `user` field. The assistant's part of the history is a seeded
  stand-in of the answer's length, not the text the server gave: every prompt is known before the
  run, so a rerun sends the same tokens. (A replica's cache of the tokens it generated is therefore
  not reused by the next turn; a real conversation would reuse that too.) Sessions start as Poisson
  arrivals at rate / turns, so that requests come at about the rate.

Prompt ids are drawn as for `random` (sweep.PROMPT_IDS): one seeded generator per sweep.
"""

import itertools
import math
import random
from dataclasses import dataclass, field

KINDS = ("random", "shared-prefix", "multi-turn")
PROMPT_IDS = (3, 256)  # [low, high): below every vocabulary, clear of the usual specials 0..2


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*PROMPT_IDS) for _ in range(length)]


def poisson_gaps(rate: float, n: int, rng: random.Random) -> list[float]:
    """Seconds before each of n arrivals: exponential with mean 1/rate; all 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


@dataclass
class Plan:
    prompts: list[list[int]]
    dues: list[float]  # seconds after the run's start, at the earliest
    after: list[int | None] = field(default_factory=list)  # the request whose end it waits for (+ think_s)
    users: list[str | None] = field(default_factory=list)  # OpenAI's `user`: the session
    think_s: float = 0.0

    def __post_init__(self):
        self.after = self.after or [None] * len(self.prompts)
        self.users = self.users or [None] * len(self.prompts)

    def owners(self, processes: int) -> list[int]:
        """Which client process sends each request: a session's turns all in one (they wait on each
        other), sessions dealt round-robin."""
        root: list[int] = []
        for i, a in enumerate(self.after):
            root.append(i if a is None else root[a])
        rank = {r: k for k, r in enumerate(sorted(set(root)))}
        return [rank[r] % processes for r in root]


def longest_prompt(kind: str, input_len: int, output_len: int, prefix_len: int, turns: int) -> int:
    if kind == "shared-prefix":
        return prefix_len + input_len
    if kind == "multi-turn":
        return prefix_len + turns * input_len + (turns - 1) * output_len
    return input_len


def plan(kind: str, n: int, rate: float, rng: random.Random, input_len: int, output_len: int,
         prefix_len: int = 0, prefixes: int = 1, turns: int = 1, think_s: float = 0.0, run: str = "") -> Plan:
    """`n` requests at `rate` requests/s. `run` tells this rate's sessions from another rate's."""
    if kind == "random":
        return Plan([random_prompt(rng, input_len) for _ in range(n)],
                    list(itertools.accumulate(poisson_gaps(rate, n, rng))))
    if kind == "shared-prefix":
        shared = [random_prompt(rng, prefix_len) for _ in range(prefixes)]
        return Plan([rng.choice(shared) + random_prompt(rng, input_len) for _ in range(n)],
                    list(itertools.accumulate(poisson_gaps(rate, n, rng))))
    assert kind == "multi-turn", kind
    system = random_prompt(rng, prefix_len)
    sessions = -(-n // turns)
    starts = list(itertools.accumulate(poisson_gaps(rate / turns, sessions, rng)))
    p = Plan([], [], [], [], think_s)
    for s, start in enumerate(starts):
        history = list(system)
        for t in range(min(turns, n - s * turns)):
            history += random_prompt(rng, input_len)
            p.prompts.append(list(history))
            p.dues.append(start)
            p.after.append(None if t == 0 else len(p.prompts) - 2)
            p.users.append(f"bench{run}-{s}")
            history += random_prompt(rng, output_len)  # the answer's stand-in
    return p
