"""How many tokens a request may generate: the rule both front ends (HTTP and gRPC) apply the same way, before a request reaches a replica."""

from pdserve.protocol import InvalidRequestError


def max_tokens(requested: int | None, param: str, default: int | None, prompt_tokens: int,
               max_model_len: int) -> int:
    """How many tokens to generate: the request's own limit, or `default` (None: to the end of the
    context) capped by the context. Raises InvalidRequestError naming `param`, or the prompt when
    it leaves no room."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidRequestError("prompt", f"is {prompt_tokens} tokens; the model's context is {max_model_len} "
                                            f"tokens, so a prompt may have at most {max_model_len - 1}")
    if requested is None:
        return min(default, room) if default else room
    if requested < 1:
        raise InvalidRequestError(param, f"must be an integer >= 1, got {requested}")
    if requested > room:
        raise InvalidRequestError(param, f"is {requested}, but the prompt is {prompt_tokens} tokens and the "
                                         f"model's context is {max_model_len}: at most {room} tokens can be generated")
    return requested
