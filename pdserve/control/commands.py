"""`pdserve up`, `down`, `scale` and `status` (`--watch`: watch.py): drive the controller of a
running cluster, and show its progress, its replicas' restarts and its KV pairs.

A call that meets the controller's death (`ask`) is asked again while Ray restarts the actor (it
takes the running cluster back, recovery.py), for at most RESTART_S."""

import faulthandler
import os
import signal
import sys
import time

from pdserve.config import load_cluster_config
from pdserve.control import preflight, ray_console


CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"


def _log(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def _connect(address: str | None) -> None:
    if address not in (None, "auto") or (address == "auto" and os.environ.get("RAY_ADDRESS")):
        _use_token_if_present()
    import ray  # noqa: F401  (after the environment is ready: Ray reads it once, on import)

    from pdserve.actors import NAMESPACE
    from pdserve.control import ray_start

    ray_console.ray_logger_to_file()  # Ray's notices to its log file (the CLI's), not the terminal
    ray_start.init(address, _log, namespace=NAMESPACE, include_dashboard=False, logging_level="WARNING",
                   log_to_driver=False, configure_logging=True)


def _use_token_if_present() -> None:
    """Ray (2.5x on) starts local clusters with token authentication and finds the token itself when
    it looks the cluster up ("auto"), but not for an address named outright (or by RAY_ADDRESS):
    there it must be told."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def up(path: str | None, flags: dict[str, object] | None = None) -> int:
    """Start the cluster of cluster.yaml (None: the embedded default), `flags` (serve_flags.py's
    {key: value}) over its keys; until Ctrl-C or `pdserve down`."""
    if flags:
        from pdserve.control import serve_flags

        cfg = serve_flags.load(path, flags)
        _log(f"flags: {serve_flags.describe(flags)}")
    else:
        cfg = load_cluster_config(path)
    api_keys = preflight.checked(cfg, _log)
    token = cluster_token()
    _forget_secrets()  # read: what Ray starts from here inherits this environment
    if cfg.ray.address == "local":  # the router will listen on this host: a taken port fails now, not after loading
        from pdserve.router.listen import check_free

        check_free(cfg.router.host, cfg.router.http_port, "router.http_port")
        if cfg.router.grpc_port is not None:
            check_free(cfg.router.host, cfg.router.grpc_port, "router.grpc_port")
    prefetch = None
    if cfg.model.prefetch and cfg.ray.address == "local":  # every worker reads on this host
        from pdserve.control.prefetch import checkpoint_files, start_prefetch

        prefetch = start_prefetch(checkpoint_files(cfg.model.path, cfg.model.load_format), _log)
    _log("starting Ray" if cfg.ray.address == "local" else f"joining Ray at {cfg.ray.address}")
    t0 = time.monotonic()
    _connect(None if cfg.ray.address == "local" else cfg.ray.address)  # before Ray's import: see _connect
    ray_s = time.monotonic() - t0
    _log(f"Ray {'started' if cfg.ray.address == 'local' else 'joined'} in {ray_s:.2f} s; its own messages: "
         f"{ray_console.log_path()}")
    import ray

    from pdserve.actors import CONTROLLER
    from pdserve.control.controller import Controller

    # Named so `pdserve down --address` reaches this cluster where a host runs several: with no
    # address, Ray picks the cluster started last on the host.
    _log(f"Ray at {ray.get_runtime_context().gcs_address}")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdserve.control.placement import check_placement, cluster_nodes
    from pdserve.control.ray_auth import check_cluster_auth

    nodes = cluster_nodes()
    # An open cluster fails now, before anything of ours (the cluster token, API keys) reaches it.
    check_cluster_auth(ray.get_runtime_context().gcs_address, cfg.ray.address != "local", len(nodes),
                       cfg.ray.allow_unauthenticated, _log)
    check_placement(cfg, nodes)  # a role no node can hold fails now, naming its key and the nodes
    if len(nodes) > 1:
        _log(f"{len(nodes)} Ray nodes: " + ", ".join(n.ip for n in nodes))
    # The controller, and the routers it starts beside it, run on this node: the endpoints are
    # where `pdserve up` runs (on KubeRay, the head pod, which the Service points at).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # Restarted by Ray if its process dies (max_restarts): the restarted one takes the running
    # replicas and routers back (Controller._recover), which serve on meanwhile.
    controller = ray.remote(Controller).options(name=CONTROLLER, lifetime="detached", num_cpus=0, max_restarts=-1,
                                                max_concurrency=8, scheduling_strategy=here).remote(
        cfg, token, api_keys)
    # Ctrl-C stops the cluster even where SIGINT arrives ignored: a shell starts background jobs
    # (`pdserve up &` in a script) with SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    # `kill -USR1 <pid>` prints every thread's stack: what a stuck `pdserve up` is waiting for.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        t1 = time.monotonic()
        endpoints = _wait_started(controller)
        for kind, url in endpoints.items():
            _log(f"{kind}: {url}")
        _log(f"dashboard: {endpoints['http']}/dashboard")
        now = time.monotonic()
        _log(f"up in {now - t0:.2f} s: Ray {ray_s:.2f} s, cluster start {now - t1:.2f} s")
        _log("ready; Ctrl-C stops everything")
        s = ask(controller, "status")
        shown, pid = len(s["progress"]), s["pid"]
        while True:  # until Ctrl-C, or `pdserve down` from elsewhere
            try:
                s = ask(controller, "status")
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            if s["pid"] != pid:  # a restarted controller: its progress starts afresh
                _log(f"the controller's process died; Ray restarted it (pid {s['pid']})")
                shown, pid = 0, s["pid"]
            # What the controller did since (a replica down and replaced, a scale, a drain).
            for line in s["progress"][shown:]:
                _log(line)
            shown = len(s["progress"])
            # "draining", "stopping": a `pdserve down` is at work; killing the controller now would cut it short.
            if s["state"] not in ("running", "degraded", "draining", "stopping"):
                break
            time.sleep(1)
    except KeyboardInterrupt:
        _log("stopping")
    finally:
        if prefetch is not None:
            prefetch.stop()
        _stop(controller)
        ray.shutdown()
    return 0


def cluster_token() -> str:
    """The secret every worker of this cluster proves in its KV handshake and TCP connections:
    PDSERVE_CLUSTER_TOKEN where given (several `pdserve up` sharing workers, a Kubernetes Secret),
    else a new random one for this cluster."""
    import secrets

    return os.environ.get(CLUSTER_TOKEN_ENV) or secrets.token_hex(32)


def _forget_secrets() -> None:
    """Drop the API keys' and the cluster token's variables from this process's environment once read:
    a Ray cluster that `pdserve up` starts here inherits its environment, and so would every worker
    Ray spawns (a model's code, a tokenizer's) though none reads them. The controller gets the token
    and the routers the keys' hashes as arguments."""
    from pdserve.router.tenants import ADMIN_ENV_VAR, ENV_VAR

    for name in (ENV_VAR, ADMIN_ENV_VAR, CLUSTER_TOKEN_ENV):
        os.environ.pop(name, None)


def _interrupt(signum, frame) -> None:
    """Ctrl-C, and SIGTERM (a service manager, a test harness), stop the cluster."""
    raise KeyboardInterrupt


def _wait_started(controller) -> dict[str, str]:
    import ray

    started = controller.start.remote()
    shown = 0
    while True:
        done, _ = ray.wait([started], timeout=0.5)
        try:
            lines = ray.get(controller.status.remote(), timeout=10)["progress"]
        except Exception:
            lines = []
        for line in lines[shown:]:
            _log(line)
        shown = max(shown, len(lines))
        if done:
            try:
                return ray.get(started)
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"the cluster failed to start: {_cause(e)}") from None


