"""A serving process's garbage collector, set once the process has built what it keeps for life:
the router (an event loop that takes in bursts of requests) and every worker (an engine thread whose
steps are host-bound for short batches and long prompts).

CPython's defaults collect the youngest generation every 700 allocations; each collection promotes
the objects still alive, and the oldest generation's collections walk every object the process ever
kept: its imported modules, torch's and Ray's objects, the model's modules, FastAPI's and pydantic's
schemas — tens of milliseconds each. In a router that lands on the loop in the middle of a burst; in
a worker it lands inside a step (a 48-layer MoE step allocates thousands of Python objects), whatever
thread allocated last, and stretches the step every request in it waits for. So, once built:

- what exists then is frozen (gc.freeze): it lives as long as the process, and no collection walks
  it again;
- the youngest generation is collected every GEN0_THRESHOLD allocations: most objects of a request
  or a step are freed by reference counting long before, and fewer collections promote fewer of
  those still in flight. Cyclic garbage waits a little longer: a few MB at most.
"""

import gc

GEN0_THRESHOLD = 50_000


def settle() -> None:
    """Call once the process's lasting objects are built (a router's app and server; a worker's
    engine, KV cache and connector), before it serves."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
