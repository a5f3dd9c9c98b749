"""What every worker process shares: one engine in a role, its loop thread, its streams to the routers; and the colocated worker."""
