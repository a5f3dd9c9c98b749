"""The engine core: one class for every role.

colocated: prompt in, tokens out (continuous batching with chunked prefill).
prefill:   prompt in, first token out; the prompt's KV stays in its blocks until `release`.
decode:    `reserve` blocks, someone places the prompt's KV there, `start_decode` with the first
           token; from then on the request decodes like any other.

A resumed request (one the router moved, `Request.output_ids`: the tokens it streamed already) is
prompt + output_ids: their KV is computed as a preempted sequence's is (prefill, colocated) or
reserved and placed with the prompt's (decode), and its text stream takes them silently, so the
next token's text goes on as in the undisturbed run.

A step is launched (forward and sampling queued on the device, `ModelRunner.launch`) and then
completed (tokens in place, full blocks registered in the prefix cache, text and stops). With
`overlap_scheduling` (colocated and decode roles on a GPU) `step()` launches step N+1 before it
completes step N, so the host's work of one step runs while the device computes the next; its
outputs come one `step()` later.
"""

import itertools
import time
from collections.abc import Callable, Iterable

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool, salt_root
from pdserve.engine.grammar import Grammars
from pdserve.engine.grammar_gate import GrammarGate
from pdserve.engine.graph_capture import capture_graphs
from pdserve.engine.kv_budget import kv_cache_blocks
from pdserve.forward.kv_cache import KV_CACHE_DTYPES, KVLayout, allocate_kv_cache
from pdserve.engine.model_runner import Launched, ModelRunner
from pdserve.engine.drafting import Drafting
from pdserve.engine.decode_reservations import DecodeReservations
from pdserve.engine.emission import TokenEmission
from pdserve.engine.mtp_drafter import MTPDrafter
from pdserve.engine.outputs import Completion, RequestOutput, TextStream
from pdserve.protocol import InvalidRequestError, SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.sequence import PENDING, FinishReason, Sequence, SeqStatus
from pdserve.models.loader import load_model, model_fingerprint
from pdserve.ops.backends import make_backends
from pdserve.engine.step_profile import StepProfile
from pdserve.engine.tpot_guard import TPOTGuard
from pdserve.messages import Request
from pdserve.tokenizer import load_tokenizer
from pdserve.hop_trace import hop


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine(TokenEmission, DecodeReservations):
    def __init__(self, config: EngineConfig, log: Callable[[str], None] | None = None, ep=None, tp=None):
        """`ep`: an EPExchange when this engine is one rank of an expert-parallel group; `tp`: a
        TensorParallel (pdserve.models.tensor_parallel) when it is one rank of a tensor-parallel
        replica, whose ranks run the same steps (rank 0 schedules, pdserve.worker.tp_group)."""
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model
        dtype = _DTYPES.get(mc.dtype) or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if log:
            log(f"loading {mc.path} ({mc.load_format}, {str(dtype).removeprefix('torch.')}) on {self.device}")
        attn_backend, moe_backend, norms = make_backends(config.attention_backend, config.moe_backend, self.device)
        # Every backend runs sharded: a rank's layers hold fewer heads and narrower MLP / expert
        # widths, which the kernels read from the tensors' shapes.
        self.tp = tp if tp is not None and tp.size > 1 else None
        self._ep = ep  # (an expert-parallel rank does not speculate)
        # The MTP layer: a drafter where this engine speculates; on a prefill replica, its KV of
        # each prompt is computed too and moves with the rest (pdserve/engine/mtp_drafter.py).
        mtp = config.speculative.mtp and ep is None
        if mtp and self.tp is not None:  # (the followers would have to run its forward too: not built)
            raise ValueError("speculative.method 'mtp' is not built for a tensor-parallel replica; use 'ngram'")
        self.model, self.args = load_model(mc.path, dtype=dtype, device=self.device,
                                           load_format=mc.load_format, attn_backend=attn_backend,
                                           moe_backend=moe_backend, seed=mc.seed, ep=ep, norms=norms,
                                           tp=self.tp, log=log, mtp=mtp)
        self.load_stats = self.model.load_stats  # what loading took (bytes, seconds): workers report it
        self.tokenizer = load_tokenizer(mc.path, eos_token_ids=self.args.eos_token_ids)
        self.fingerprint = model_fingerprint(mc.path, self.args, dtype, mc.load_format, mc.seed)
        self.max_model_len = min(mc.max_model_len or self.args.max_position_embeddings,
                                 self.args.max_position_embeddings)
        kv_dtype = KV_CACHE_DTYPES.get(mc.kv_cache_dtype, dtype)  # "auto": the model's dtype
        num_blocks = kv_cache_blocks(config, self.args, self.device, self.tp, kv_dtype, extra_layers=int(mtp))
        self.layout = KVLayout.for_model(self.args, num_blocks, config.block_size, kv_dtype, tp=self.tp,
                                         extra_layers=int(mtp))
        self.kv_cache = allocate_kv_cache(self.layout, self.device)
        self.pool = BlockPool(self.layout.num_blocks, config.enable_prefix_cache)
        self.profile = StepProfile()  # what steps cost, by size (the planner reads it)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.chunk_size,
                                   whole_prompt=config.role == "prefill", profile=self.profile,
                                   guard=self._tpot_guard(config))
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device, self.layout.scales)
        self.runner.sampler.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)  # (min_tokens holds them off)
        self.grammars = self.runner.sampler.grammars = Grammars(self.tokenizer, self.args.vocab_size)
        self._gate = GrammarGate(self.grammars, self.scheduler.add, self.start_decode, self.release)
        self.speculative = self._wants_speculation(config, ep)
        self._mtp = MTPDrafter(self.model, config.block_size, self.device) if mtp else None
        self.runner.keep_hidden = mtp
        self.drafting = Drafting(config.speculative, self.max_model_len, self._mtp)
        if self.speculative:
            self.scheduler.drafter = self.drafting.propose
        # Seconds capturing CUDA graphs, where they are (None: none here).
        self.graphs_s: float | None = capture_graphs(self, attn_backend, moe_backend, ep, log)
        self.seqs: dict[str, Sequence] = {}
        self._streams: dict[str, TextStream] = {}
        self._ready: list[RequestOutput] = []  # outputs produced outside a step (start_decode)
        self._pieces: dict[int, str] = {}  # token id -> its text decoded alone (logprobs' alternatives)
        self._reserved: set[str] = set()  # decode role: reserved, waiting for their KV
        self._arrivals = itertools.count()  # each sequence's place in arrival order (Sequence.arrival_no)
        self.overlap = self._wants_overlap()
        self._inflight: Launched | None = None  # overlap: the step queued last, not yet handed out
        # Called after each layer's KV is written, with the step's batch: layer-wise KV streaming.
        self.layer_hook: Callable[[int, list[ScheduledSeq]], None] | None = None
        if log:
            log(f"KV cache: {self.layout.num_blocks} blocks of {config.block_size} tokens "
                f"({self.layout.num_blocks * config.block_size} tokens, {str(kv_dtype).removeprefix('torch.')})")

    def _tpot_guard(self, config: EngineConfig) -> TPOTGuard | None:
        """The TPOT guard of the role's steps (engine/tpot_guard.py); a prefill engine has no decoders to guard."""
        if not config.tpot_guard_ms or config.role == "prefill":
            return None
        return TPOTGuard(self.profile, config.tpot_guard_ms / 1e3, config.block_size)

    def _wants_speculation(self, config: EngineConfig, ep) -> bool:
        """Draft and verify (engine/spec_decode.py) in the roles that generate; not on an
        expert-parallel rank (its group agrees on each step's shape, which drafts would vary)."""
        return config.speculative.method is not None and config.role != "prefill" and ep is None

    def _wants_overlap(self) -> bool:
        """Overlap the host's work with the device's: on by default on a GPU. Not for the prefill
        role (a request's one step hands its KV to the connector right away). An expert-parallel
        rank overlaps too: its group agrees on step N+1 (on the host) while the GPUs run step N."""
        want = self.config.overlap_scheduling
        if want is None:
            want = self.device.type == "cuda"
        # Speculation drafts from a sequence's last token and learns how many drafts held only
        # once the step is read: the next step cannot be queued before.
        return want and self.config.role != "prefill" and not self._wants_speculation(self.config, self._ep)

    # -- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _new_sequence(self, request: Request) -> Sequence:
        rid, ids, params, output_ids = request.request_id, request.prompt_ids, request.params, request.output_ids
        if rid in self.seqs:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        self.check_request(request)
        # A resumed request's tokens so far follow its prompt: their KV is computed (or placed) with
        # the prompt's, and max_tokens and the context count them, as in the undisturbed run.
        seq = Sequence(rid, list(ids) + list(output_ids), len(ids), params, arrival=time.monotonic(),
                       priority=request.priority, arrival_no=next(self._arrivals),
                       cache_root=salt_root(params.cache_salt))
        self.seqs[rid] = seq
        self._streams[rid] = TextStream(self.tokenizer, ids, params.stop, output_ids)
        return seq

    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError if a prompt (followed by the tokens a resumed request generated
        already) can never run here. Reads no state that steps change: callable from any thread,
        before the request is handed to the engine's."""
        ids, params, output_ids = request.prompt_ids, request.params, request.output_ids
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        for param, part in (("prompt", ids), ("output_ids", output_ids)):
            # min and max run in C: a 4k prompt's ids checked in ~0.1 ms, a third of a Python loop's,
            # on the worker's thread before the request is handed over (its TTFT).
            if part and (min(part) < 0 or max(part) >= self.args.vocab_size):
                raise InvalidRequestError(param, f"token ids must be in [0, {self.args.vocab_size})")
        params.check_vocab(self.args.vocab_size)
        if len(output_ids) >= params.max_tokens:
            raise InvalidRequestError(
                "output_ids", f"are {len(output_ids)} tokens, max_tokens is {params.max_tokens}: "
                              f"nothing is left to generate")
        self._check_fits("prompt", len(ids), "is", "a prompt")
        if output_ids:
            self._check_fits("output_ids", len(ids) + len(output_ids), "with the prompt make",
                             "a prompt with its output_ids")

    def _check_fits(self, param: str, n: int, counts: str, whole: str) -> None:
        """`n` tokens, and the one generated next, must fit the context and the KV cache."""
        if n >= self.max_model_len:
            raise InvalidRequestError(
                param, f"{counts} {n} tokens; the model's context is {self.max_model_len} tokens, "
                       f"so {whole} may have at most {self.max_model_len - 1}")
        blocks = -(-(n + 1) // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise InvalidRequestError(
                param, f"{counts} {n} tokens, which need {blocks} KV blocks; this replica's cache has "
                       f"{self.pool.num_blocks}")

    def add(self, request: Request) -> None:
        """Queue a request: its prompt is computed here (every role; on a decode engine, a local
        prefill, in steps mixed with its decoding sequences'). Its `output_ids`: the tokens it generated
        already elsewhere (a moved request): their KV is computed with the prompt's (as a sequence
        preempted by recompute is), and the next token continues the stream after them. Its
        `priority`: lower is admitted first and preempted last (vLLM's meaning; 0 by default)."""
        seq = self._new_sequence(request)
        self.grammars.compile(seq)  # off this thread; the gate holds the request until it is done
        if not self._gate.holds(seq):
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    output_ids: list[int] = (), priority: int = 0) -> None:
        """`add` for a caller holding text or loose fields (the offline engine's callers: tests,
        benchmarks, the warm-up): a text prompt is tokenized here."""
        self.add(Request(request_id, self.tokenize(prompt), params, list(output_ids), priority))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is unknown (already done)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return True

    def change_role(self, config: EngineConfig) -> None:
        """Serve in `config.role` from now on, keeping the weights, the KV cache and the prefix cache
        (a replica's flip between prefill and decode, pdserve/worker/flip.py). Only an idle engine
        flips: a prefill engine's sequences hold blocks until their KV is sent, a decode engine's
        until they finish. What a role decides is read from the config at each step (scheduling
        whole prompts, holding a prefilled sequence's blocks) or set here (the step budget, overlap);
        the block count and model stay as built. CUDA graphs captured for the old role stay; the
        new role's steps that no graph covers run eagerly."""
        self._ready = [o for o in self._ready if o.request_id in self.seqs]  # (outputs of requests aborted)
        if self.seqs or self.has_unfinished():
            raise RuntimeError(f"a role change needs an idle engine; {len(self.seqs)} requests are here")
        keep = {"model", "device", "num_kv_blocks", "kv_cache_gb", "gpu_memory_utilization", "block_size"}
        self.config = config.model_copy(update={k: getattr(self.config, k) for k in keep})
        s, c = self.scheduler, self.config
        s.whole_prompt = c.role == "prefill"  # (scheduler.py says why the prefill role needs it)
        s.max_num_seqs, s.max_num_batched_tokens, s.chunk_size = c.max_num_seqs, c.max_num_batched_tokens, c.chunk_size
        s.guard = self._tpot_guard(c)
        self.speculative = self._wants_speculation(c, self._ep)
        self.drafting = Drafting(c.speculative, self.max_model_len, self._mtp)
        s.drafter = self.drafting.propose if self.speculative else None
        self.overlap = self._wants_overlap()
        self.layer_hook = None  # the prefill role's KV streamer installs its own

    # -- stepping -----------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        f = self._inflight  # a queued step counts while a sequence of it still waits for its token
        return (self.scheduler.has_work() or bool(self._ready) or bool(self._gate)
                or (f is not None and any(self.seqs.get(q.request_id) is q for q in f.sampling)))

    def step(self, scheduled: list[ScheduledSeq] | None = None) -> list[RequestOutput]:
        """One step; `scheduled`: this step's schedule when the caller had to see it first (expert parallel).

        Overlapped, a step queues its forward on the GPU and only then waits for the one before
        and hands out that one's tokens: the host's work of a step (scheduling, batch building,
        detokenizing, streaming) runs while the device computes the next. Its outputs thus come one
        call later, and a sequence that hit a stop token has one more token computed, then dropped."""
        timer = self.profile.timer()
        if self._gate:  # requests whose grammar compiled join (or fail: error outputs) at this boundary
            self._ready.extend(self._gate.let_in())
        outputs, self._ready = self._ready, []
        if scheduled is None:
            scheduled = self.scheduler.schedule()
            if not scheduled and self._gate and self._inflight is None:
                self._gate.nap()  # only compiles to wait for
        hop("scheduled")
        # Sized before the launch moves num_computed_tokens on. Overlapped, the call's time is that
        # of the step before (it waits for it) but in a steady batch the two are alike.
        decoding = sum(1 for s in scheduled if s.seq.num_computed_tokens >= s.seq.num_tokens - 1)
        drafts = sum(len(s.draft) for s in scheduled)
        prompt = sum(s.num_new_tokens for s in scheduled) - drafts - decoding
        launched = self._launch(scheduled) if scheduled else None
        hop("launched")
        self.scheduler.hash_launched()  # (beside the device's work)
        if not self.overlap:
            outputs += self._complete(launched) if launched else []
        else:
            prev, self._inflight = self._inflight, launched
            outputs += self._complete(prev) if prev else []
        timer.done(prompt, decoding, drafts)  # (a verify step is kept out of the decode fit)
        return outputs

    def _launch(self, scheduled: list[ScheduledSeq]) -> Launched:
        hook = self.layer_hook
        launched = self.runner.launch(scheduled, self._inflight,
                                      (lambda layer: hook(layer, scheduled)) if hook else None)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        for seq in launched.sampling:
            seq.token_ids.append(PENDING)  # its value comes with the step's result
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.scheduler.remove(seq)  # it ends with this token, whichever it is: no later step
        return launched

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step; its tokens go into their sequences (in place of PENDING)."""
        tokens, logprobs = launched.result()
        outputs = []
        placed = []
        for row, seq in enumerate(launched.sampling):
            if self.seqs.get(seq.request_id) is not seq:
                continue  # aborted, or stopped by the step before (overlap): the token is dropped
            ids = seq.token_ids
            # Its oldest PENDING token; the newer one, if any, is the step queued after this one.
            at = len(ids) - 2 if len(ids) >= 2 and ids[-2] == PENDING else len(ids) - 1
            ids[at] = tokens[row][0]
            if launched.drafts is not None:  # (never overlapped: `at` is the last)
                ids += tokens[row][1:]
                self._roll_back(seq, len(launched.drafts[row]), len(tokens[row]) - 1)
            placed.append((seq, at, row))
        if self._mtp is not None and self._mtp.run(launched, self.speculative) and self.layer_hook:
            self.layer_hook(self._mtp.kv_layer, launched.scheduled)  # (a prefill replica streams its KV too)
        for s in launched.scheduled:
            if self.seqs.get(s.seq.request_id) is s.seq:
                self.scheduler.register_full_blocks(s.seq)  # every token it hashes is known now
        for seq, at, row in placed:
            if self.seqs.get(seq.request_id) is seq:  # (not ended by a token of this step before)
                outputs.append(self._emit_run(seq, at, logprobs[row]))
        return outputs

    def _roll_back(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After a verify step: the KV of rejected drafts is not the sequence's. Its computed tokens
        end after the last accepted one, and the blocks only its rejected drafts reached go back."""
        seq.num_computed_tokens -= drafted - accepted
        keep = -(-seq.num_computed_tokens // self.config.block_size)
        self.pool.free(seq.block_ids[keep:])
        del seq.block_ids[keep:]
        self.profile.spec_verified(drafted, accepted)

    def _finish(self, seq: Sequence) -> None:
        while seq.token_ids[-1] == PENDING:  # a step queued after the last token (overlap)
            seq.token_ids.pop()
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self._reserved.discard(seq.request_id)
        self._gate.forget(seq.request_id)
        self._streams.pop(seq.request_id, None)
        self.runner.sampler.forget(seq.request_id)
        self.drafting.forget(seq.request_id)

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
