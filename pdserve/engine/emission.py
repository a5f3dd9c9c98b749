"""A sampled token made an output: its text (the request's text stream), whether it ends the request
(EOS, a stop token or string after min_tokens, a completed grammar, the length), and the texts of
its logprobs. The engine's (Engine inherits it); it reads the engine's sequences' streams, tokenizer
and scheduler, and ends a sequence through the engine's `_finish`."""

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason, Sequence, SeqStatus
from pdserve.protocol import TokenLogprob


class TokenEmission:
    """Engine's methods from a placed token to its RequestOutput (mixed into Engine)."""

    def _emit_run(self, seq: Sequence, at: int, logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """One output for the tokens from `at` on (a verify step's several), ending the sequence
        where one of them does (those after it are dropped)."""
        out = self._emit(seq, at, logprobs[0])
        for j in range(1, len(logprobs)):
            if out.finished:
                break
            more = self._emit(seq, at + j, logprobs[j])
            out.token_ids += more.token_ids
            out.text += more.text
            out.logprobs += more.logprobs
            out.finished, out.finish_reason, out.stop_reason = more.finished, more.finish_reason, more.stop_reason
        return out

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(token)
        return self._emit(seq, len(seq.token_ids) - 1, logprob)

    def _emit(self, seq: Sequence, at: int, logprob: TokenLogprob | None) -> RequestOutput:
        """The output of the token at `at` in `seq`; ends the sequence where that token does (a
        PENDING token after it, of a step queued meanwhile, is dropped then)."""
        p = seq.params
        token = seq.token_ids[at]
        if logprob is not None:
            seq.logprobs.append(logprob)
        stream = self._streams[seq.request_id]
        reason = stop_reason = None
        # Short of min_tokens nothing stops it but the length (the sampler held stop tokens off too;
        # a stop string may end the min_tokens-th token, as in vLLM).
        may_stop = at + 1 - seq.num_prompt_tokens >= p.min_tokens
        if may_stop and ((token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            reason, text = FinishReason.STOP, stream.push_stop_token()  # its own text is not shown
            # vLLM's stop_reason: the stop token id that ended it (None for the model's EOS).
            stop_reason = token if token in p.stop_token_ids else None
        else:
            text, hit = stream.push(token, check_stops=may_stop)
            if hit:
                reason, stop_reason = FinishReason.STOP, stream.stop_hit
            elif p.grammar is not None and self._grammar_done(seq, at):
                rest, _ = stream.flush()
                reason, text = FinishReason.STOP, text + rest
            elif at + 1 - seq.num_prompt_tokens >= p.max_tokens or at + 1 >= self.max_model_len:
                rest, hit = stream.flush()
                reason, text = FinishReason.STOP if hit else FinishReason.LENGTH, text + rest
                stop_reason = stream.stop_hit
        if logprob is not None:
            self._name_tokens(logprob, stream.token_text)
        out = RequestOutput(seq.request_id, [token], text, [logprob] if logprob else [],
                            num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        if reason is not None or self.config.role == "prefill":
            seq.finish_reason = reason
            out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
            self.scheduler.remove(seq)
            if self.config.role == "prefill":
                # The KV has to reach a decode replica first: hold the blocks until release().
                seq.status = SeqStatus.PREFILLED
                out.kv_block_ids = list(seq.block_ids)
            else:
                self._finish(seq)
        return out

    def _grammar_done(self, seq: Sequence, at: int) -> bool:
        """Whether the token at `at` completed the request's grammar (nothing more may follow)."""
        end = self.grammars.ended_at(seq)
        return end is not None and at + 1 - seq.num_prompt_tokens >= end

    def _name_tokens(self, logprob: TokenLogprob, text: str) -> None:
        """A logprob entry's texts: the token's own (what it added to the output), and each
        alternative's decoded alone (special tokens by name, as vLLM does); the token itself
        among the alternatives reads as `text`, so that it can be looked up there."""
        logprob.text = text
        logprob.top_texts = [text if i == logprob.token_id else self._piece(i) for i, _ in logprob.top]

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return piece
