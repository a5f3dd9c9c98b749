"""`pdserve bench`'s HTTP side: find the server and its model, stream one completion, time its chunks.

The timed requests go through aiohttp (`stream_session`), the rest (health, models, metrics) through
httpx. A client's own work per request is in every TTFT it stamps, and httpx's was large: on the
development machine a lone request reached the router's HTTP door 2.1-2.2 ms after httpx was asked to
send it and its first event was read ~1 ms after the router wrote it, against 0.8-0.9 and ~0.5 ms
through aiohttp (0.4 and ~0.5 ms from a bare socket; `pdserve/hop_trace.py` timed each). aiohttp is
what vLLM's and SGLang's serving benchmarks send with.
"""

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

from pdserve.benchmarks.load.records import RequestRecord
from pdserve.hop_trace import hop

_HINT_UP = "is `pdserve up` running there? (`pdserve status` prints its endpoints)"


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, not ready, bad model): says what to do."""


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    max_model_len: int | None
    metrics_urls: tuple[str, ...] = ()  # whose /metrics time the run's phases: the url, or each router's own


async def connect(client: httpx.AsyncClient, url: str, model: str | None,
                  metrics_urls: list[str] | None = None) -> Server:

    """Check that pdserve serves at `url` and is ready; the model to ask for (default: its first)."""
    try:
        health = await client.get(f"{url}/health", timeout=10)
        models = (await client.get(f"{url}/v1/models", timeout=10)).json()["data"]
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach {url} ({type(e).__name__}: {e}) — {_HINT_UP}") from None
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models did not answer as an OpenAI API does — {_HINT_UP}") from None
    if health.status_code != 200:
        raise BenchError(f"{url} is up but not ready (/health: HTTP {health.status_code}, "
                         f"{_error_text(health.text)}): wait until `pdserve up` prints 'ready'")
    served = {m["id"]: m for m in models}
    if model is None:
        model = models[0]["id"]
    elif model not in served:
        raise BenchError(f"--model {model!r} is not served at {url}; it serves {', '.join(served)} "
                         f"(leave out --model to use the first)")
    return Server(url, model, served[model].get("max_model_len"),
                  tuple(u.rstrip("/") for u in metrics_urls) if metrics_urls else (url,))


def request_body(server: Server, prompt: list[int], output_len: int, user: str | None = None) -> dict[str, Any]:
    """Exactly `output_len` tokens (ignore_eos), greedy, streamed with the usage at the end; `user`
    names a multi-turn workload's session."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if user is not None:
        body["user"] = user
    return body


def stream_session(timeout_s: float) -> aiohttp.ClientSession:
    """The session the timed requests go through. No pool limit (a request queued in the client's pool
    would count the wait as server latency); `timeout_s` bounds each read, as httpx's timeout does (a
    long stream is not cut short), 30 s the connect; event lines up to 1 MiB (logprobs)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)


async def stream_request(session: aiohttp.ClientSession, server: Server, body: dict, rec: RequestRecord,
                         t0: float) -> None:
    """Send one streaming completion and fill `rec` with its timings, or with why it failed."""
    start = time.perf_counter()
    hop("send")
    rec.start_s = start - t0
    try:
        async with session.post(f"{server.url}/v1/completions", json=body) as resp:
            if resp.status != 200:  # a refusal (503: no capacity) is not retried, as for a user
                rec.error = f"HTTP {resp.status}: {_error_text((await resp.read()).decode(errors='replace'))}"
                return
            await _read_events(resp, rec, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
    except json.JSONDecodeError as e:
        rec.error = f"a stream event is not JSON: {e}"
    finally:
        hop("done")


async def _read_events(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    last = None
    async for raw in resp.content:
        if not raw.startswith(b"data: "):
            continue
        now = time.perf_counter()  # before parsing: the arrival is what is timed
        data = raw[6:].rstrip(b"\r\n").decode()
        if data == "[DONE]":
            rec.e2e_ms = _ms(now - start)
            break
        event = json.loads(data)
        if "error" in event:  # the server failed it after the 200 was sent
            rec.error = f"error in the stream: {_error_text(data)}"
            return
        if event.get("choices"):
            if last is None:
                hop("first_event")
                rec.ttft_ms = _ms(now - start)
            else:
                rec.itl_ms.append(_ms(now - last))
            last = now
            rec.chunks += 1
        if event.get("usage"):
            rec.output_tokens = event["usage"]["completion_tokens"]
    if rec.e2e_ms is None:
        rec.error = "the stream ended before [DONE]"
    elif rec.ttft_ms is None:
        rec.error = "the stream carried no output"
    elif not rec.output_tokens:
        rec.error = "the stream carried no usage (stream_options.include_usage)"


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body (cut short)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
