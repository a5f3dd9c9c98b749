"""vLLM's `serve` flags, for what pdserve has, as overrides of cluster.yaml's keys: `pdserve serve
MODEL --port 8000 --max-model-len 4096` and `pdserve up FILE --port 8000`.

FLAGS is the one table from a flag to the keys it sets. Values go to the config loader as the
command line gave them (text): a bad one fails there, naming its key as a file's would, and the flag
that set it. vLLM flags for what pdserve lacks (LACKS) fail naming what to use instead."""

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import ClusterConfig, ConfigError, load_cluster_config

# --api-key sets no key of the file: keys live in router.api_keys_file or this variable
# (router/tenants.py), which `pdserve up` reads.
API_KEYS_ENV = "PDSERVE_API_KEYS"


@dataclass(frozen=True)
class Flag:
    name: str
    keys: tuple[str, ...]  # the cluster.yaml keys it sets, all to its value
    help: str
    metavar: str = "V"
    aliases: dict[str, str] = field(default_factory=dict)  # vLLM's words for a value pdserve spells otherwise
    switch: bool = False  # --X / --no-X (true / false), no value
    convert: Callable[[str], object] | None = None  # the text to the keys' value (a flag that takes JSON)


def _speculative_config(text: str) -> object:
    """vLLM's --speculative-config JSON as pdserve's `speculative:` (its num_speculative_tokens is
    num_tokens; deepseek_mtp is mtp). Text that is no JSON object is passed on: the loader names the key."""
    try:
        spec = json.loads(text)
    except ValueError:
        return text
    if not isinstance(spec, dict):
        return text
    spec = dict(spec)
    if "num_speculative_tokens" in spec:
        spec["num_tokens"] = spec.pop("num_speculative_tokens")
    if spec.get("method") == "deepseek_mtp":
        spec["method"] = "mtp"
    return spec


ROLES = ("prefill", "decode", "colocated")

FLAGS: tuple[Flag, ...] = (
    Flag("--model", ("model.path",), "a preset (tiny-moe, qwen3-30b-a3b, deepseek-v2-lite) or an HF checkpoint "
                                     "directory (pdserve serve: its MODEL)", "MODEL"),
    Flag("--served-model-name", ("model.served_name",), "the model's id in /v1/models and requests (default: MODEL)",
         "NAME"),
    Flag("--dtype", ("model.dtype",), "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on GPU)"),
    Flag("--load-format", ("model.load_format",), "auto (read *.safetensors) | dummy (random weights of the real shapes)"),
    Flag("--max-model-len", ("model.max_model_len",), "most tokens of a request, prompt and output (default: the "
                                                      "model's context length)", "N"),
    Flag("--kv-cache-dtype", ("model.kv_cache_dtype",), "auto | fp8_e4m3 (vLLM's fp8 is e4m3)",
         aliases={"fp8": "fp8_e4m3"}),
    Flag("--device", tuple(f"{r}.gpus" for r in ROLES), "cpu (the embedded default's) | cuda: one GPU per replica "
                                                        "(per rank)", aliases={"cpu": 0, "cuda": 1, "gpu": 1}),
    Flag("--host", ("router.host",), "the address HTTP and gRPC listen on", "HOST"),
    Flag("--port", ("router.http_port",), "OpenAI HTTP port (0: any free one, printed)", "PORT"),
    Flag("--grpc-port", ("router.grpc_port",), "gRPC port (0: any free one; none: no gRPC)", "PORT",
         aliases={"none": None, "null": None}),
    Flag("--tool-call-parser", ("router.tool_call_parser",), "auto (from the chat template) | hermes | "
                                                             "deepseek_v3 | mistral", "NAME"),
    Flag("--api-key", (API_KEYS_ENV,), "a key every /v1 request must carry (Authorization: Bearer KEY), as "
                                       "PDSERVE_API_KEYS", "KEY"),
    Flag("--tensor-parallel-size", ("prefill.tp_size", "colocated.tp_size"),
         "ranks per prefill and colocated replica (decode replicas shard experts: decode.ep_size)", "N"),
    Flag("--max-num-seqs", ("decode.max_num_seqs", "colocated.max_num_seqs"), "most sequences a decode (colocated) "
                                                                              "replica decodes at once", "N"),
    Flag("--max-num-batched-tokens", tuple(f"{r}.max_batch_tokens" for r in ROLES),
         "token budget of one step with prompt tokens (a decode replica's: its local prefills)", "N"),
    Flag("--gpu-memory-utilization", tuple(f"{r}.gpu_memory_utilization" for r in ROLES),
         "share of each GPU a replica fills, weights and KV cache (0-1]", "F"),
    Flag("--block-size", ("kv_transfer.block_size",), "tokens per KV block", "N"),
    Flag("--enable-prefix-caching", tuple(f"{r}.prefix_cache" for r in ROLES), "every replica's prefix cache "
                                                                               "(--no-enable-prefix-caching: off)",
         switch=True),
    Flag("--prefill-replicas", ("prefill.replicas",), "prefill replicas (default 1; 0 with --colocated-replicas)", "N"),
    Flag("--decode-replicas", ("decode.replicas",), "decode replicas (default 1; 0 with --colocated-replicas)", "N"),
    Flag("--speculative-config", ("decode.speculative", "colocated.speculative"),
         "speculative decoding of decode and colocated replicas, as JSON: {\"method\": \"ngram\" | \"mtp\", "
         "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": N}", "JSON",
         convert=_speculative_config),
    Flag("--colocated-replicas", ("colocated.replicas",), "replicas doing both phases; alone (no --prefill-replicas "
                                                          "or --decode-replicas): a colocated cluster", "N"),
)

