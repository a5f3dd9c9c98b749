"""What cluster.yaml can only be checked against the model: the sizes of its tensor- and
expert-parallel groups. `pdserve up` runs it before anything starts; the config itself (config.py)
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
    bad = [e for e in d.ep_replicated_experts if not 0 <= e < experts]
    if bad or len(set(d.ep_replicated_experts)) != len(d.ep_replicated_experts):
        raise ConfigError(f"decode.ep_replicated_experts: {d.ep_replicated_experts} is not allowed — "
                          f"distinct expert ids in [0, {experts})")
