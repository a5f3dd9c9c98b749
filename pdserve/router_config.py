"""`router:` of cluster.yaml (ClusterConfig.router): the routers' ports, policy, limits, keys, TLS,
admission and where prompts are computed, validated on load like the rest of the configuration
(pdserve/config.py)."""

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = "0.0.0.0"
    # 0: any free port (`pdserve up` prints the one taken); null turns gRPC off.
    http_port: int = Field(default=8000, ge=0, le=65535)
    grpc_port: int | None = Field(default=50051, ge=0, le=65535)
    # prefix-aware: a prompt goes where its prefix is cached, weighed against each replica's queue
    # (the replicas' KV events; a session — OpenAI's `user` — sticks to its replicas); kv-aware: the
    # decode replica with the most free KV blocks, the prefill replica with the fewest of our
    # requests; round-robin.
    policy: Literal["prefix-aware", "kv-aware", "round-robin"] = "prefix-aware"
    # Router processes, all on the controller's node, serving the same HTTP and gRPC ports
    # (SO_REUSEPORT: the kernel spreads connections over them). Each also has a port of its own
    # for its /metrics (`pdserve status` lists them).
    replicas: int = Field(default=1, ge=1, le=64)
    # A request whose replica is lost (died, or was cut off at a drain's end) moves to a live one, its
    # prompt and the tokens already streamed prefilled again; at most this many times. 0: never moves.
    migration_limit: int = Field(default=3, ge=0)
    # How long a request (new, or moving) waits for a live replica of a role that has none now (the
    # controller is starting a replacement); then 503 naming the role (a moving request: an error event).
    replica_wait_s: float = Field(default=30.0, ge=0)
    # Larger request bodies get 413 before they are read in full or tokenized.
    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # The most choices a request may ask for per prompt (`n`, `best_of`); more is a 400 naming the field.
    max_n: int = Field(default=16, ge=1, le=1024)
    # How tool calls are read out of a chat's text (router/tool_parsers.py; vLLM's --tool-call-parser):
    # auto picks the format the model's chat template writes.
    tool_call_parser: Literal["auto", "hermes", "deepseek_v3", "mistral"] = "auto"
    # Slow clients are shed (router/http_deadlines.py): a connection whose request line and headers
    # have not all arrived header_timeout_s after its first byte (or after it opened) is closed;
    # a body not read in full within body_timeout_s gets 408 and the connection closes; a stream
    # whose client has not taken its events for sse_write_timeout_s is cut off and its request
    # aborted (its KV blocks freed). Past max_connections open connections, new requests get 503.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A kept-alive connection idle this long is closed. Longer than the clients' own pools keep one
    # (httpx 5 s, aiohttp 15 s, a load balancer's 60 s): a client that reuses a connection just as the
    # server closes it loses the request it sent on it (with uvicorn's 5 s default a test's bench lost
    # one so, by every sign: ServerDisconnectedError, nothing else amiss).
    http_keep_alive_s: float = Field(default=75.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    sse_write_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=2048, ge=1)
    # Prompts waiting for (or on) the router's two tokenizing threads; past it a request gets 429.
    max_tokenize_queue: int = Field(default=256, ge=1)
    # FastAPI's /docs, /redoc and /openapi.json: off unless asked for (they map the whole API).
    openapi_docs: bool = False
    # gRPC server reflection: null (the default) serves it only without API keys.
    grpc_reflection: bool | None = None
    # gRPC calls served at once (more: RESOURCE_EXHAUSTED); keepalive: the server pings a connection
    # idle this long and closes it when the ping goes unanswered for 20 s, and refuses client pings
    # more often than every 10 s (a ping flood); a connection with no call for grpc_max_idle_s closes.
    grpc_max_concurrent_rpcs: int = Field(default=2048, ge=1)
    grpc_keepalive_s: float = Field(default=60.0, gt=0)
    grpc_max_idle_s: float = Field(default=600.0, gt=0)
    # API keys (router/tenants.py): a YAML file of keys, each with a name, optional requests_per_minute,
    # tokens_per_minute and max_concurrent, a priority (the best its requests get), a cache_group
    # (keys sharing prefix-cache blocks) and admin (may read /metrics and /dashboard, closed to other
    # keys and to none); PDSERVE_API_KEYS adds keys from the environment. Read by `pdserve up` at
    # start. No file and no variable: no key is asked for, and `pdserve up` says so on a public address.
    api_keys_file: str | None = None
    # TLS for HTTP and gRPC: a PEM certificate chain and its private key; both or neither.
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    # How requests, aborts and token deltas move between routers and workers: `direct`, a socket per
    # router-worker pair (pdserve/channel/); `ray`, Ray actor calls (the path before the channel).
    channel: Literal["direct", "ray"] = "direct"
    # How a router reaches a worker over the direct channel: `auto`, a Unix socket on its own host and
    # TCP to other hosts, whose frames are sealed (AES-256-GCM under keys from the cluster's token);
    # `tcp`, TCP (sealed) to every worker, its own host's too (a one-host check of the sealed path).
    channel_transport: Literal["auto", "tcp"] = "auto"

    @field_validator("api_keys_file", "tls_certfile", "tls_keyfile")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # Relative to where `pdserve up` reads the file: the routers run on its node, but in Ray's
        # working directory.
        return os.path.abspath(os.path.expanduser(v)) if v else v

    @model_validator(mode="after")
    def _tls_pair(self) -> "RouterConfig":
        given = {k: v for k in ("tls_certfile", "tls_keyfile") if (v := getattr(self, k))}
        if len(given) == 1:
            missing = ({"tls_certfile", "tls_keyfile"} - set(given)).pop()
            raise PydanticCustomError("topology", "{allowed}", {
                "keys": {f"router.{k}": v for k, v in given.items()},
                "allowed": f"TLS needs both router.tls_certfile and router.tls_keyfile: set router.{missing} too, "
                           f"or neither"})
        return self
    # Admission control (router/admission.py). A request that no replica can take now — every decode
    # replica's sequence slots or KV blocks taken, or every prefill (colocated) replica holding
    # max_queued_per_replica of this router's requests that have no first token yet — waits in this
    # router's queue, by priority then arrival, at most queue_wait_s; past max_queued waiting, a new
    # request gets 429 (or takes the place of the lowest-priority one waiting, which gets the 429).
    # 0: no queue, 429 at once.
    max_queued: int = Field(default=1024, ge=0)
    max_queued_per_replica: int = Field(default=256, ge=1)
    queue_wait_s: float = Field(default=30.0, gt=0)
    # Refuse at once (429, Retry-After) a request whose predicted time to first token — from what is
    # queued ahead of it and the replicas' measured step costs — is over slo.ttft_ms, rather than
    # queue it into a miss. Off by default: the SLO must be one the service is meant to keep.
    refuse_over_slo: bool = False
    # Where a disaggregated cluster's prompts are computed (router/prefill_site.py): on a prefill
    # replica (remote: the KV moves), or on the decode replica that decodes it (local: its steps mix
    # the prompt's chunks with its decoders', paced within slo.tpot_ms). adaptive: each request where
    # its forecast first token comes sooner; remote: on a prefill replica while one can take it.
    # Either way a request is prefilled locally while no prefill replica can take it (every one
    # down, draining or unpaired) instead of waiting for one. Default adaptive: on two H200s it met
    # or beat every-prompt-remote at every SLO pair measured (docs/benchmarks.md, adaptive
    # disaggregation).
    prefill_site: Literal["adaptive", "remote"] = "adaptive"
    # A prompt with at most this many tokens to compute is prefilled locally, whatever the forecast.
    local_prefill_tokens: int = Field(default=0, ge=0)
