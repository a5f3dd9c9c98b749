"""API keys: who may use the service, under which limits, at which default priority.

Keys come from a YAML file (router.api_keys_file) and from the PDSERVE_API_KEYS environment
variable, read by `pdserve up` before anything starts. What travels to the routers (ApiKey) holds
each key's SHA-256, never the key itself. With no key configured the service is open, as before.

The keys file:

    keys:
      - name: team-a              # the key's name in /metrics and in errors (never the key)
        key: sk-team-a-0123456789
        requests_per_minute: 600  # optional: no limit when left out
        tokens_per_minute: 200000 # optional: prompt + max_tokens charged as a request arrives, the unused part refunded
        priority: 1               # optional (0): this key's priority; a request may ask for a worse one, never a better
        max_concurrent: 8         # optional: requests of this key in flight at once (429 past it)
        cache_group: team-a       # optional: keys of one group share prefix-cache blocks; else each key its own
        admin: false              # optional: the key may read /metrics and /dashboard (when keys are on)

PDSERVE_API_KEYS: keys separated by commas, each `key` or `name:key` (split at the first colon; an
unnamed key is called env-<its position>); no limits. PDSERVE_ADMIN_KEY: one more key, named admin,
that may read /metrics and /dashboard (as `admin: true` in the file): with `pdserve serve --api-key`,
the operator's; also what `pdserve status --watch` sends to read the routers' /metrics."""

import hashlib
import hmac
import re
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from pdserve.cluster_view import ADMIN_KEY_VAR
from pdserve.config import ConfigError
from pdserve.protocol import InvalidRequestError
from pdserve.router.rate_limits import Clock, KeyLimits, RateLimited

ENV_VAR = "PDSERVE_API_KEYS"
ADMIN_ENV_VAR = ADMIN_KEY_VAR  # PDSERVE_ADMIN_KEY
FILE_KEY = "router.api_keys_file"


@dataclass(frozen=True)
class ApiKey:
    """One key as configured, its secret replaced by its SHA-256: what the routers are given."""

    name: str
    digest: bytes  # hashlib.sha256(key).digest()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: int = 0
    max_concurrent: int | None = None
    cache_group: str | None = None
    admin: bool = False


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# -- loading -------------------------------------------------------------------------------------


