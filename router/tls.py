"""TLS for the router's ports (router.tls_certfile, router.tls_keyfile): HTTPS by uvicorn, gRPC over
TLS. Both front ends read the same PEM files: the certificate chain (the server's certificate
first, then any intermediates) and its private key (unencrypted: a router starts unattended)."""

import os
import ssl

KEYS = "router.tls_certfile and router.tls_keyfile"


def check_tls(certfile: str, keyfile: str) -> None:
    """Fail before anything starts (ValueError naming the keys) when the files cannot serve TLS: missing,
    unreadable, not PEM, or a key that is not the certificate's."""
    for path in (certfile, keyfile):
        if not os.path.isfile(path):  # (OpenSSL's own error does not say which)
            raise ValueError(f"{KEYS}: {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except (OSError, ValueError) as e:  # ssl.SSLError too: not PEM, a key that is not the certificate's, encrypted
        raise ValueError(f"{KEYS}: cannot serve TLS with {certfile} and {keyfile}: {_reason(e)} (a PEM "
                         f"certificate chain and its unencrypted private key are needed)") from None


def _no_password() -> str:
    raise ValueError("the private key is encrypted")


def _reason(e: Exception) -> str:
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)


def uvicorn_options(certfile: str | None, keyfile: str | None) -> dict:
    """uvicorn.Config's TLS arguments: none without a certificate."""
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile} if certfile else {}


def grpc_credentials(certfile: str | None, keyfile: str | None):
    """grpc.ssl_server_credentials of the files; None without a certificate (an insecure port)."""
    if not certfile:
        return None
    import grpc

    with open(keyfile, "rb") as f:
        key = f.read()
    with open(certfile, "rb") as f:
        chain = f.read()
    return grpc.ssl_server_credentials([(key, chain)])
