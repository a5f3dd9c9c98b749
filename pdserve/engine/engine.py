"""The engine core: one class for every role.

colocated: prompt in, tokens out (continuous batching with chunked prefill).
prefill:   prompt in, first token out; the prompt's KV stays in its blocks until `release`.
decode:    `reserve` blocks, someone places the prompt's KV there, `start_decode` with the first
           token; from then on the request decodes like any other.
"""

import time
from collections.abc import Callable, Iterable

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.kv_cache import KVLayout, allocate_kv_cache, num_blocks_for
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import Completion, RequestOutput, TextStream
from pdserve.engine.sampler import TokenLogprob
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.sequence import FinishReason, Sequence, SeqStatus
from pdserve.models import load_model, model_fingerprint
from pdserve.ops.backends import make_backends
from pdserve.tokenizer import load_tokenizer

# Largest decode batch run as a CUDA graph (above it, steps run eagerly); TritonMoE switches to
# torch._grouped_mm from 512 tokens, which is not captured.
MAX_GRAPH_BATCH = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None, ep=None):
        """`ep`: an EPExchange when this engine is one rank of an expert-parallel group."""
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model
        dtype = _DTYPES.get(mc.dtype) or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if log:
            log(f"loading {mc.path} ({mc.load_format}, {str(dtype).removeprefix('torch.')}) on {self.device}")
        attn_backend, moe_backend = make_backends(config.attention_backend, config.moe_backend, self.device)
        self.model, self.args = load_model(mc.path, dtype=dtype, device=self.device,
                                           load_format=mc.load_format, attn_backend=attn_backend,
                                           moe_backend=moe_backend, seed=mc.seed, ep=ep)
        self.tokenizer = load_tokenizer(mc.path, eos_token_ids=self.args.eos_token_ids)
        self.fingerprint = model_fingerprint(mc.path, self.args, dtype, mc.load_format, mc.seed)
        self.max_model_len = min(mc.max_model_len or self.args.max_position_embeddings,
                                 self.args.max_position_embeddings)
        self.layout = KVLayout(self.args.num_layers, self._num_blocks(dtype), config.block_size,
                               self.args.num_kv_heads, self.args.head_dim, dtype)
        self.kv_cache = allocate_kv_cache(self.layout, self.device)
        self.pool = BlockPool(self.layout.num_blocks, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.chunk_size)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device)
        if self._wants_graphs(attn_backend, ep):
            from pdserve.engine.cuda_graphs import DecodeGraphs
            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_cache, attn_backend, min(config.max_num_seqs, MAX_GRAPH_BATCH),
                -(-self.max_model_len // config.block_size), self.max_model_len, self.device, log, exchange=ep)
        self.seqs: dict[str, Sequence] = {}
        self._streams: dict[str, TextStream] = {}
        self._ready: list[RequestOutput] = []  # outputs produced outside a step (start_decode)
        self._reserved: set[str] = set()  # decode role: reserved, waiting for their KV
        # Called after each layer's KV is written, with the step's batch: layer-wise KV streaming.
        self.layer_hook: Callable[[int, list[ScheduledSeq]], None] | None = None
        if log:
            log(f"KV cache: {self.layout.num_blocks} blocks of {config.block_size} tokens "
                f"({self.layout.num_blocks * config.block_size} tokens)")

    def _wants_graphs(self, attn_backend, ep) -> bool:
        """Decode steps replay CUDA graphs on a GPU with the Triton kernels (the torch reference
        reads host-side lengths); not for prefill-only engines, nor for expert-parallel ranks whose
        every step exchanges by all-to-all (threshold 1 or less: no static shapes)."""
        from pdserve.ops.attention import TorchAttention

        return (self.config.cuda_graphs and self.device.type == "cuda" and self.config.role != "prefill"
                and (ep is None or ep.threshold > 1) and not isinstance(attn_backend, TorchAttention))

    def _num_blocks(self, dtype: torch.dtype) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        gb = self.config.kv_cache_gb
        if gb is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.9)
        else:
            budget = int((gb or 0.25) * 2**30)
        return num_blocks_for(budget, self.args.num_layers, self.config.block_size,
                              self.args.num_kv_heads, self.args.head_dim, dtype)

    # -- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _new_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if request_id in self.seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if any(not 0 <= t < self.args.vocab_size for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.args.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"is {len(ids)} tokens; the model's context is {self.max_model_len} tokens, "
                          f"so a prompt may have at most {self.max_model_len - 1}")
        blocks = -(-(len(ids) + 1) // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise InvalidRequestError(
                "prompt", f"needs {blocks} KV blocks; this replica's cache has {self.pool.num_blocks}")
        seq = Sequence(request_id, ids, len(ids), params, arrival=time.monotonic())
        self.seqs[request_id] = seq
        self._streams[request_id] = TextStream(self.tokenizer, ids, params.stop)
        return seq

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request (colocated and prefill roles)."""
        assert self.config.role != "decode", "a decode engine takes requests through reserve()"
        self.scheduler.add(self._new_sequence(request_id, prompt, params))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is unknown (already done)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return True

    # -- disaggregation seam ------------------------------------------------------------------

    def reserve(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[int] | None:
        """Decode role: blocks for the prompt's KV (same ids in every layer), or None if full."""
        seq = self._new_sequence(request_id, prompt, params)
        busy = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._reserved)
        try:
            if busy >= self.config.max_num_seqs:
                raise NoFreeBlocksError("no free sequence slot")
            seq.block_ids = self.pool.allocate(-(-seq.num_prompt_tokens // self.config.block_size))
        except NoFreeBlocksError:
            self._forget(seq)
            return None
        self._reserved.add(request_id)
        return list(seq.block_ids)

    def start_decode(self, request_id: str, first_token: int,
                     first_logprob: TokenLogprob | None = None) -> None:
        """Decode role: the prompt's KV is in the reserved blocks; generate from `first_token` on."""
        seq = self.seqs[request_id]
        assert seq.block_ids and seq.num_computed_tokens == 0, f"{request_id} was not reserved"
        self._reserved.discard(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.scheduler.register_full_blocks(seq)
        out = self._append_token(seq, first_token, first_logprob)
        self._ready.append(out)
        if not out.finished:
            self.scheduler.add_running(seq)

    def release(self, request_id: str) -> None:
        """Free a request's blocks: a prefilled request whose KV has been sent, or a reservation."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.scheduler.remove(seq)
            self._finish(seq)

    # -- stepping -----------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._ready)

    def step(self, scheduled: list[ScheduledSeq] | None = None) -> list[RequestOutput]:
        """One step; `scheduled`: this step's schedule when the caller had to see it first (expert parallel)."""
        outputs, self._ready = self._ready, []
        if scheduled is None:
            scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        hook = self.layer_hook
        tokens, logprobs = self.runner.execute(
            scheduled, (lambda layer: hook(layer, scheduled)) if hook else None)
        k = 0
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.scheduler.register_full_blocks(seq)
            if s.samples:
                outputs.append(self._append_token(seq, tokens[k], logprobs[k]))
                k += 1
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        p = seq.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        stream = self._streams[seq.request_id]
        reason = None
        if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, text = FinishReason.STOP, stream.flush()  # the stop token's own text is not shown
        else:
            text, hit = stream.push(token)
            if hit:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason, text = FinishReason.LENGTH, text + stream.flush()
        out = RequestOutput(seq.request_id, [token], text, [logprob] if logprob else [],
                            num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        if reason is not None or self.config.role == "prefill":
            seq.finish_reason = reason
            out.finished, out.finish_reason = True, reason
            self.scheduler.remove(seq)
            if self.config.role == "prefill":
                # The KV has to reach a decode replica first: hold the blocks until release().
                seq.status = SeqStatus.PREFILLED
                out.kv_block_ids = list(seq.block_ids)
            else:
                self._finish(seq)
        return out

    def _finish(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self._reserved.discard(seq.request_id)
        self._streams.pop(seq.request_id, None)
        self.runner.sampler.forget(seq.request_id)

    # -- offline ------------------------------------------------------------------------------

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams],
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[Completion]:
        """Run prompts to completion (colocated role); results in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        acc: dict[str, Completion] = {}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            seq = self.seqs[rid]
            acc[rid] = Completion(rid, list(seq.token_ids), [], "", FinishReason.LENGTH)
        while self.has_unfinished():
            for out in self.step():
                c = acc[out.request_id]
                c.token_ids += out.token_ids
                c.text += out.text
                c.logprobs += out.logprobs
                c.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    c.finish_reason = out.finish_reason
                if on_output:
                    on_output(out)
        return [acc[r] for r in ids]
