"""Structured outputs on the step path: the grammar engines' mask work per step, and what it adds to
an engine step. Two measurements:

    python -m pdserve.benchmarks.grammar_masks engines [--only llguidance|xgrammar] [--batch 1 32 256]
                                                       [--tokenizer DIR] [--vocab N]
    python -m pdserve.benchmarks.grammar_masks step [--model qwen3-30b-a3b] [--device cuda] [--batch 256]
                                                    [--tokenizer DIR]   (a BPE vocabulary: bpe_vocab.py)

engines   llguidance and xgrammar (each where installed) on the same vocabulary and JSON schema: per
          step, every one of B constrained sequences gets its next-token mask (each engine's batched,
          multi-threaded fill into one packed int32 bitmask), the mask is applied to random logits
          [B, vocab] on the CPU (the engine's own apply), the argmax is taken and every matcher
          consumes its token (batched). A matcher whose grammar ends starts over. Median of the
          steps, in ms per step: fill, apply (argmax included; on a GPU it is a device op), consume;
          the grammar engine's own work is fill + consume. The vocabulary: `--tokenizer DIR` (a
          tokenizer.json), else the byte tokenizer of the presets widened to `--vocab` (default
          151936, Qwen3's) with `<|token_N|>` entries — a real BPE vocabulary is the figure to quote.
step      pdserve's engine (pdserve/engine/grammar.py + sampler.py, llguidance) decoding B sequences
          of a preset (random weights) with no grammar, then with every sequence under the JSON
          schema; median engine step of each and the overhead as a ratio. Issue 41's bar: ≤ 5 % at
          B = 256 on a GPU (run it there: --device cuda). On the CPU: --model tiny-moe --device cpu.
"""

import argparse
import datetime
import json
import statistics
import time

import torch

# Long enough that a sequence stays inside it for the measured steps; every string bounded.
ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                       "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"],
          "properties": {"people": {"type": "array", "items": ITEM, "minItems": 64}}}


