"""The router (installed as pdserve.router): HTTP and gRPC front ends, routing, the request lifecycle."""