# vLLM flags a user may reach for, which pdserve has no equivalent of: what to do instead.
LACKS = {
    "--pipeline-parallel-size": "pdserve has no pipeline parallelism: shard with --tensor-parallel-size (prefill and "
                                "colocated replicas) or decode.ep_size in a cluster.yaml",
    "--data-parallel-size": "pdserve scales by replicas: --prefill-replicas, --decode-replicas, --colocated-replicas",
    "--enable-expert-parallel": "expert parallelism is decode.ep_size in a cluster.yaml (pdserve up FILE)",
    "--quantization": "pdserve serves float32/bfloat16/float16 weights; --kv-cache-dtype fp8_e4m3 quantizes the KV cache",
    "--enable-lora": "pdserve serves no LoRA adapters",
    "--cpu-offload-gb": "pdserve offloads no weights to the CPU",
    "--swap-space": "pdserve recomputes a preempted sequence's KV; it swaps none to the CPU",
    "--tokenizer": "pdserve reads the tokenizer from the checkpoint directory (tokenizer.json)",
    "--trust-remote-code": "pdserve runs its own model code for the architectures it supports, never a checkpoint's",
}


def add_flags(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """FLAGS (without --model where the command takes MODEL), and LACKS, each failing with its reason."""
    g = p.add_argument_group("vLLM's flags (overrides of cluster.yaml's keys)")
    for f in FLAGS:
        if f.name == "--model" and not model_flag:
            continue
        help = f"{f.help} [{', '.join(f.keys)}]"
        if f.switch:
            g.add_argument(f.name, dest=_dest(f), action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            g.add_argument(f.name, dest=_dest(f), metavar=f.metavar, help=help)
    for name, why in LACKS.items():
        p.add_argument(name, nargs="?", action=_Lacking, why=why, help=argparse.SUPPRESS)


def overrides(args: argparse.Namespace) -> dict[str, object]:
    """{key: value} of the flags given (the API key under API_KEYS_ENV)."""
    out: dict[str, object] = {}
    for f in FLAGS:
        value = getattr(args, _dest(f), None)
        if value is None:
            continue
        if isinstance(value, str) and value.lower() in f.aliases:
            value = f.aliases[value.lower()]
        if f.convert is not None:
            value = f.convert(value)
        for key in f.keys:
            out[key] = value
    return out


def load(path: str | None, given: dict[str, object]) -> ClusterConfig:
    """cluster.yaml (None: the embedded default) with the flags' keys over it; a key they set wrong
    fails naming the flag too. --api-key joins PDSERVE_API_KEYS for `pdserve up` to read."""
    keys = {k: v for k, v in given.items() if k != API_KEYS_ENV}
    try:
        cfg = load_cluster_config(path, keys)
    except ConfigError as e:
        # Each key the error names: the flag that set it, or the flag that would.
        named = [k for f in FLAGS for k in f.keys if k in str(e)]
        by = [f"  {k} was set by {flag_of(k)} {given[k]!r}" if k in keys else f"  {k} is {flag_of(k)}" for k in named]
        raise ConfigError("\n".join([str(e), *by])) from None
    if API_KEYS_ENV in given:
        os.environ[API_KEYS_ENV] = ",".join(k for k in (os.environ.get(API_KEYS_ENV), str(given[API_KEYS_ENV])) if k)
    return cfg


def flag_of(key: str) -> str:
    return next(f.name for f in FLAGS if key in f.keys)


def describe(given: dict[str, object]) -> str:
    """One line of what the flags set, as `pdserve up` prints it (the API key not shown)."""
    shown = {}
    for key, value in given.items():
        shown.setdefault(flag_of(key), []).append(key if key == API_KEYS_ENV else f"{key}: {value}")
    return "; ".join(f"{flag} -> {', '.join(keys)}" for flag, keys in shown.items())


def _dest(f: Flag) -> str:
    return "flag_" + f.name.lstrip("-").replace("-", "_")


class _Lacking(argparse.Action):
    def __init__(self, *args, why: str, **kwargs):
        self.why = why
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"vLLM's {option_string} has no equivalent in pdserve: {self.why}")