class _Entry(BaseModel):
    """One key of the keys file (or of PDSERVE_API_KEYS)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    key: str
    requests_per_minute: StrictInt | None = Field(default=None, ge=1)
    tokens_per_minute: StrictInt | None = Field(default=None, ge=1)
    priority: StrictInt = 0
    max_concurrent: StrictInt | None = Field(default=None, ge=1)
    cache_group: str | None = None
    admin: StrictBool = False

    @field_validator("name", "cache_group")
    @classmethod
    def _plain(cls, v: str) -> str:
        # A label value in /metrics and a word in error messages: plain characters only.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}", v):
            raise ValueError("must be 1 to 64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit")
        return v

    @field_validator("key")
    @classmethod
    def _bearer_token(cls, v: str) -> str:
        # What a client can send as `Authorization: Bearer <key>`: visible ASCII, no spaces.
        if not v or not all("!" <= c <= "~" for c in v):
            raise ValueError("must be a non-empty string of visible ASCII characters without spaces (it is "
                             "sent as 'Authorization: Bearer <key>')")
        return v


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list = Field(min_length=1)  # each validated on its own, so that an error names its entry


def load_api_keys(path: str | None, env: str | None, routers: int = 1, admin: str | None = None) -> list[ApiKey]:
    """The keys of the keys file at `path`, of `env` (PDSERVE_API_KEYS' value) and `admin`
    (PDSERVE_ADMIN_KEY's), checked: raises ConfigError naming the file or variable and the entry.
    routers: router.replicas, each of which enforces its share of a limit."""
    entries: list[tuple[str, _Entry]] = []  # (where it was given, the entry)
    if path is not None:
        entries += _file_entries(path)
    if env is not None:
        entries += _env_entries(env)
    if admin is not None:
        entries.append(_entry(ADMIN_ENV_VAR, {"name": "admin", "key": admin, "admin": True}))
    _check_unique(entries)
    keys = []
    for where, e in entries:
        for limit in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(e, limit)
            if value is not None and value < routers:
                raise ConfigError(f"{where}: {limit}: {value} is not allowed — router.replicas is {routers}, "
                                  f"each router enforces limit / {routers}, and a share below 1 lets nothing through; "
                                  f"set at least {routers}")
        keys.append(ApiKey(e.name, key_digest(e.key), e.requests_per_minute, e.tokens_per_minute, e.priority,
                           e.max_concurrent, e.cache_group, e.admin))
    return keys


def _file_entries(path: str) -> list[tuple[str, _Entry]]:
    import yaml

    where = f"{FILE_KEY}: {path}"
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    try:
        keys = _KeysFile.model_validate(raw).keys
    except ValidationError:
        raise ConfigError(f"{where}: must be a mapping with one key, keys: a list of keys, each with its name "
                          f"and key (and optionally requests_per_minute, tokens_per_minute, priority, max_concurrent, "
                          f"cache_group, admin)") from None
    return [_entry(f"{where}: keys[{i}]", raw_entry) for i, raw_entry in enumerate(keys)]


def _env_entries(value: str) -> list[tuple[str, _Entry]]:
    out = []
    for i, item in enumerate(value.split(","), 1):
        item = item.strip()
        if not item:
            raise ConfigError(f"{ENV_VAR}: entry {i} is empty — keys are separated by commas, each 'key' or "
                              f"'name:key' (unset the variable to serve without keys)")
        name, colon, key = item.partition(":")
        out.append(_entry(f"{ENV_VAR}: entry {i}", {"name": name, "key": key} if colon else
                          {"name": f"env-{i}", "key": item}))
    return out


def _entry(where: str, raw) -> tuple[str, _Entry]:
    """One entry validated; the error names the entry (and its name where it has one), never its key."""
    name = raw.get("name") if isinstance(raw, dict) else None
    if isinstance(name, str) and name:
        where += f" (name {name!r})"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping with name and key")
    try:
        return where, _Entry.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"{field}: unknown field (allowed: {', '.join(_Entry.model_fields)})")
            elif err["type"] == "missing":
                problems.append(f"{field}: missing")
            elif field == "key":  # the secret is never echoed
                problems.append(f"key: {err['msg'].removeprefix('Value error, ')}")
            else:
                problems.append(f"{field}: {err['input']!r} is not allowed — "
                                f"{err['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None


def _check_unique(entries: list[tuple[str, _Entry]]) -> None:
    names: dict[str, str] = {}
    keys: dict[bytes, str] = {}
    for where, e in entries:
        if e.name in names:
            raise ConfigError(f"{where}: name {e.name!r} is taken by {names[e.name]}; names must be unique")
        digest = key_digest(e.key)
        if digest in keys:
            raise ConfigError(f"{where}: its key is the key of {keys[digest]} too; keys must be unique")
        names[e.name], keys[digest] = where, where


# -- serving -------------------------------------------------------------------------------------


class Unauthenticated(Exception):
    """No key, or a key that is not ours: HTTP 401, gRPC UNAUTHENTICATED."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "missing" or "invalid" (pdserve_auth_failures_total's label)


class Tenant:
    """A key as a router serves it: its name (the label in /metrics), its priority (the best its
    requests may have), this router's buckets of its limits (None: no limit) and share of its
    concurrency cap, the scope of its prefix-cache blocks, and whether it may read the operators'
    endpoints."""

    __slots__ = ("name", "digest", "priority", "limits", "max_concurrent", "in_flight", "cache_scope", "admin")

    def __init__(self, key: ApiKey, routers: int, clock: Clock):
        self.name, self.digest, self.priority, self.admin = key.name, key.digest, key.priority, key.admin
        self.limits = (KeyLimits(key.name, key.requests_per_minute, key.tokens_per_minute, routers, clock)
                       if key.requests_per_minute or key.tokens_per_minute else None)
        self.max_concurrent = key.max_concurrent // routers if key.max_concurrent else None  # this router's share
        self.in_flight = 0
        # Distinct prefixes ("group:" / "key:"), so that no key's name can pose as a group's.
        self.cache_scope = f"group:{key.cache_group}" if key.cache_group else f"key:{key.name}"

    def priority_of(self, asked: int | None) -> int:
        """A request's priority: its own where it asks for one no better (lower) than its key's, else
        the key's: a tenant cannot jump the queue of others by asking."""
        return self.priority if asked is None else max(asked, self.priority)

    def cache_salt(self, asked: str | None) -> str:
        """The prefix-cache salt of a request of this key: the key's scope (its group's, where it has
        one), then the request's own `cache_salt`, which can split a key's cache but never join another's."""
        return self.cache_scope if asked is None else f"{self.cache_scope}\0{asked}"


class Charge:
    """A request charged to a key, from its arrival (before its prompt is tokenized) to its end:
    its place under the key's concurrency cap, the tokens it was charged once they are known, and
    what goes back (the unused part of max_tokens; all its tokens when the service refused it) once."""

    __slots__ = ("tenant", "metrics", "prompt_tokens", "max_tokens", "headers", "done")

    def __init__(self, tenant: Tenant, metrics, headers: dict[str, str]):
        self.tenant, self.metrics = tenant, metrics
        self.prompt_tokens = self.max_tokens = 0
        self.headers = headers
        self.done = False
        tenant.in_flight += 1

    def tokens(self, prompt_tokens: int, max_tokens: int, prompt_param: str = "prompt",
               max_tokens_param: str = "max_tokens") -> None:
        """Charge the prompt (now tokenized) and max_tokens (rate_limits.KeyLimits.charge_tokens:
        raises RateLimited or, for a request that can never fit, InvalidRequestError naming the field)."""
        tenant = self.tenant
        if tenant.limits is not None:
            try:
                self.headers = tenant.limits.charge_tokens(prompt_tokens, max_tokens, prompt_param, max_tokens_param)
            except (RateLimited, InvalidRequestError):
                if self.metrics is not None:
                    self.metrics.count_key_request(tenant.name, "rate_limited")
                raise
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        if self.metrics is not None:
            self.metrics.count_key_tokens(tenant.name, prompt=prompt_tokens)

    def cancel(self) -> None:
        """The request was refused before it was served (its fields, its prompt, its tokens over a
        limit): its place under the cap and any tokens go back; the request itself stays charged, so
        that refused requests are no free way to make the router tokenize."""
        if self.done:
            return
        self.done = True
        self.tenant.in_flight -= 1
        if self.tenant.limits is not None:
            self.tenant.limits.refund(self.prompt_tokens + self.max_tokens)

    def end(self, generated: int, outcome: str) -> None:
        """The request ended: outcome "ok", "error" (after it started), "refused" (the service
        could not take it: nothing was computed, everything goes back) or "aborted" (the client left)."""
        if self.done:
            return
        self.done = True
        self.tenant.in_flight -= 1
        if self.tenant.limits is not None:
            unused = max(0, self.max_tokens - generated)
            self.tenant.limits.refund(unused + (self.prompt_tokens if outcome == "refused" else 0))
        if self.metrics is not None:
            self.metrics.count_key_request(self.tenant.name, "error" if outcome == "refused" else outcome)
            self.metrics.count_key_tokens(self.tenant.name, generation=generated)


class Tenants:
    """The keys one router takes. Used from the router's one event loop (HTTP and gRPC): no lock."""

    def __init__(self, keys: list[ApiKey], routers: int = 1, metrics=None, clock: Clock = time.monotonic):
        """metrics: the router's Metrics (per-key series), or None."""
        assert keys, "no keys: the service is open, and has no Tenants"
        self.metrics = metrics
        self._by_digest = {k.digest: Tenant(k, routers, clock) for k in keys}

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an Authorization header's value ("Bearer <key>"); raises Unauthenticated."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            self._failed("missing")
            raise Unauthenticated("missing", "no API key: send it in the Authorization header as "
                                             "'Authorization: Bearer <key>'")
        # Looked up by the key's SHA-256, then compared in constant time: whatever a lookup's timing
        # could tell is about the hash of what the client sent, which it cannot steer toward a stored
        # one (that would take a preimage), so no key leaks a character at a time. A lookup, not a
        # comparison with every key: a key's check stays O(1) with thousands of keys.
        digest = key_digest(token)
        tenant = self._by_digest.get(digest)
        if tenant is None or not hmac.compare_digest(tenant.digest, digest):
            self._failed("invalid")
            raise Unauthenticated("invalid", "invalid API key: it is not one this service accepts")
        return tenant

    def admit(self, tenant: Tenant) -> Charge:
        """Charge a request to its key as it arrives, before anything is done for it (its prompt is
        not tokenized yet): a place under the key's concurrency cap and one request of its
        requests_per_minute; a key out of either, or with an empty tokens_per_minute bucket, is
        refused here (RateLimited: 429). Its tokens are charged once counted (Charge.tokens)."""
        headers = {}
        try:
            if tenant.max_concurrent is not None and tenant.in_flight >= tenant.max_concurrent:
                raise RateLimited(f"API key {tenant.name!r} has {tenant.in_flight} requests in flight on this "
                                  f"router, its max_concurrent share; try again when one ends", "requests", 1.0,
                                  {"Retry-After": "1"})
            if tenant.limits is not None:
                headers = tenant.limits.charge_request()
        except RateLimited:
            if self.metrics is not None:
                self.metrics.count_key_request(tenant.name, "rate_limited")
            raise
        return Charge(tenant, self.metrics, headers)

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_auth_failure(reason)
