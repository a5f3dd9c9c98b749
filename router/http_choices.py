"""A request of several choices over HTTP (`n`, `best_of`, a batch of prompts, `echo`): a child request per
choice (router/choices.py), their response joined, their stream interleaved. Choice ids are the parent's
with `-<prompt>-<j>`; a choice's index is prompt_i * n + j, as OpenAI and vLLM number them; each chunk
carries its choice's index; usage sums the choices (each prompt counted once). With best_of > n, best_of
run per prompt and the n of the highest cumulative logprob are returned. A request of one choice never
comes here: http_stream.serve is its path."""

from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Send

from pdserve.messages import Request, RequestDelta
from pdserve.protocol import InvalidRequestError
from pdserve.router.choices import Interleaved, Streams, close_all, cumulative_logprob, each
from pdserve.router.http_errors import as_api_error
from pdserve.router.http_stream import SSEResponse, _ClientGone, _Presence
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_responses import DONE_EVENT, ResponseShape, sse_event, token_usage
from pdserve.router.tenants import Charge
from pdserve.router.types import NoCapacityError, ServingCore, ServingError


@dataclass
class Choice:
    request: Request
    shape: ResponseShape  # words this choice, with its index
    prompt: int  # which of the request's prompts
    echo: str | None = None  # the prompt's text, shown before the choice's own (`echo`)


async def serve_choices(receive: Receive, core: ServingCore, metrics: Metrics, choices: list[Choice], n: int,
                        stream: bool, prompt_tokens: int, max_tokens: int, charge: Charge | None) -> Response:
    """Run every choice; the response (or stream) of them all. prompt_tokens: every prompt's, once."""
    timer = metrics.request_started(choices[0].shape.endpoint, prompt_tokens, charge and charge.end, max_tokens)
    headers = charge.headers if charge else None
    streams = [core.generate(c.request) for c in choices]
    presence = _Presence(receive)
    counted = lambda d: timer.tokens(len(d.token_ids), d.finish_reason)  # noqa: E731
    try:
        # A stream too waits for every choice's first delta: a refused choice is the request's 4xx/503.
        got = await presence.guard(each(streams, whole=not stream, on_delta=counted))
    except _ClientGone:
        presence.close()
        await close_all(streams)
        timer.aborted()
        return Response(status_code=499)
    except BaseException:
        presence.close()
        await close_all(streams)
        timer.refused()
        raise
    if not stream:
        presence.close()
        await close_all(streams)
        timer.finished(200)
        return JSONResponse(_response(choices, got, n, prompt_tokens), headers=headers)
    return _ChoiceStream(choices, streams, got, timer, prompt_tokens, presence, headers)


def _response(choices: list[Choice], got: list[list[RequestDelta]], n: int, prompt_tokens: int) -> dict:
    """The response of finished choices; where a prompt has more than n (best_of), its best n."""
    by_prompt: dict[int, list[int]] = {}
    for k, c in enumerate(choices):
        by_prompt.setdefault(c.prompt, []).append(k)
    out = []
    for i, ks in sorted(by_prompt.items()):
        if len(ks) > n:
            ks = sorted(ks, key=lambda k: cumulative_logprob(got[k]), reverse=True)[:n]
        for j, k in enumerate(ks):
            shape = choices[k].shape
            shape.index = i * n + j  # (a best_of choice's place is its rank)
            deltas = got[k] if choices[k].echo is None else [RequestDelta("", choices[k].echo, []), *got[k]]
            out.append(shape.choice(deltas))
    usage = token_usage(prompt_tokens, sum(len(d.token_ids) for ds in got for d in ds))
    return choices[0].shape._envelope(choices[0].shape.object, out, usage=usage)


class _ChoiceStream(SSEResponse):
    """The choices' server-sent events, interleaved as their deltas come: one pump task per choice
    feeds a queue, one coroutine writes what the queue holds in one body write. Closed however it
    ends (the client gone: at once), which aborts the unfinished choices."""

    def __init__(self, choices: list[Choice], streams: Streams,
                 firsts: list[list[RequestDelta]], timer: RequestTimer, prompt_tokens: int, presence: _Presence,
                 headers: dict[str, str] | None):
        super().__init__(presence, headers)
        self.choices, self.streams, self.firsts, self.timer = choices, streams, firsts, timer
        self.prompt_tokens = prompt_tokens

    async def _write(self, send: Send) -> None:
        shapes = [c.shape for c in self.choices]
        events = [sse_event(chunk) for shape in shapes for chunk in shape.opening_chunks()]
        events += [sse_event(c.shape.chunk(RequestDelta("", c.echo, []))) for c in self.choices if c.echo]
        num_tokens, first = 0, True
        deltas = Interleaved(self.streams, self.firsts)
        try:
            while not deltas.finished:
                if events:
                    await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})
                    events = []
                wake = await deltas.wake()
                for k, d in wake:
                    num_tokens += len(d.token_ids)
                    if (event := shapes[k].event(d)) is not None:
                        events.append(event)
                if not first:  # (the first deltas were counted as they came)
                    self.timer.tokens(sum(len(d.token_ids) for _, d in wake), wake[-1][1].finish_reason)
                first = False
            if shapes[0].include_usage:
                events.append(sse_event(shapes[0].usage_chunk(token_usage(self.prompt_tokens, num_tokens))))
            events.append(DONE_EVENT)
            self.timer.finished(200)
        except (ServingError, NoCapacityError, InvalidRequestError) as e:
            error = as_api_error(e)  # the 200 is sent: the failure goes in the stream, as vLLM does
            events += [sse_event(error.body()), DONE_EVENT]
            self.timer.finished(error.status)
        finally:
            await deltas.aclose()
            if not self.timer.done:  # cancelled mid-stream: the client went away
                self.timer.aborted()
        await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": False})
