"""Configuration, validated on load: a wrong key or value fails naming the key and what is allowed."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve.router_config import RouterConfig
from pdserve.speculative_config import SpeculativeConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str = "tiny-moe"  # a preset name or a directory with config.json + *.safetensors
    # The model's id in /v1/models, in requests' `model` and in vLLM's metrics' model_name (vLLM's
    # --served-model-name); default: path.
    served_name: str | None = Field(default=None, min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    seed: int = 0  # for dummy weights
    max_model_len: int | None = Field(default=None, ge=1)  # default: the model's context length
    # What the KV cache stores: auto = the model's dtype; fp8_e4m3 = float8 e4m3 with a static scale
    # per layer and plane (half of bfloat16's bytes per token, a quarter of float32's; moved as such).
    # A model setting, so that every replica of a cluster (both ends of a transfer) caches alike.
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    # `pdserve up` on one host reads the checkpoint's files into the page cache while Ray starts
    # and the workers spawn (as much as half the available memory holds; control/prefetch.py).
    prefetch: bool = True


class EngineConfig(_Strict):
    """One engine core; `role` selects what it does with a request."""

    model: ModelConfig = ModelConfig()
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    device: str = "cpu"
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)  # default: from kv_cache_gb
    kv_cache_gb: float | None = Field(default=None, gt=0)  # default: 0.25 on CPU; on a GPU what is free after the weights less (1 - gpu_memory_utilization) of the card
    # The share of the GPU this engine may fill, weights and KV cache (vLLM's key): the rest is left
    # for activations, graph pools and peers' CUDA contexts (engine/kv_budget.py). GPU only.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)  # token budget of one step
    chunk_size: int = Field(default=2048, ge=1)  # most prompt tokens of one request in one step
    enable_prefix_cache: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"  # auto: triton on CUDA, torch on CPU
    moe_backend: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True  # decode steps on a GPU replay captured graphs (batch-size buckets); false: no graphs at all
    # The largest decode batch captured (larger ones run eagerly); capture goes up to
    # min(max_num_seqs, this). Each bucket's graph holds its activations and decode attention's
    # split-K buffers, so larger captures cost memory; an eager step at 512 ran several times slower
    # than its graph for an EP rank (docs/benchmarks-history.md, expert-parallel decode), hence 512.
    cuda_graph_max_batch: int = Field(default=512, ge=1)
    # Prefill steps (fresh prompts, cached prefixes, later chunks, decoders beside a prompt) of up to
    # this many tokens replay CUDA graphs, padded to a token-count bucket (engine/prefill_graphs.py);
    # 0: off. Default: 4096 on a GPU with the Triton backends (every role: a decode replica prefills
    # its local prompts), where such a step is host-bound. cuda_graphs: false turns these off too.
    prefill_graph_max_tokens: int | None = Field(default=None, ge=0)
    # Sequences one such graph holds (min(max_num_seqs, this)); a step of more runs eagerly — on a
    # decode or colocated replica under load, every step that mixes a prompt's chunk into more
    # decoders than this. 32 here, a prefill replica's (decode and colocated sections: 128); graphs
    # of more than 33 slots launch the attention over the sequences' tiles only
    # (ops/prefill_attention.py, `flat`).
    prefill_graph_max_seqs: int = Field(default=32, ge=1)
    # Queue step N+1 on the device before handing out step N's tokens (default: on a GPU).
    overlap_scheduling: bool | None = None
    # A step with decoding sequences takes prompt tokens only up to the budget that keeps it within
    # this many ms, from the engine's fitted step costs (engine/tpot_guard.py); None: no bound. Set
    # from slo.tpot_ms for the replicas slo.tpot_guard names.
    tpot_guard_ms: float | None = Field(default=None, gt=0)
    # Run every kind of step once before the replica is ready (engine/warm_up.py; default: on a GPU,
    # where kernels compile on first use; on CPU nothing does, and it would only cost time).
    warm_up: bool | None = None
    # Draft tokens checked in each decode step (engine/spec_decode.py); the colocated and decode
    # roles only (a prefill engine samples one token per request; given method mtp, it computes the
    # MTP layer's KV of each prompt, which moves to the decode replica with the rest).
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda"):
            raise ValueError(f"must be 'cpu' or 'cuda[:N]', got {v!r}")
        return v

    @field_validator("prefill_graph_max_tokens")
    @classmethod
    def _prefill_graphs(cls, v: int | None, info: ValidationInfo) -> int | None:
        return check_prefill_graph_max_tokens(v, on_gpu=str(info.data.get("device", "cpu")).startswith("cuda"))


def check_prefill_graph_max_tokens(v: int | None, on_gpu: bool) -> int | None:
    """prefill_graph_max_tokens: left out, 0 (off), or at least 2 tokens on a GPU."""
    if v == 1:
        raise ValueError("must be 0 (off) or at least 2: a step of fresh prompts with one token is decode-shaped")
    if v and not on_gpu:
        raise ValueError(f"{v} needs a GPU (CUDA graphs); on the CPU leave it out or set 0")
    return v


# -- cluster.yaml ---------------------------------------------------------------------------------


class ConfigError(ValueError):
    """cluster.yaml is wrong; the message names each bad key, its value and what is allowed."""


class RayConfig(_Strict):
    address: str = "local"  # local: start a Ray cluster here | auto: join the running one | ray://host:port
    # Run on a joined (or multi-node) Ray cluster that answers callers without Ray's token: anyone
    # who reaches it runs code on every node. Off: `pdserve up` refuses such a cluster.
    allow_unauthenticated: bool = False

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v not in ("local", "auto") and not v.startswith("ray://") and ":" not in v:
            raise ValueError(f"must be 'local', 'auto', 'ray://host:port' or 'host:port', got {v!r}")
        return v


class PlacementConfig(_Strict):
    """Where a role's replicas run on a Ray cluster of several nodes. A node qualifies when it has
    every label in `labels` (`ray start --labels k=v`; KubeRay: the worker group's rayStartParams)
    and offers the custom `resources` (`ray start --resources`); every worker (an EP rank each)
    takes `resources` from it, so that a node offering {pd_prefill: 1} holds one prefill worker.
    `strategy` places the role's replicas among the nodes that qualify: "spread" on the node with
    the fewest of them, "pack" on the one with the most (fewest nodes used), "any" where Ray likes."""

    labels: dict[str, str] = Field(default_factory=dict)
    resources: dict[str, float] = Field(default_factory=dict)
    strategy: Literal["any", "spread", "pack"] = "any"

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, v: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(v) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"{', '.join(builtin)} {'is' if len(builtin) == 1 else 'are'} Ray's own "
                             f"(GPUs come from the section's gpus); name custom resources only")
        bad = {k: a for k, a in v.items() if not a > 0}
        if bad:
            raise ValueError(f"amounts must be above 0, got {bad}")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if any(not k or k.startswith("ray.io/") for k in v):
            raise ValueError("label keys must be non-empty and not Ray's own (ray.io/...)")
        return v


# prefill.replicas and decode.replicas left out (None) are settled by ClusterConfig: 1 each in a
# disaggregated cluster, 0 in a colocated one (a mixed cluster names both).


class PrefillConfig(_Strict):
    replicas: int | None = Field(default=None, ge=0)
    gpus: int = Field(default=0, ge=0, le=1)  # per replica (per rank with tp_size > 1)
    # Tensor parallelism, as colocated.tp_size; the KV leaves whole from rank 0, so any decode
    # replica (one rank or expert parallel) takes it.
    tp_size: int = Field(default=1, ge=1)
    max_batch_tokens: int = Field(default=8192, ge=1)
    chunk_size: int = Field(default=2048, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # with gpus: 1, EngineConfig's key
    # The replica's prefix cache (vLLM's enable_prefix_caching): full blocks of KV kept, by hash, for
    # the next prompt that starts alike. false: every prompt is computed whole (the
    # baseline of a comparison, or prompts that never share a prefix).
    prefix_cache: bool = True
    # Prefill steps of up to this many tokens replay CUDA graphs (EngineConfig's key); default
    # 4096 with a GPU, 0: off.
    prefill_graph_max_tokens: int | None = Field(default=None, ge=0)
    warm_up: bool | None = None  # every kind of step run once before ready; default: on a GPU
    placement: PlacementConfig = PlacementConfig()

    @field_validator("prefill_graph_max_tokens")
    @classmethod
    def _prefill_graphs(cls, v: int | None, info: ValidationInfo) -> int | None:
        return check_prefill_graph_max_tokens(v, on_gpu=bool(info.data.get("gpus")))


class DecodeConfig(_Strict):
    replicas: int | None = Field(default=None, ge=0)
    gpus: int = Field(default=0, ge=0, le=1)  # per rank
    # Expert parallelism: a replica is ep_size ranks, one process (and GPU) each;
    # attention data-parallel, experts sharded. ep_size must divide the model's number of experts.
    ep_size: int = Field(default=1, ge=1)
    ep_threshold: int = Field(default=1024, ge=0)  # tokens per rank from which MoE layers exchange by
    # all-to-all; below it by all-gather / reduce-scatter, replayed from CUDA graphs up to batch 256
    # (0: always all-to-all). The all-gather path led at every batch per rank measured, graphed or
    # eager (docs/benchmarks-history.md, expert-parallel decode): all-to-all is for batches beyond those.
    ep_replicated_experts: list[int] = Field(default_factory=list)  # hot experts copied to every rank
    # The ranks of one EP replica share a node (their exchange is NVLink's), unless this is true:
    # then they fill as few nodes as hold them (their exchange crosses the network).
    ep_across_nodes: bool = False
    max_num_seqs: int = Field(default=256, ge=1)
    # A local prefill's (router.prefill_site): the most tokens of a step, and of one prompt in a
    # step; within them the TPOT guard (slo.tpot_guard) sizes each mixed step's chunk.
    max_batch_tokens: int = Field(default=8192, ge=1)
    chunk_size: int = Field(default=2048, ge=1)
    cuda_graphs: bool = True
    # Those local prefills' steps of up to this many tokens replay CUDA graphs (EngineConfig's key;
    # eager, a short prompt's step held the engine's thread ~40 ms on an H200, every decoder of the
    # replica waiting); default 4096 with a GPU, 0: off.
    prefill_graph_max_tokens: int | None = Field(default=None, ge=0)
    # Sequences one such graph holds (EngineConfig's key). 128 here (EngineConfig's 32): a chunk mixed
    # into 32 decoders of 4k context took 23 ms a step in a graph of 128 against 30 ms eager (96
    # decoders: equal), H200, 2026-11-29, docs/benchmarks.md.
    prefill_graph_max_seqs: int = Field(default=128, ge=1)
    overlap_scheduling: bool | None = None  # step N+1 queued before N is handed out; default: on a GPU
    speculative: SpeculativeConfig = SpeculativeConfig()  # off by default (EngineConfig's key)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # with gpus: 1, EngineConfig's key
    # The replica's prefix cache: a reservation reuses the blocks it holds already (a conversation's
    # next turn), so only the rest of the KV moves. false: every block of every prompt moves.
    prefix_cache: bool = True
    warm_up: bool | None = None  # every kind of step run once before ready; default: on a GPU
    placement: PlacementConfig = PlacementConfig()

    @field_validator("prefill_graph_max_tokens")
    @classmethod
    def _prefill_graphs(cls, v: int | None, info: ValidationInfo) -> int | None:
        return check_prefill_graph_max_tokens(v, on_gpu=bool(info.data.get("gpus")))

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: SpeculativeConfig, info: ValidationInfo) -> SpeculativeConfig:
        if v.mtp and info.data.get("ep_size", 1) > 1:  # (its prefill replicas would cache one layer more)
            raise PydanticCustomError("mtp_ep", "method 'mtp' is not for an expert-parallel decode replica "
                                      "(ep_size {ep}): its ranks do not speculate", {"ep": info.data["ep_size"]})
        return v


class ColocatedConfig(_Strict):
    """Replicas doing both phases in one engine (continuous batching, chunked prefill): the
    baseline every disaggregated figure is compared with. No KV moves between them."""

    replicas: int = Field(default=0, ge=0)
    gpus: int = Field(default=0, ge=0, le=1)  # per replica (per rank with tp_size > 1)
    # Tensor parallelism: a replica is tp_size ranks, one process each (heads and MLP / expert
    # width sharded, one all-reduce after attention and after the MLP): NCCL between the replica's
    # GPUs (one a rank, gpus: 1), gloo on the CPU.
    tp_size: int = Field(default=1, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_batch_tokens: int = Field(default=8192, ge=1)
    chunk_size: int = Field(default=2048, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # with gpus: 1, EngineConfig's key
    # The replica's prefix cache (vLLM's enable_prefix_caching): full blocks of KV kept, by hash, for
    # the next prompt that starts alike. false: every prompt is computed whole (the
    # baseline of a comparison, or prompts that never share a prefix).
    prefix_cache: bool = True
    cuda_graphs: bool = True
    # Prefill steps of up to this many tokens replay CUDA graphs (EngineConfig's key); default
    # 4096 with a GPU, 0: off.
    prefill_graph_max_tokens: int | None = Field(default=None, ge=0)
    # Sequences one such graph holds (EngineConfig's key). 128 here (EngineConfig's 32): a chunk mixed
    # into 32 decoders of 4k context took 23 ms a step in a graph of 128 against 30 ms eager (96
    # decoders: equal), H200, 2026-11-29, docs/benchmarks.md.
    prefill_graph_max_seqs: int = Field(default=128, ge=1)
    overlap_scheduling: bool | None = None  # step N+1 queued before N is handed out; default: on a GPU
    speculative: SpeculativeConfig = SpeculativeConfig()  # off by default (EngineConfig's key)
    warm_up: bool | None = None  # every kind of step run once before ready; default: on a GPU
    placement: PlacementConfig = PlacementConfig()

    @field_validator("prefill_graph_max_tokens")
    @classmethod
    def _prefill_graphs(cls, v: int | None, info: ValidationInfo) -> int | None:
        return check_prefill_graph_max_tokens(v, on_gpu=bool(info.data.get("gpus")))


class KVTransferConfig(_Strict):
    # auto: chosen per prefill/decode pair at the handshake — cuda_ipc when both are on GPUs of
    # one host, else nixl, else tcp (kvtransfer/backends/auto.py).
    backend: Literal["nixl", "tcp", "cuda_ipc", "auto"] = "nixl"
    block_size: int = Field(default=16, ge=1)
    lease_s: float = Field(default=30.0, gt=0)


class SloConfig(_Strict):
    ttft_ms: float = Field(default=1000, gt=0)
    tpot_ms: float = Field(default=100, gt=0)
    # Which replicas take prompt tokens beside their decoding sequences only as the decoders'
    # slack under tpot_ms pays for them (engine/tpot_guard.py): decode (a local prefill, a
    # preempted sequence's recompute), all (colocated replicas' prompts too), off (chunks up to
    # chunk_size and max_batch_tokens, whatever they cost the decoders). Colocated replicas are
    # not guarded by default: their goodput with the guard has not been measured yet.
    tpot_guard: Literal["decode", "all", "off"] = "decode"

    @field_validator("tpot_guard", mode="before")
    @classmethod
    def _guard_words(cls, v):
        """YAML reads a bare `off` as false (and `on` as true)."""
        return {False: "off", True: "decode"}.get(v, v) if isinstance(v, bool) else v


class ClusterConfig(_Strict):
    model: ModelConfig = ModelConfig()
    ray: RayConfig = RayConfig()
    router: RouterConfig = RouterConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    # Declared after prefill and decode: its check reads theirs. Validated even when left out,
    # for that check.
    colocated: ColocatedConfig = Field(default=ColocatedConfig(), validate_default=True)
    kv_transfer: KVTransferConfig = KVTransferConfig()
    slo: SloConfig = SloConfig()

    @field_validator("colocated")
    @classmethod
    def _one_topology(cls, colocated: ColocatedConfig, info: ValidationInfo) -> ColocatedConfig:
        """Disaggregated (prefill and decode replicas), colocated (colocated replicas only) or mixed
        (all three: a request goes whole to a colocated replica or down the disaggregated path,
        router/prefill_site.py). Prefill replicas never come without decode ones, nor decode without
        prefill: their KV would have nowhere to go, or no prefill replica to come from. Runs even
        when other sections are wrong, so that every error shows at once."""
        named = {f"{s}.replicas": info.data[s].replicas for s in ("prefill", "decode")
                 if s in info.data and info.data[s].replicas is not None}  # (a wrong section is reported already)
        if colocated.replicas:
            given = {k: v for k, v in named.items() if v > 0}
            bad = given if len(given) == 1 else {}  # one of the two: half a disaggregated path
            allowed = (f"with colocated.replicas: {colocated.replicas}, prefill and decode replicas come together "
                       f"(a mixed cluster: prefill.replicas and decode.replicas both >= 1) or not at all (a "
                       f"colocated cluster: leave prefill.replicas and decode.replicas out, or 0)")
        else:
            bad = {k: v for k, v in named.items() if v < 1}
            allowed = ("a disaggregated cluster needs at least 1 prefill and 1 decode replica "
                       "(or set colocated.replicas >= 1 for a colocated cluster)")
        if bad:
            raise PydanticCustomError("topology", "{allowed}", {"keys": bad, "allowed": allowed})
        return colocated

    @field_validator("kv_transfer")
    @classmethod
    def _cuda_ipc_on_gpus(cls, kv: KVTransferConfig, info: ValidationInfo) -> KVTransferConfig:
        """cuda_ipc maps the decode replica's GPU memory into the prefill worker: both on GPUs."""
        on_cpu = [f"{s}.gpus" for s in ("prefill", "decode") if s in info.data and not info.data[s].gpus]
        # (A colocated cluster moves no KV; a mixed one does, between its prefill and decode replicas.)
        moves_kv = not info.data.get("colocated", ColocatedConfig()).replicas or \
            bool("prefill" in info.data and info.data["prefill"].replicas)
        if kv.backend == "cuda_ipc" and on_cpu and moves_kv:
            raise PydanticCustomError("topology", "{allowed}", {
                "keys": {"kv_transfer.backend": kv.backend},
                "allowed": f"cuda_ipc moves KV between GPUs of one host, and {' and '.join(on_cpu)} "
                           f"{'is' if len(on_cpu) == 1 else 'are'} 0; set them to 1, or use nixl or tcp"})
        return kv

    @model_validator(mode="after")
    def _default_replicas(self) -> "ClusterConfig":
        n = 0 if self.colocated.replicas else 1
        for key in ("prefill", "decode"):
            section = getattr(self, key)
            if section.replicas is None:  # a copy: a section passed in by the caller stays as it was
                setattr(self, key, section.model_copy(update={"replicas": n}))
        return self

    @property
    def topology(self) -> Literal["disaggregated", "colocated", "mixed"]:
        """Which replicas serve a request: prefill and decode ones, colocated ones, or both kinds."""
        if not self.colocated.replicas:
            return "disaggregated"
        return "mixed" if self.prefill.replicas else "colocated"

    def engine_config(self, role: str) -> EngineConfig:
        """The engine settings of one replica of `role` ('prefill', 'decode' or 'colocated')."""
        r = getattr(self, role)
        # A colocated engine never moves KV, but shares the cluster's block size all the same.
        kw = dict(model=self.model, role=role, device="cuda" if r.gpus else "cpu",
                  block_size=self.kv_transfer.block_size, num_kv_blocks=r.num_kv_blocks, warm_up=r.warm_up,
                  enable_prefix_cache=r.prefix_cache, gpu_memory_utilization=r.gpu_memory_utilization)
        # Every role computes prompts (a decode replica its local prefills).
        kw.update(max_num_batched_tokens=r.max_batch_tokens, chunk_size=r.chunk_size,
                  prefill_graph_max_tokens=r.prefill_graph_max_tokens)
        if role == "prefill" and self.decode.speculative.mtp:
            kw.update(speculative=self.decode.speculative)  # the MTP layer's KV goes with the prompt's
        if role in ("decode", "colocated"):  # the generation phase
            kw.update(max_num_seqs=r.max_num_seqs, cuda_graphs=r.cuda_graphs,
                      prefill_graph_max_seqs=r.prefill_graph_max_seqs,
                      overlap_scheduling=r.overlap_scheduling,
                      speculative=r.speculative,
                      tpot_guard_ms=self.slo.tpot_ms if self.slo.tpot_guard in (role, "all") else None)
        return EngineConfig(**kw)


def load_cluster_config(path: str | None, overrides: dict[str, object] | None = None) -> ClusterConfig:
    """Read and validate cluster.yaml; None gives the embedded default (tiny-moe on CPU, 1 + 1).
    overrides: dotted keys ("router.http_port") set over the file's (`pdserve serve`'s flags),
    validated with it: a bad value fails naming its key, as in the file."""
    import yaml
    from pydantic import ValidationError

    raw: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections "
                              f"({', '.join(ClusterConfig.model_fields)})")
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        if not isinstance(raw.get(section), dict):  # absent, or an empty section (None in YAML)
            raw[section] = {} if raw.get(section) is None else raw[section]
        if isinstance(raw[section], dict):  # (else the section itself is wrong, and reported so)
            raw[section][name] = value
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as e:
        where = path or "the embedded default"
        if overrides:
            where += " with the command line's flags"
        raise ConfigError(f"{where}:\n" + "\n".join(_explain(err) for err in e.errors())) from None


def _explain(err: dict) -> str:
    """One line per problem: the dotted key, the value given, and what is allowed."""
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "topology":  # names keys of other sections than where it was found
        keys = err["ctx"]["keys"]
        given = ", ".join(f"{k}: {v!r}" for k, v in keys.items())
        return f"  {given} {'is' if len(keys) == 1 else 'are'} not allowed — {err['msg']}"
    if err["type"] == "extra_forbidden":
        section = _section(err["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else "?"
        return f"  {key}: unknown key (allowed here: {allowed})"
    return f"  {key}: {err['input']!r} is not allowed — {err['msg']}"


def _section(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = ClusterConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model