RESTART_S = 60  # a controller whose process died is back within this: Ray restarts it, it takes the cluster back


def ask(controller, method: str, *args, timeout: float = 30):
    """controller.<method>(*args), waited for at most `timeout` s. A call that met the controller's
    death is asked again while Ray restarts it (the actor is still named), for at most RESTART_S."""
    import ray

    from pdserve.actors import CONTROLLER, NAMESPACE

    deadline = time.monotonic() + RESTART_S
    while True:
        try:
            return ray.get(getattr(controller, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError:
            try:
                ray.get_actor(CONTROLLER, namespace=NAMESPACE)  # gone for good (stopped, or no restarts left): raises
            except ValueError:
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _cause(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _stop(controller) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=30)
    except Exception:
        pass
    try:
        ray.kill(controller)
    except Exception:
        pass


def _controller(address: str):
    """The running cluster's controller; exits (1) saying so when there is none."""
    try:
        _connect(address)  # first: it readies the environment Ray reads once, on import
    except ConnectionError:
        raise SystemExit(_fail(f"no Ray cluster is running here (Ray's messages: {ray_console.log_path()})")) from None
    import ray

    from pdserve.actors import CONTROLLER, NAMESPACE

    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise SystemExit(_fail("no pdserve cluster is running")) from None


def _fail(message: str) -> int:
    print(f"pdserve: {message}", file=sys.stderr)
    return 1


def scale(address: str, counts: dict[str, int], grace_s: float, flips: list[str] = ()) -> int:
    """Replicas per role on a running cluster: new ones start and join, removed ones drain; and
    flips (`REPLICA=ROLE`: a replica turned prefill or decode in place), done first."""
    if not counts and not flips:
        raise ValueError("scale: name at least one of --prefill, --decode, --colocated, --role")
    asked = []
    for f in flips:
        replica, sep, role = f.partition("=")
        if not sep or not replica or role not in ("prefill", "decode"):
            raise ValueError(f"--role {f}: write REPLICA=prefill or REPLICA=decode (e.g. pdserve-prefill-1=decode)")
        asked.append((replica, role))
    controller = _controller(address)  # first: it readies the environment Ray reads once, on import

    for replica, role in asked:
        flip_with(controller, replica, role, grace_s)
    if not counts:
        return 0
    s = ask(controller, "status")
    roles = {n.rsplit("-", 1)[0].removeprefix("pdserve-") for n in s["replicas"]}
    for role, n in counts.items():
        # Colocated replicas may join a disaggregated cluster (it becomes mixed); prefill and decode
        # replicas never join one without the other (cluster.yaml's rule, pdserve/config.py).
        if role not in roles and not (role == "colocated" and n >= 1):
            have = " and ".join(sorted(roles))
            raise ValueError(f"--{role}: this cluster has {have} replicas; a {role} replica cannot join it")
        if n < 1 and not (role == "colocated" and {"prefill", "decode"} <= roles):
            raise ValueError(f"--{role}: {n}; a role the cluster has needs at least 1 replica")
    return scale_with(controller, counts, grace_s)


def scale_with(controller, counts: dict[str, int], grace_s: float) -> int:
    """One `scale` call on the controller, its progress shown as it goes (also `pdserve tune --apply`)."""
    result = _follow(controller, controller.scale.remote(counts, grace_s), "scale")
    _log(f"scaled: started {', '.join(result['started']) or 'none'}; removed "
         f"{', '.join(result['removed']) or 'none'}")
    return 0


def flip_with(controller, replica: str | None, role: str, grace_s: float) -> dict:
    """One flip on the controller (`replica` None: its choice), its progress shown as it goes, and the
    time from the command to serving in the new role (also `pdserve tune --apply`)."""
    result = _follow(controller, controller.flip.remote(replica, role, grace_s), "flip")
    _log(f"flipped: {result['replica']} serves as {result['as']} {result['serving_s']:.2f} s after the command "
         f"(drain {result['drain_s']:.2f} s, switch {result['switch_s']:.2f} s, KV pairs {result['pair_s']:.2f} s)")
    return result


def _follow(controller, done, what: str):
    """Wait for a controller call, showing its progress lines as they come; its answer."""
    import ray

    shown = len(ask(controller, "status")["progress"])
    while True:  # (the controller bounds a scale or flip: its replicas' start and the drain's --grace)
        ready, _ = ray.wait([done], timeout=0.5)
        try:
            lines = ask(controller, "status")["progress"]
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"the controller stopped answering ({_cause(e)}); `pdserve status` "
                               f"shows what the cluster has now") from None
        for line in lines[shown:]:
            _log(line)
            shown += 1
        if ready:
            try:
                return ray.get(done)
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"{what} failed: {_cause(e)}") from None


