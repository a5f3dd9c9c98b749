"""A ServingCore over one colocated engine in this process: the baseline every disaggregated
figure is compared with, and a real back end for the front ends' tests."""

import asyncio
import threading
from collections.abc import AsyncIterator

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.worker.engine_loop import EngineLoop

from pdserve.messages import Request, RequestDelta
from pdserve.structured_outputs import GrammarTokenizer


def delta(text: str, token_ids: list[int], finish_reason: str | None = None, logprobs=(),
          stop_reason=None) -> RequestDelta:
    """A core's output for a front end (request id, error and `more` as a worker leaves them)."""
    return RequestDelta("", text, token_ids, finish_reason, None, logprobs, stop_reason=stop_reason)


class LocalCore:
    def __init__(self, engine: Engine, model_name: str):
        assert engine.config.role == "colocated"
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.grammar_tokenizer = GrammarTokenizer(engine.tokenizer)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.sessions: list[str | None] = []  # each request's session key, as the front end gave it
        self.priorities: list[int] = []  # and its priority
        # The worker's own loop: aborts go through its inbox and are taken between steps,
        # and whoever must touch the engine meanwhile takes `_lock` (its FIFO lock) at a step boundary.
        # (A plain lock around each step starved a front end's abort: the loop re-took it every time.)
        self._loop = EngineLoop(self._step, self._take, "engine-loop")
        self._lock = self._loop.lock

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tools=tools,
                                                         generation_prompt=add_generation_prompt,
                                                         **(template_kwargs or {}))

    @property
    def chat_template(self) -> str | None:
        return self.engine.tokenizer.chat_template

    def detokenize(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def ready(self) -> bool:
        return self._loop.alive()

    def degraded(self) -> dict[str, str]:
        return {} if self._loop.alive() else {"engine": "down: its thread stopped"}

    async def generate(self, request: Request, direct=None) -> AsyncIterator[RequestDelta]:
        queue: asyncio.Queue = asyncio.Queue()
        self.sessions.append(request.session)
        self.priorities.append(request.priority)
        with self._lock:  # (added here, not through the inbox: a request the engine refuses raises here)
            self.engine.add(request)
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        self._loop.wake()
        finished = False
        try:
            while not finished:
                d = await queue.get()
                finished = d.finish_reason is not None
                yield d
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # the client went away: stop generating for it
                self._loop.submit(request.request_id)

    def close(self) -> None:
        self._loop.stop()

    def _take(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _step(self) -> float | None:
        if not self.engine.has_unfinished():
            return 0.05
        for out in self.engine.step():
            self._dispatch(out)
        return None

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        loop, queue = stream
        reason = out.finish_reason.value if out.finish_reason else None
        loop.call_soon_threadsafe(queue.put_nowait, delta(out.text, out.token_ids, reason, out.logprobs,
                                                                out.stop_reason))


class Served:
    """An ASGI app served by uvicorn on a thread, on a socket bound here to port 0 and handed over
    (no port is picked and freed for another test to take). `url` once it listens; `stop()`."""

    def __init__(self, app, timeout_s: float = 30.0, **config):
        """config: more uvicorn.Config arguments (ssl_certfile and ssl_keyfile: served over HTTPS)."""
        import socket
        import time

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        scheme = "https" if config.get("ssl_certfile") else "http"
        self.url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
