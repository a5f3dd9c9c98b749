"""vLLM's tokenizer endpoints, as vLLM serves them (a vLLM user's scripts call them to count and
check prompts): POST /tokenize (a prompt, or a chat rendered by the model's template exactly as
/v1/chat/completions renders it), POST /detokenize, GET /version. No replica is asked: the router
holds the model's tokenizer. Like vLLM's, they sit outside /v1; unlike vLLM's, they take an API key
where keys are configured (http_auth.py): they run text through the tokenizing threads every tenant
shares."""

from fastapi import FastAPI

import pdserve
from pdserve.router.http_errors import ApiError
from pdserve.router.openai_protocol import DETOKENIZE, TOKENIZE, VERSION, DetokenizeRequest, ErrorBody, TokenizeRequest
from pdserve.router.types import ServingCore, off_loop

BAD_REQUEST = {400: {"model": ErrorBody, "description": "a field is wrong (the message names it)"},
               404: {"model": ErrorBody, "description": "no such model"}}


def add_token_routes(app: FastAPI, core: ServingCore, tokenize, chat_prompt, check_model) -> None:
    """The routes on `app`; tokenize(core, text, param, add_special_tokens), chat_prompt(core, body) and
    check_model(core, model) are the generation endpoints' own (http_api.py), so that a prompt counts
    here as it will there."""

    @app.post(TOKENIZE, responses=BAD_REQUEST)
    async def tokenize_(body: TokenizeRequest) -> dict:
        if body.model is not None:
            check_model(core, body.model)
        if body.messages is not None:
            text = await chat_prompt(core, body)
            ids = await tokenize(core, text, "messages", add_special_tokens=bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await tokenize(core, body.prompt, "prompt", add_special_tokens=special)
        strs = [await off_loop(core.detokenize, [i]) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post(DETOKENIZE, responses=BAD_REQUEST)
    async def detokenize_(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(core, body.model)
        try:
            return {"prompt": await off_loop(core.detokenize, body.tokens)}
        except (ValueError, OverflowError, TypeError) as e:  # an id the tokenizer has no token for
            raise ApiError(400, f"tokens: {e}", param="tokens", code="invalid_value") from e

    @app.get(VERSION)
    async def version() -> dict:
        return {"version": pdserve.__version__}
