"""The direct channel between routers and workers: requests, aborts and token deltas over one socket
per router–worker pair (Unix-domain on one host, TCP across hosts), off Ray. `wire.py` is the
frames, `worker_end.py` the worker's listener, `router_end.py` a router's link to one worker."""
