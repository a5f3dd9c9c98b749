"""What `pdserve up` checks before anything starts, each failure naming its key: the model can be
found and fits, the optional packages the file asks for are installed, the TLS files serve, the
API keys load; and a plain warning when the service is open to the network."""

import os
from collections.abc import Callable

from pdserve.config import ClusterConfig


def checked(cfg: ClusterConfig, log: Callable[[str], None]) -> list:
    """Every check, in order; returns the API keys (empty: the service is open)."""
    check_model(cfg)
    check_extras(cfg)
    check_tls_files(cfg)
    keys = api_keys(cfg, log)
    warn_if_open(cfg, keys, log)
    return keys


def check_model(cfg: ClusterConfig) -> None:
    """Fail before anything starts when the model cannot be found."""
    from pdserve.control.model_fit import check_model_fit
    from pdserve.models import resolve_model_args

    try:
        args = resolve_model_args(cfg.model.path)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"model.path: {e}") from None
    check_model_fit(cfg, args)


def check_extras(cfg: ClusterConfig) -> None:
    """Fail before anything starts when the file asks for a part whose optional packages are missing."""
    import importlib.util

    from pdserve.kvtransfer.backends.nixl_find import nixl_module

    if cfg.kv_transfer.backend == "nixl" and cfg.prefill.replicas and nixl_module() is None:
        raise ValueError("kv_transfer.backend: 'nixl' needs the nixl package: pip install 'pdserve[nixl]', "
                         "or set kv_transfer.backend: tcp")
    if cfg.router.grpc_port is not None and importlib.util.find_spec("grpc_health") is None:
        raise ValueError("router.grpc_port: the gRPC front end needs the grpc packages: pip install "
                         "'pdserve[grpc]', or set router.grpc_port: null")


def check_tls_files(cfg: ClusterConfig) -> None:
    """Fail before anything starts when the TLS files cannot serve (missing, not a pair)."""
    if cfg.router.tls_certfile:
        from pdserve.router.tls import check_tls

        check_tls(cfg.router.tls_certfile, cfg.router.tls_keyfile)


def api_keys(cfg: ClusterConfig, log: Callable[[str], None]) -> list:
    """The API keys (router.api_keys_file, PDSERVE_API_KEYS), checked before anything starts, as the
    routers take them (ApiKey: names, hashes and limits; the keys themselves stay here). Empty: no keys."""
    from pdserve.router.tenants import ADMIN_ENV_VAR, ENV_VAR, load_api_keys

    keys = load_api_keys(cfg.router.api_keys_file, os.environ.get(ENV_VAR), cfg.router.replicas,
                         os.environ.get(ADMIN_ENV_VAR))
    if keys:
        log(f"{len(keys)} API key{'s' if len(keys) > 1 else ''}: " + ", ".join(k.name for k in keys))
    return keys


def warn_if_open(cfg: ClusterConfig, keys: list, log: Callable[[str], None]) -> None:
    """Say once, plainly, that the service is open to the network: no key asked on a public address."""
    import ipaddress

    from pdserve.router.tenants import ENV_VAR

    host = cfg.router.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        loopback = False
    if keys or loopback:
        return
    where = "every network interface" if host in ("0.0.0.0", "::", "") else host
    log(f"WARNING: no API keys, and the router listens on {host} ({where}): anyone who reaches its ports "
         f"can generate, and read /metrics and /dashboard. Set router.api_keys_file or {ENV_VAR}, or "
         f"router.host: 127.0.0.1 to serve this host only")
