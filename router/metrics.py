"""The router's Prometheus metrics: request latencies from the front end, replica and KV figures from the Ray side."""

import collections
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, ProcessCollector, generate_latest

from pdserve.router.loop_metrics import LoopCounter, LoopHistogram  # written from the router's loop only
from pdserve.router.token_tally import TokenTally
from pdserve.router.vllm_metrics import VLLMMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A request's phases before its first token: fine below 10 ms, where a hand-off's cost shows (p99 read off them).
# Edges 2.5 ms apart from 10 to 30 ms, 35 ms: a dispatch p99 set against an engine step of 15-30 ms (issue
# 40's bar) needs one near the step (an H200 run at 512 streams: a 28.5 ms step, the p99 in 25-30 ms).
_PHASE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225,
                  0.025, 0.0275, 0.03, 0.035, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

# HTTP has no status for "the client went away"; nginx's 499 is the usual label for it.
CLIENT_CLOSED = "499"


class Metrics:
    """Every pdserve router metric, in a registry of its own so several routers (or tests) share a process."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, router: str = "", model_name: str = "") -> None:
        """router: the name of the router whose metrics these are (several may share a port);
        model_name: the served model's id (vLLM's series carry it, router/vllm_metrics.py)."""
        self.router = router  # (the dashboard names the router that answered it)
        self._pairing_seen: dict[str, int] = {}  # the controller's pairing failures counted so far, by reason
        self.registry = CollectorRegistry()
        r = self.registry
        # Streamed tokens' series, added to per turn of the loop; first in the registry: a collection
        # flushes it before it reads them.
        self.streamed = TokenTally()
        r.register(self.streamed)
        if router:
            # The process's own CPU, memory and open files (process_cpu_seconds_total, ...), as every
            # Prometheus client exports them: what a router costs (pdserve bench: tokens per router CPU-s).
            ProcessCollector(registry=r)
            # Which router answered a scrape: through a shared port any of them may (see pdserve bench).
            Gauge("pdserve_router_info", "The router serving this /metrics", ["router"], registry=r).labels(
                router=router).set(1)
        self.requests = LoopCounter("pdserve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.aborts = LoopCounter("pdserve_requests_aborted", "Requests aborted before they finished, by who saw it",
                              ["role"], registry=r)
        self.ttft = LoopHistogram("pdserve_ttft_seconds", "Time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("pdserve_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = LoopHistogram("pdserve_e2e_latency_seconds", "Time from request arrival to its last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = LoopHistogram("pdserve_prompt_tokens", "Prompt length of each request, in tokens",
                                       buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_tokens = LoopHistogram("pdserve_generation_tokens", "Tokens generated per finished request",
                                           buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_length = Gauge("pdserve_queue_length", "Requests at a replica, running or waiting",
                                  ["role", "replica"], registry=r)
        self.replica_up = Gauge("pdserve_replica_up", "1 while a replica answers, 0 once the router counts it "
                                "down (process died, engine loop stopped, or no answer)", ["role", "replica"],
                                registry=r)
        self.kv_blocks_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use at a replica", ["replica"],
                                    registry=r)
        self.kv_blocks_total = Gauge("pdserve_kv_blocks_total", "KV blocks a replica has", ["replica"], registry=r)
        self.kv_bytes_moved = LoopCounter("pdserve_kv_bytes_moved", "KV cache bytes sent from prefill to decode",
                                      registry=r)
        self.kv_transfer = LoopHistogram("pdserve_kv_transfer_seconds", "Time to move one request's KV cache",
                                     buckets=_TRANSFER_BUCKETS, registry=r)
        self.phase = LoopHistogram("pdserve_request_phase_seconds", "Time of each phase of a request on its way to "
                               "its first token, as the router sees it: admit (from the request's arrival at "
                               "the lifecycle until it is first handed to a worker: admission, placing, a wait "
                               "for room), reserve (decode KV blocks), "
                               "dispatch (handed to the prefill or colocated replica), first_token "
                               "(from then on until its first token reached the router)", ["phase"],
                               buckets=_PHASE_BUCKETS, registry=r)
        self.restarts = LoopCounter("pdserve_replica_restarts", "Times the controller replaced a replica (or a "
                                "router, role router) that died or hung with a fresh one", ["role", "replica"], registry=r)
        self.placed = LoopCounter("pdserve_replica_requests", "Requests this router handed to each replica (a "
                              "request that moved counts once on each replica it went to)", ["role", "replica"],
                              registry=r)
        self.migrations = LoopCounter("pdserve_request_migrations", "Requests moved to another replica after the one "
                                  "serving them was lost, by the role that was lost", ["role"], registry=r)
        self.prefill_sites = LoopCounter(
            "pdserve_prefill_site", "Attempts by where their prompt was computed: remote (a prefill replica, "
            "its KV moved), local (the decode replica that decodes it), colocated (a mixed cluster's colocated "
            "replica, whole), and why: sooner (the forecast first token), short (router.local_prefill_tokens), "
            "no_prefill (no prefill replica could take it), long (no forecast yet, or router.prefill_site: "
            "remote), balance (colocated: no forecast yet, fewer requests in flight per replica), room "
            "(colocated: the other path had no room, or no live replica)", ["site", "why"], registry=r)
        self.transfer_failures = LoopCounter(
            "pdserve_kv_transfer_failures", "KV transfers that failed between two live replicas, by reason: "
            "unpaired (a worker had no KV handshake with the other end: placed over another pair at once), "
            "failed (the prefill end gave up, or the lease ran out); the request moves to another pair",
            ["reason"], registry=r)
        self.pairing_failures = LoopCounter(
            "pdserve_kv_pairing_failures", "KV handshakes between a prefill and a decode worker that failed "
            "(the controller retries them with backoff), by reason: timeout, refused (a mismatch), died",
            ["reason"], registry=r)
        # Labelled by expert but summed over MoE layers: replicas x experts series, not x layers too.
        self.expert_tokens = LoopCounter("pdserve_expert_tokens", "Tokens routed to each expert at an expert-parallel "
                                     "decode replica, summed over MoE layers", ["replica", "expert"], registry=r)
        # In tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the share of
        # prompt tokens a replica did not have to compute.
        self.prefix_queries = LoopCounter("pdserve_prefix_cache_queries", "Prompt tokens a replica looked up in its "
                                      "prefix cache", ["replica"], registry=r)
        self.prefix_hits = LoopCounter("pdserve_prefix_cache_hits", "Prompt tokens a replica found in its prefix "
                                   "cache (of those looked up)", ["replica"], registry=r)
        # Per API key (router/tenants.py), labelled by the key's name, never the key: what each tenant
        # asked and got. Only with keys configured.
        self.key_requests = LoopCounter("pdserve_api_key_requests", "Requests under each API key, by outcome: ok, "
                                        "error, aborted (the client left), rate_limited (over a limit: 429; or "
                                        "one that can never fit: 400)", ["key", "outcome"], registry=r)
        self.key_prompt_tokens = LoopCounter("pdserve_api_key_prompt_tokens", "Prompt tokens of the requests "
                                             "charged to each API key", ["key"], registry=r)
        self.key_generation_tokens = LoopCounter("pdserve_api_key_generation_tokens", "Tokens generated for each "
                                                 "API key", ["key"], registry=r)
        # The replicas' internal endpoints (pdserve/refusals.py), as their stats say: a stranger's or a
        # broken peer's connections, frames and notices, refused or dropped.
        self.internal_refusals = LoopCounter(
            "pdserve_internal_refusals", "Connections, frames and notices a replica's internal endpoints "
            "refused or dropped, by endpoint (router_channel, kv_notices, kv_tcp, kv_ipc_inbox, kv_nixl) and "
            "reason", ["replica", "endpoint", "reason"], registry=r)
        self.auth_failures = LoopCounter("pdserve_auth_failures", "Requests refused for want of a valid API key "
                                         "(HTTP 401, gRPC UNAUTHENTICATED), by reason: missing, invalid", ["reason"],
                                         registry=r)
        # HTTP connections cut by the front end's deadlines and cap (router/http_deadlines.py), by
        # reason. Not exported yet: every exported metric has a panel in deploy/grafana/pdserve.json.
        self.connections_cut: collections.Counter[str] = collections.Counter()
        # What "only new KV moves" saves (a decode reservation reuses the decode replica's own prefix
        # cache; a prefill replica's prefix cache spares compute): the tokens each replica ran through
        # its model, and per decode replica the blocks it reused and the KV bytes that came in.
        self.tokens_computed = LoopCounter("pdserve_tokens_computed", "Tokens a replica ran through its model "
                                           "(prompt and generated; prefix-cache hits are not computed): at a "
                                           "prefill replica, the prompt tokens it computed", ["replica"], registry=r)
        self.kv_blocks_reused = LoopCounter("pdserve_kv_blocks_reused", "KV blocks a decode replica's reservations "
                                            "found in its own prefix cache: their KV did not move", ["replica"],
                                            registry=r)
        self.kv_bytes_received = LoopCounter("pdserve_kv_bytes_received", "KV cache bytes prefill replicas wrote "
                                             "into a decode replica", ["replica"], registry=r)
        # Admission control (router/admission.py, router/forecast.py).
        self.queue_depth = Gauge("pdserve_router_queue_depth", "Requests waiting in this router's admission queue "
                                 "for room at a replica", registry=r)
        self.queue_wait = LoopHistogram("pdserve_router_queue_wait_seconds", "Time an admitted request waited in "
                                        "this router's queue for room at a replica (0 when it found room at once)",
                                        buckets=_PHASE_BUCKETS, registry=r)
        self.refused = LoopCounter("pdserve_requests_refused", "Requests refused with 429 by admission control, by "
                                   "reason: predicted_ttft (forecast over slo.ttft_ms), queue_full, displaced (a "
                                   "higher priority took its place in the full queue), queue_timeout", ["reason"],
                                   registry=r)
        self.loop_lag = LoopHistogram("pdserve_router_loop_lag_seconds", "How much later than asked this router's "
                                      "event loop woke (router/loop_lag.py, every 50 ms): the pauses every stream "
                                      "on it waits out", buckets=_PHASE_BUCKETS, registry=r)
        self.ttft_forecast = LoopHistogram("pdserve_ttft_forecast_seconds", "The time to first token admission "
                                           "control forecast for each new request (router.refuse_over_slo)",
                                           buckets=_LATENCY_BUCKETS, registry=r)
        # The labelled series every request touches, looked up once: labels() costs more than the inc or
        # observe itself. (None of them is ever removed, so a cached one is never stale.)
        self._requests_by: dict[tuple[str, str], LoopCounter] = {}
        self._placed_by: dict[tuple[str, str], LoopCounter] = {}
        self._phase_by: dict[str, LoopHistogram] = {}
        self.vllm = VLLMMetrics(r, model_name)  # vLLM's names for the same figures
        self.streamed.feed(self.vllm.generation_tokens, (self.itl, self.vllm.itl))
        self._key_requests_by: dict[tuple[str, str], LoopCounter] = {}
        self._key_tokens_by: dict[str, tuple[LoopCounter, LoopCounter]] = {}  # (prompt, generation)

    # -- front end ----------------------------------------------------------------------------

    def request_started(self, endpoint: str, num_prompt_tokens: int,
                        on_end: Callable[[int, str], None] | None = None, max_tokens: int = 0) -> "RequestTimer":
        """A timer for one request handed to the core; it records TTFT, ITL, E2E and its final status.
        on_end(tokens generated, outcome) is called once when it ends (RequestTimer's outcomes)."""
        self.prompt_tokens.observe(num_prompt_tokens)
        self.vllm.prompt_len.observe(num_prompt_tokens)
        self.vllm.prompt_tokens.inc(num_prompt_tokens)
        if max_tokens:
            self.vllm.max_tokens.observe(max_tokens)
        return RequestTimer(self, endpoint, on_end)

    def count_request(self, endpoint: str, status: int | str) -> None:
        """Count a request that ended without a timer (rejected before generation)."""
        key = (endpoint, str(status))
        if (series := self._requests_by.get(key)) is None:
            series = self._requests_by[key] = self.requests.labels(*key)
        series.inc()

    # -- API keys -------------------------------------------------------------------------------

    def count_key_request(self, key: str, outcome: str) -> None:
        """A request under the key named `key` ended: ok, error, aborted or rate_limited."""
        if (series := self._key_requests_by.get((key, outcome))) is None:
            series = self._key_requests_by[key, outcome] = self.key_requests.labels(key, outcome)
        series.inc()

    def count_key_tokens(self, key: str, prompt: int = 0, generation: int = 0) -> None:
        """Prompt tokens charged, or tokens generated, under the key named `key`."""
        if (series := self._key_tokens_by.get(key)) is None:
            series = self._key_tokens_by[key] = (self.key_prompt_tokens.labels(key),
                                                 self.key_generation_tokens.labels(key))
        if prompt:
            series[0].inc(prompt)
        if generation:
            series[1].inc(generation)

    def count_connection_cut(self, reason: str) -> None:
        """An HTTP connection cut by a deadline or the cap (router/http_deadlines.py)."""
        self.connections_cut[reason] += 1

    def count_auth_failure(self, reason: str) -> None:
        """A request without a valid key: reason "missing" or "invalid"."""
        self.auth_failures.labels(reason).inc()

    # -- Ray side -----------------------------------------------------------------------------

    def count_abort(self, role: str) -> None:
        """A request aborted: role "router" (client disconnect), "prefill", "decode" or "colocated"."""
        self.aborts.labels(role=role).inc()

    def set_replica_stats(self, role: str, replica: str, running: int, waiting: int, kv_used: int,
                          kv_total: int) -> None:
        """Latest load figures of one replica."""
        self.queue_length.labels(role=role, replica=replica).set(running + waiting)
        self.vllm.replica(replica, (running, waiting, kv_used, kv_total))
        self.kv_blocks_used.labels(replica=replica).set(kv_used)
        self.kv_blocks_total.labels(replica=replica).set(kv_total)

    def set_replica_up(self, role: str, replica: str, up: bool) -> None:
        self.replica_up.labels(role=role, replica=replica).set(1 if up else 0)

    def remove_replica(self, role: str, replica: str) -> None:
        """Drop a replica's series once it is gone (scaled down or dead), so it stops showing stale load."""
        self.vllm.replica(replica, None)
        for gauge, labels in ((self.queue_length, (role, replica)), (self.kv_blocks_used, (replica,)),
                              (self.kv_blocks_total, (replica,))):
            try:
                gauge.remove(*labels)
            except KeyError:  # never reported: nothing to drop
                pass

    def count_restarts(self, role: str, replica: str, n: int) -> None:
        self.restarts.labels(role=role, replica=replica).inc(n)

    def count_placed(self, role: str, replica: str) -> None:
        if (series := self._placed_by.get((role, replica))) is None:
            series = self._placed_by[role, replica] = self.placed.labels(role, replica)
        series.inc()

    def count_migration(self, role: str) -> None:
        self.migrations.labels(role=role).inc()

    def count_prefill_site(self, site: str, why: str) -> None:
        self.prefill_sites.labels(site=site, why=why).inc()

    def count_transfer_failure(self, reason: str) -> None:
        self.transfer_failures.labels(reason=reason).inc()

    def set_pairing_failures(self, counts: dict[str, int]) -> None:
        """The controller's count of failed KV handshakes by reason, so far (it only grows)."""
        for reason, n in counts.items():
            series = self.pairing_failures.labels(reason=reason)
            seen = self._pairing_seen.get(reason, 0)
            if n > seen:
                series.inc(n - seen)
                self._pairing_seen[reason] = n

    def forget_replica(self, role: str, replica: str) -> None:
        """A replica scaled away: every series of it goes (not shown as down: it left on purpose)."""
        self.remove_replica(role, replica)
        try:
            self.replica_up.remove(role, replica)
        except KeyError:
            pass

    def count_expert_tokens(self, replica: str, new: list[int]) -> None:
        """Tokens routed to each expert since the last report (index = expert id)."""
        for expert, n in enumerate(new):
            if n > 0:  # (a restarted rank counts from 0 again: nothing to add)
                self.expert_tokens.labels(replica=replica, expert=str(expert)).inc(n)

    def count_prefix_cache(self, replica: str, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the replica's prefix cache since the last report, and found there."""
        if queries > 0:  # (a restarted replica counts from 0 again: its first report is all new)
            self.prefix_queries.labels(replica=replica).inc(queries)
        if hits > 0:
            self.prefix_hits.labels(replica=replica).inc(hits)

    def count_spec_decode(self, drafted: int, accepted: int) -> None:
        """Draft tokens a replica checked since the last report, and of those accepted."""
        if drafted > 0:  # (a restarted replica counts from 0 again: its first report is all new)
            self.vllm.spec_draft_tokens.inc(drafted)
        if accepted > 0:
            self.vllm.spec_accepted_tokens.inc(accepted)

    def count_kv_savings(self, replica: str, tokens_computed: int, blocks_reused: int, bytes_received: int) -> None:
        """Since the last report: tokens the replica computed, KV blocks it reused from its own prefix
        cache and KV bytes it received (decode)."""
        for counter, n in ((self.tokens_computed, tokens_computed), (self.kv_blocks_reused, blocks_reused),
                           (self.kv_bytes_received, bytes_received)):
            if n > 0:  # (a restarted replica counts from 0 again: its first report is all new)
                counter.labels(replica=replica).inc(n)

    def count_internal_refusals(self, replica: str, now: dict[str, dict[str, int]],
                                before: dict[str, dict[str, int]]) -> None:
        """A replica's refusals since the last report: `now` and `before` are its cumulative counts
        (endpoint -> reason -> how many; `before` empty for a fresh incarnation)."""
        for endpoint, reasons in now.items():
            was = before.get(endpoint, {})
            for reason, n in reasons.items():
                if n > was.get(reason, 0):
                    self.internal_refusals.labels(replica, endpoint, reason).inc(n - was.get(reason, 0))

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request spent `seconds` in `phase` (reserve, dispatch, first_token)."""
        if (series := self._phase_by.get(phase)) is None:
            series = self._phase_by[phase] = self.phase.labels(phase)
        series.observe(seconds)

    def set_queue_depth(self, n: int) -> None:
        self.queue_depth.set(n)
        self.vllm.queued(n)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)
        self.vllm.queue_time.observe(seconds)

    def count_refused(self, reason: str) -> None:
        """A request refused by admission control (429): predicted_ttft, queue_full, displaced, queue_timeout."""
        self.refused.labels(reason=reason).inc()

    def observe_forecast(self, seconds: float) -> None:
        self.ttft_forecast.observe(seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """One request's KV moved from prefill to decode: `nbytes` bytes in `seconds`."""
        self.kv_bytes_moved.inc(nbytes)
        self.kv_transfer.observe(seconds)

    def traffic(self) -> dict:
        """The cumulative figures the planner reads off this router (`pdserve tune`): requests
        arrived and their prompt tokens, requests finished and their generated tokens, and the TTFT
        and inter-token histograms ({upper bound: cumulative count}, math.inf for +Inf)."""
        self.streamed.flush()
        out: dict = {}
        for key, hist in (("prompt", self.prompt_tokens), ("generation", self.generation_tokens),
                          ("ttft", self.ttft), ("itl", self.itl)):
            buckets: dict[float, float] = {}
            for family in hist.collect():
                for s in family.samples:
                    if s.name.endswith("_count"):
                        out[f"{key}_count"] = s.value
                    elif s.name.endswith("_sum"):
                        out[f"{key}_sum"] = s.value
                    elif s.name.endswith("_bucket"):
                        buckets[float(s.labels["le"])] = s.value
            if key in ("ttft", "itl"):
                out[key] = buckets
        return out

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Timestamps of one request; `finished` or `aborted` records it once."""

    def __init__(self, metrics: Metrics, endpoint: str, on_end: Callable[[int, str], None] | None = None):
        self.metrics = metrics
        self.endpoint = endpoint
        self.on_end = on_end
        self.start = time.monotonic()
        self.first: float | None = None  # time of the first token
        self.last: float | None = None  # time of the latest token
        self.num_tokens = 0
        self.finish_reason: str | None = None  # as the last delta said
        self.done = False

    def tokens(self, n: int, finish_reason: str | None = None) -> None:
        """`n` new tokens arrived now, in one wake of the request's stream: the first gives TTFT,
        later wakes an inter-token latency each; finish_reason: the wake's last delta's."""
        self.finish_reason = finish_reason or self.finish_reason
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            self.metrics.vllm.ttft.observe(now - self.start)
            self.metrics.streamed.add(n)
        else:
            # One observation per wake, not per token: the wake's gap spread evenly over its tokens
            # (their mean ITL). While the router keeps up a wake carries one decode step's token;
            # a router behind its workers wakes once for several, and the histogram then counts
            # wakes, not tokens. (Added up at the end of the loop's turn: router/token_tally.py.)
            self.metrics.streamed.add(n, (now - self.last) / n)
        self.last = now
        self.num_tokens += n

    def finished(self, status: int | str = 200) -> None:
        """The request ended (normally, or with an error reported to a client still connected)."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.start)
        self.metrics.generation_tokens.observe(self.num_tokens)
        self.metrics.count_request(self.endpoint, status)
        vllm = self.metrics.vllm
        vllm.e2e.observe(now - self.start)
        vllm.generation_len.observe(self.num_tokens)
        if self.first is not None:
            vllm.prefill_time.observe(self.first - self.start)
            vllm.decode_time.observe(self.last - self.first)
        vllm.finished(self.finish_reason if str(status) == "200" else None)
        if self.on_end is not None:
            self.on_end(self.num_tokens, "ok" if str(status) == "200" else "error")

    def aborted(self) -> None:
        """The client went away before the request finished."""
        if self.done:
            return
        self.done = True
        self.metrics.count_abort("router")
        self.metrics.vllm.finished("abort")
        self.metrics.count_request(self.endpoint, CLIENT_CLOSED)
        if self.on_end is not None:
            self.on_end(self.num_tokens, "aborted")

    def refused(self) -> None:
        """The service refused the request before its first token (its error answer counts it)."""
        if self.done:
            return
        self.done = True
        if self.on_end is not None:
            self.on_end(0, "refused")