def down(address: str, grace_s: float = 30.0) -> int:
    """Stop the cluster; with grace_s, the requests in flight finish first (no new ones are taken)."""
    controller = _controller(address)  # first: it readies the environment Ray reads once, on import
    import ray

    if grace_s > 0:
        _log(f"draining: no new requests; those in flight finish (at most {grace_s:g} s)")
    try:
        ray.get(controller.shutdown.remote(grace_s), timeout=grace_s + 60)
    except ray.exceptions.RayActorError:
        pass  # the `pdserve up` that started it removed it as it stopped: it is gone either way
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the cluster did not stop within {grace_s + 60:g} s; `pdserve status` shows what "
                           f"is left, `ray stop` ends everything") from None
    _log("stopped")
    return 0


def status(address: str, watch: bool = False, interval: float = 2.0) -> int:
    """Replicas, routers and endpoints once; with watch, a live view (pdserve/control/watch.py) until Ctrl-C."""
    if watch and interval <= 0:
        raise ValueError(f"--interval: {interval:g}; it must be above 0 seconds")
    controller = _controller(address)  # first: it readies the environment Ray reads once, on import
    if watch:
        from pdserve.control import watch as live

        return live.run(controller, interval)

    for line in status_lines(ask(controller, "status")):
        print(line)
    return 0


