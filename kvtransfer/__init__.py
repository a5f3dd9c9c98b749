"""The KV-connector API and its backends (NIXL, TCP) (not built yet)."""
