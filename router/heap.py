"""The router process's garbage collector, set for an event loop that admits bursts of requests.

Every request allocates a few hundred container objects (its body, its model, tasks, futures, its
events), and hundreds are alive at once while a burst is admitted. With CPython's defaults the
youngest generation is collected every 700 allocations, each collection promotes the objects of the
requests still in flight, and the oldest generation's collections walk every object the process
ever kept: its imported modules, FastAPI's and pydantic's schemas, Ray's — tens of milliseconds each,
on the loop, in the middle of a burst. So, once the router has started:

- what exists then is frozen (gc.freeze): it lives as long as the process, and no collection walks
  it again;
- the youngest generation is collected every GEN0_THRESHOLD allocations: most of a request's objects
  are freed by reference counting long before, and fewer collections promote fewer of the objects of
  requests in flight. Cyclic garbage waits a little longer: a few MB at most.
"""

import gc

GEN0_THRESHOLD = 50_000


def settle() -> None:
    """Call once the router's objects are built (its app, core, server), before it serves."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