def _hf_tokenizer(path: str | None, vocab: int):
    import transformers
    from tokenizers import Tokenizer

    from pdserve.tokenizer import ByteTokenizer, byte_tokenizer_as_hf
    if path:
        tok = Tokenizer.from_file(f"{path}/tokenizer.json")
        eos = None
    else:
        tok = Tokenizer.from_str(json.dumps(byte_tokenizer_as_hf(vocab, 1 << 20)["tokenizer.json"]))
        eos = ByteTokenizer().eos_token
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        from pdserve.engine.grammar import executor_threads  # the engine's executor size
        self.executor = llguidance.LLExecutor(executor_threads())

    def matchers(self, n: int) -> list:
        return [self.llg.LLMatcher(self.tok, self.grammar) for _ in range(n)]

    def fill(self, ms: list, bitmask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        from pdserve.engine.grammar import bit_values, masked  # what the engine's sampler does
        logits.copy_(masked(logits, bitmask.to(logits.device), bit_values(logits.device)))

    def consume(self, ms: list, tokens: list[int]) -> list:
        self.executor.consume_token_par(list(zip(ms, tokens)))
        return [i for i, m in enumerate(ms) if m.is_stopped() or m.is_error()]

    def fresh(self):
        return self.llg.LLMatcher(self.tok, self.grammar)


class _XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiled = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
        from pdserve.engine.grammar import executor_threads  # as many threads as llguidance gets
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=executor_threads())

    def matchers(self, n: int) -> list:
        return [self.fresh() for _ in range(n)]

    def fill(self, ms: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

    def consume(self, ms: list, tokens: list[int]) -> list:
        self.batch.batch_accept_token(ms, tokens)
        return [i for i, m in enumerate(ms) if m.is_terminated()]

    def fresh(self):
        return self.xgr.GrammarMatcher(self.compiled)


def engines_run(args) -> list[dict]:
    hf = _hf_tokenizer(args.tokenizer, args.vocab)
    vocab = args.vocab if not args.tokenizer else len(hf)
    engines = []
    for cls in (_LLGuidance, _XGrammar):
        if args.only and cls.name != args.only:
            continue
        try:
            engines.append(cls(hf, vocab))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    rows = []
    for b in args.batch:  # the engines side by side at each batch, so that a busy host weighs on both alike
        for eng in engines:
            row = _engine_steps(eng, b, vocab, args)
            rows.append(row)
            print(f"{eng.name:11s} B={b:4d}  fill {row['fill_ms']:8.3f} ms  apply {row['apply_ms']:8.3f} ms  "
                  f"consume {row['consume_ms']:8.3f} ms  grammar (fill + consume) {row['grammar_ms']:8.3f} ms/step "
                  f"({1e3 * row['grammar_ms'] / b:7.1f} us/seq; {row['restarts']} restarts)", flush=True)
    return rows


def _engine_steps(eng, b: int, vocab: int, args) -> dict:
    ms = eng.matchers(b)
    bitmask = torch.zeros(b, (vocab + 31) // 32, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    t_fill, t_apply, t_consume, restarts = [], [], [], 0
    for step in range(args.warmup + args.steps):
        logits = torch.randn(b, vocab, generator=g)
        t0 = time.perf_counter()
        eng.fill(ms, bitmask)
        t1 = time.perf_counter()
        eng.apply(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        t2 = time.perf_counter()
        ended = eng.consume(ms, tokens)
        t3 = time.perf_counter()
        for i in ended:
            ms[i] = eng.fresh()
        restarts += len(ended)
        if step >= args.warmup:
            t_fill.append(t1 - t0)
            t_apply.append(t2 - t1)
            t_consume.append(t3 - t2)
    row = {"engine": eng.name, "batch": b, "fill_ms": 1e3 * statistics.median(t_fill),
           "apply_ms": 1e3 * statistics.median(t_apply), "consume_ms": 1e3 * statistics.median(t_consume),
           "restarts": restarts}
    row["grammar_ms"] = row["fill_ms"] + row["consume_ms"]  # the engine's own work (apply is a torch op)
    return row


def step_run(args) -> dict:
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams
    from pdserve.structured_outputs import json_schema_grammar

    engine = Engine(EngineConfig(model=ModelConfig(path=_model_dir(args), load_format="dummy"), device=args.device,
                                 max_num_seqs=max(args.batch), prefill_graph_max_tokens=0), log=print)
    spent = _time_grammar_work()
    print(f"tokenizer: {args.tokenizer or 'the byte tokenizer widened to the vocabulary'}; "
          f"{type(engine.tokenizer).__name__}, {engine.tokenizer.vocab_size} ids", flush=True)
    grammar = json_schema_grammar("bench", SCHEMA)
    out = {}
    for b in args.batch:
        # A free pass first warms the engine up (not counted); then `--rounds` rounds of a free, a
        # constrained and a penalties pass, interleaved so that a drift of the host or the device
        # falls on all three alike; each figure is the median over the rounds. `penalties`: every
        # sequence with presence, frequency and repetition penalties (issue 41's batched sampler:
        # its count rows, no grammar), against the same free passes.
        runs: dict[str, list[float]] = {}
        for n, key in enumerate(["free"] + ["free", "constrained", "penalties"] * args.rounds):
            extra = {"constrained": {"grammar": grammar},
                     "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}}
            params = SamplingParams(max_tokens=args.warmup + 2 * args.steps + 8, temperature=1.0, seed=1, ignore_eos=True,
                                    **extra.get(key, {}))
            for i in range(b):
                engine.add_request(f"r{b}-{n}-{key}-{i}", list(range(1, 17)), params)
            t0 = time.perf_counter()
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
                engine.step()  # the prompts (their grammars compiled first), and the first tokens
            prompts_s = time.perf_counter() - t0
            spent.clear()
            sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
            times = []
            for step in range(args.warmup + args.steps):
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                if step >= args.warmup:
                    times.append(time.perf_counter() - t0)
            # As a serving loop steps: back to back, no wait between steps (overlap scheduling queues
            # a step while the host finishes the one before): the mean step over `--steps`.
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync()
            back_to_back = 1e3 * (time.perf_counter() - t0) / args.steps
            running = len(engine.seqs)
            for rid in list(engine.seqs):
                engine.abort(rid)
            if n == 0:
                continue
            runs.setdefault(key, []).append(1e3 * statistics.median(times))
            runs.setdefault(key + " back-to-back", []).append(back_to_back)
            work = "".join(f", {k} {1e3 * v / (args.warmup + 2 * args.steps):.2f} ms/step" for k, v in spent.items())
            print(f"B={b:4d} {key:11s} median step {runs[key][-1]:9.3f} ms (each step waited for), back to back "
                  f"{back_to_back:9.3f} ms  ({running} sequences still running; prompts {prompts_s:.2f} s{work})",
                  flush=True)
        for key, xs in runs.items():
            out[(b, key)] = statistics.median(xs)
        for key in ("constrained", "penalties"):
            for how in ("", " back-to-back"):
                ratio = out[(b, key + how)] / out[(b, "free" + how)]
                print(f"B={b:4d} {key}{how} / free = {ratio:.3f} (overhead {100 * (ratio - 1):+.1f} %; medians of "
                      f"{args.rounds} interleaved rounds)", flush=True)
    return {f"{b}-{k}": v for (b, k), v in out.items()}


def _time_grammar_work() -> dict[str, float]:
    """Seconds spent in the grammar's host work, by part, summed over the calls since cleared: the
    engine thread's consume of a step's tokens (settle) and the fill thread's masks (fill)."""
    from pdserve.engine.grammar import Grammars

    spent: dict[str, float] = {}

    def timed(name: str, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return call
    for attr, name in (("_settle", "settle (engine thread)"), ("_fill", "fill (fill thread)")):
        if hasattr(Grammars, attr):  # (an older build measured with this script may lack one)
            setattr(Grammars, attr, timed(name, getattr(Grammars, attr)))
    return spent


def _model_dir(args) -> str:
    """The preset itself, or with `--tokenizer DIR` a model directory of the preset's config.json
    and that tokenizer.json (dummy weights still): the engine loads it as a user's model's."""
    if not args.tokenizer:
        return args.model
    import shutil
    import tempfile

    from pdserve.models.checkpoint_writer import checkpoint_config, hf_config
    d = tempfile.mkdtemp(prefix="grammar-masks-")
    config = hf_config(checkpoint_config(args.model), torch.bfloat16)
    with open(f"{args.tokenizer}/tokenizer.json") as f:
        specials = [t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special")]
    if specials:  # the tokenizer's own end token (the preset's id may lie past this vocabulary)
        config["eos_token_id"] = specials[0]
    with open(f"{d}/config.json", "w") as f:
        json.dump(config, f)
    shutil.copy(f"{args.tokenizer}/tokenizer.json", f"{d}/tokenizer.json")
    return d


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engines")
    e.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    e.add_argument("--tokenizer", help="a directory with tokenizer.json (default: the presets' byte tokenizer)")
    e.add_argument("--vocab", type=int, default=151936)
    # One engine per process: each engine's worker threads stay up between calls, and on a small host
    # the other engine's would compete with them.
    e.add_argument("--only", choices=["llguidance", "xgrammar"])
    e.add_argument("--steps", type=int, default=30)
    e.add_argument("--warmup", type=int, default=5)
    s = sub.add_parser("step")
    s.add_argument("--model", default="qwen3-30b-a3b")
    s.add_argument("--device", default="cuda")
    s.add_argument("--tokenizer", help="a directory with tokenizer.json: the engine's vocabulary (default: the "
                   "presets' byte tokenizer widened to the model's ids, whose 151k `<|token_N|>` entries a "
                   "grammar engine skips at once: the fill is ~9× cheaper than over a real BPE vocabulary)")
    s.add_argument("--batch", type=int, nargs="+", default=[256])
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--rounds", type=int, default=3, help="interleaved rounds of free, constrained, penalties passes")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    result = engines_run(args) if args.what == "engines" else step_run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
