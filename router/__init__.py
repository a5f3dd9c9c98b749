"""HTTP and gRPC front ends, routing policies, the request lifecycle (not built yet)."""
