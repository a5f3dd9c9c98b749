"""The `pdserve` command: generate (offline, one process), write-checkpoint, up, serve, down, scale,
status, tune, bench-engine and bench. The cluster commands are pdserve/control/commands.py's and
tune.py's; each subcommand imports what it needs when it runs, so that `--help` stays fast."""

import argparse
import sys

from pdserve.config import EngineConfig, ModelConfig


def _log(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace) -> int:
    # Imported here so `pdserve --help` stays fast (torch takes seconds to import).
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    model = ModelConfig(path=args.model, dtype=args.dtype, load_format=args.load_format,
                        kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(EngineConfig(model=model, device=args.device), log=_log)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    def show(out):
        print(out.text, end="", flush=True)

    result = engine.generate([prompt], params, on_output=show)[0]
    print(flush=True)
    _log(f"{len(result.token_ids)} tokens, finish reason: {result.finish_reason.value}")
    return 0


def _write_checkpoint(args: argparse.Namespace) -> int:
    from pdserve.models.checkpoint_writer import DTYPE_NAMES, parse_size, write_checkpoint

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device {args.device!r}: cpu or cuda")
    files = write_checkpoint(args.model, args.out_dir, DTYPE_NAMES[args.dtype], parse_size(args.shard_size), args.seed,
                             args.device, args.num_layers, log=_log)
    _log(f"wrote {len(files)} shards, model.safetensors.index.json, config.json and the tokenizer to "
         f"{args.out_dir}; serve it with model.path: {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation in one process, printed as it is produced")
    g.add_argument("prompt")
    g.add_argument("--model", default="tiny-moe", help="a preset (tiny-moe, qwen3-30b-a3b, deepseek-v2-lite) or an HF model directory")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="what the KV cache stores: auto = the model's dtype; fp8_e4m3 = 1 byte a value")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--device", default="cpu")
    g.set_defaults(func=_generate)

    w = sub.add_parser("write-checkpoint", help="dummy weights as an HF checkpoint directory: sharded safetensors, "
                                                "index, config.json, tokenizer (nothing downloaded)")
    w.add_argument("model", help="a preset (tiny-moe, qwen3-30b-a3b, deepseek-v2-lite) or a config.json (or its directory)")
    w.add_argument("out_dir", help="the directory to write (created; it must not hold a checkpoint)")
    w.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    w.add_argument("--shard-size", default="5GB", help="most bytes per shard, as the Hub's max_shard_size (5GB, 512MiB)")
    w.add_argument("--seed", type=int, default=0, help="the dummy weights' seed (model.seed of load_format: dummy)")
    w.add_argument("--device", default="cpu",
                   help="where the weights are drawn: the same seed gives the same weights as dummy loading on "
                        "that device type (cpu or cuda)")
    w.add_argument("--num-layers", type=int, help="only the first N layers (a smaller model of the same tensors)")
    w.set_defaults(func=_write_checkpoint)

    from pdserve.control import commands as cluster_cli
    from pdserve.control import serve_flags

    u = sub.add_parser("up", help="start the cluster (no file: tiny-moe on CPU, 1 prefill + 1 decode, HTTP :8000)")
    u.add_argument("config", nargs="?", help="cluster.yaml")
    serve_flags.add_flags(u)
    u.set_defaults(func=lambda a: cluster_cli.up(a.config, serve_flags.overrides(a)))
    sv = sub.add_parser("serve", help="serve MODEL with vLLM's flags (the embedded default's cluster: 1 prefill + 1 "
                                      "decode on CPU, HTTP :8000)",
                        description="`pdserve up` of the embedded default, with vLLM's serve flags over its keys.")
    sv.add_argument("model", nargs="?", metavar="MODEL",
                    help="a preset (tiny-moe, qwen3-30b-a3b, deepseek-v2-lite) or an HF checkpoint directory "
                         "(default: tiny-moe) [model.path]")
    serve_flags.add_flags(sv, model_flag=False)
    sv.set_defaults(func=lambda a: cluster_cli.up(None, ({"model.path": a.model} if a.model else {})
                                                  | serve_flags.overrides(a)))
    d = sub.add_parser("down", help="stop the cluster that `pdserve up` started (its requests in flight finish first)")
    d.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    d.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="seconds the requests in flight may take to finish; none are taken meanwhile (0: stop now)")
    d.set_defaults(func=lambda a: cluster_cli.down(a.address, a.grace))
    sc = sub.add_parser("scale", help="replicas per role on a running cluster: new ones join, removed ones drain")
    sc.add_argument("--prefill", type=int, metavar="N")
    sc.add_argument("--decode", type=int, metavar="M")
    sc.add_argument("--colocated", type=int, metavar="K")
    sc.add_argument("--role", action="append", default=[], metavar="REPLICA=ROLE",
                    help="flip a replica in place between prefill and decode (e.g. pdserve-prefill-1=decode): it "
                         "drains its role's work and serves in the new one, keeping its process and weights")
    sc.add_argument("--grace", type=float, default=120.0, metavar="S",
                    help="seconds a removed replica may take to finish what it holds; what is left then moves")
    sc.add_argument("--address", default="auto")
    sc.set_defaults(func=lambda a: cluster_cli.scale(a.address, {r: n for r in ("prefill", "decode", "colocated")
                                                                 if (n := getattr(a, r)) is not None}, a.grace,
                                                     a.role))
    st = sub.add_parser("status", help="replicas, their load and the endpoints")
    st.add_argument("--address", default="auto")
    st.add_argument("--watch", action="store_true",
                    help="redraw until Ctrl-C, with TTFT/TPOT p50/p90 and requests/s over the last minute vs the slo")
    st.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between redraws (--watch)")
    st.set_defaults(func=lambda a: cluster_cli.status(a.address, a.watch, a.interval))

    tu = sub.add_parser("tune", help="the prefill:decode split for the traffic the cluster measured (--apply, --watch, "
                                     "--offline --profile FILE)", description=tune_doc(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    from pdserve.control import tune

    tune.add_args(tu)
    tu.set_defaults(func=tune.main)

    # Its arguments are parsed by the benchmark itself (`pdserve bench-engine --help` lists them), so
    # that `pdserve --help` does not import torch. prefix_chars="\0": every word goes through as is.
    be = sub.add_parser("bench-engine", add_help=False, prefix_chars="\0",
                        help="engine prefill MFU and decode S-MBU vs the device's ceilings and HF transformers")
    be.add_argument("args", nargs=argparse.REMAINDER)
    be.set_defaults(func=_bench_engine)
    b = sub.add_parser("bench", add_help=False, prefix_chars="\0",
                       help="load generator against a running cluster: Poisson arrivals, TTFT/TPOT/ITL, goodput")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    return parser


def tune_doc() -> str:
    from pdserve.control import planner, tune

    return f"{tune.__doc__}\n{planner.__doc__}"


def _bench_engine(args: argparse.Namespace) -> int:
    from pdserve.benchmarks import bench_engine

    return bench_engine.main(args.args)


def _bench(args: argparse.Namespace) -> int:
    from pdserve.benchmarks.load.command import main

    return main(args.args)


# The commands that start or join Ray: its own console lines go to a log file (ray_console.py).
RAY_COMMANDS = {"up", "serve", "down", "scale", "status", "tune"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in RAY_COMMANDS:
        from pdserve.control import ray_console

        ray_console.divert(args.command)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # Errors a user caused (bad parameter, unknown preset, missing file): no traceback.
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