def status_lines(s: dict) -> list[str]:
    """`pdserve status`'s lines, from the controller's status."""
    restarts = s.get("restarts", {})
    out = []

    def restarted(name: str) -> str:
        n = restarts.get(name, 0)
        return f", restarted {n}x" if n else ""

    out.append(f"state: {s['state']}")
    out.append(f"pdserve-controller (pid {s['pid']})")
    for kind, url in s["endpoints"].items():
        out.append(f"{kind}: {url}")
    if "http" in s["endpoints"]:
        out.append(f"dashboard: {s['endpoints']['http']}/dashboard")
    for name, r in s["replicas"].items():
        on = _on_nodes(s.get("nodes", {}).get(name, {}))
        if isinstance(r, str):
            out.append(f"{name}{on}: {r}{restarted(name)}")
        else:
            group = f" ({r.ranks} expert-parallel ranks)" if r.ranks > 1 else f" (pid {r.pid})"
            flipped = f", {s['flips'][name]}" if name in s.get("flips", {}) else ""
            out.append(f"{name}{group}{on}: running {r.running}, waiting {r.waiting}, KV blocks used "
                       f"{r.total_blocks - r.free_blocks}/{r.total_blocks}{restarted(name)}{flipped}")
    for name, r in s.get("routers", {}).items():
        if isinstance(r, str):
            out.append(f"{name}: {r}")
        else:
            own = f", own {r['endpoints']['own']}" if "own" in r["endpoints"] else ""
            out.append(f"{name} (pid {r['pid']}): streaming {r['in_flight']}{own}{restarted(name)}")
    for p in s.get("kv_pairs", []):
        if p.get("state") == "failed":  # takes no requests until a retry pairs it
            out.append(f"KV {p['worker']} -> {p['peer']}: not paired ({p['reason']}: {p['why']}); attempt "
                       f"{p['attempts']} failed, next in {p['retry_in_s']:.0f} s")
        elif p["worker"].startswith("pdserve-prefill"):  # each pair once, as prefill -> decode
            out.append(f"KV {p['worker']} -> {p['peer']}: {p['backend']} ({p['why']})")
    return out


def _on_nodes(nodes: dict[str, dict]) -> str:
    """" on node IP (id)" for the nodes a replica's workers run on."""
    where = sorted({(n["ip"], n["node_id"][:8]) for n in nodes.values()})
    return (" on node " + ", ".join(f"{ip} ({nid})" for ip, nid in where)) if where else ""
