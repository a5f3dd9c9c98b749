"""What cluster.yaml can only be checked against the model: the sizes of its tensor- and
expert-parallel groups, and speculative decoding's MTP drafter (a layer the checkpoint must have). `pdserve up` runs it before anything starts; the config itself (config.py)
is checked without the model, below every layer that knows one."""

from pdserve.config import ClusterConfig, ConfigError
from pdserve.models.tensor_parallel import check_tp_size
from pdserve.ops.expert_placement import allowed_ep_sizes


def check_model_fit(cfg: ClusterConfig, args) -> None:
    """What cluster.yaml can only be checked against the model (its ModelArgs); raises ConfigError."""
    for role in ("prefill", "colocated"):
        c = getattr(cfg, role)
        if not c.replicas or c.tp_size == 1:
            continue
        try:
            check_tp_size(args, c.tp_size, f"{role}.tp_size")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    d, experts = cfg.decode, args.num_experts
    if d.ep_size > 1 and (not experts or experts % d.ep_size):
        allowed = ", ".join(map(str, allowed_ep_sizes(experts))) if experts else "1 (the model has no experts)"
        raise ConfigError(f"decode.ep_size: {d.ep_size} is not allowed — it must divide the model's "
                          f"{experts} experts (allowed: {allowed})")
    _check_mtp(cfg, args)
    bad = [e for e in d.ep_replicated_experts if not 0 <= e < experts]
    if bad or len(set(d.ep_replicated_experts)) != len(d.ep_replicated_experts):
        raise ConfigError(f"decode.ep_replicated_experts: {d.ep_replicated_experts} is not allowed — "
                          f"distinct expert ids in [0, {experts})")


def _check_mtp(cfg: ClusterConfig, args) -> None:
    """speculative.method 'mtp' needs the checkpoint's MTP layer, and no tensor-parallel replica
    that would run it (a colocated one, or a prefill one computing its KV for the decode side)."""
    for role in ("decode", "colocated"):
        if not getattr(cfg, role).speculative.mtp:
            continue
        if not getattr(args, "num_nextn_predict_layers", 0):
            raise ConfigError(f"{role}.speculative.method: 'mtp' is not allowed — the model ({args.architecture}) "
                              f"has no multi-token-prediction layer (config.json num_nextn_predict_layers); "
                              f"use 'ngram'")
        tp_role = "prefill" if role == "decode" else role
        if getattr(cfg, tp_role).replicas and getattr(cfg, tp_role).tp_size > 1:
            raise ConfigError(f"{role}.speculative.method: 'mtp' is not allowed with {tp_role}.tp_size "
                              f"{getattr(cfg, tp_role).tp_size} — a tensor-parallel replica does not run the "
                              f"MTP layer; use 'ngram'")
