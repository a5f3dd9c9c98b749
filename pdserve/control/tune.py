"""`pdserve tune`: the prefill:decode split for the traffic, from what the cluster measured
(planner.py has the model).

    pdserve tune                       what the running cluster measured, and the split it should have
    pdserve tune --apply               ... and move there: replicas changing role flip in place, others
                                       start or drain (nothing is dropped)
    pdserve tune --watch [--apply]     every --interval s, with hysteresis and a cool-down
    pdserve tune --record FILE         write what the cluster measured as a profile
    pdserve tune --offline --profile FILE --input-len I --output-len O --rate R [--budget N]
"""

import argparse
import json
import sys
import time

from pdserve.control.planner import Hysteresis, Measured, PlannerError, Traffic, plan, render, scale_steps


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    p.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="seconds of traffic the split is sized for (default: %(default)s)")
    p.add_argument("--budget", type=int, metavar="N",
                   help="units to split (default: the GPUs the cluster has; on CPU the workers running now)")
    p.add_argument("--apply", action="store_true", help="scale the cluster to the recommended split")
    p.add_argument("--watch", action="store_true",
                   help="recommend again every --interval s until Ctrl-C (with --apply: and move there, with hysteresis)")
    p.add_argument("--interval", type=float, default=10.0, metavar="S", help="--watch: seconds between looks")
    p.add_argument("--confirm", type=int, default=2, metavar="N",
                   help="--watch: the same new split must be recommended N times in a row (default: %(default)s)")
    p.add_argument("--cooldown", type=float, default=60.0, metavar="S",
                   help="--watch: seconds after a change before the next (default: %(default)s)")
    p.add_argument("--margin", type=float, default=0.15, metavar="F",
                   help="--watch: move only to a split sustaining F more than now (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=10, metavar="N",
                   help="--watch: judge no window with fewer requests (default: %(default)s)")
    p.add_argument("--grace", type=float, default=300.0, metavar="S",
                   help="seconds a removed replica may take to finish what it holds (default: %(default)s)")
    p.add_argument("--record", metavar="FILE", help="write what the cluster measured as a profile (for --offline)")
    p.add_argument("--offline", action="store_true", help="answer from --profile, without a cluster")
    p.add_argument("--profile", nargs="+", metavar="FILE",
                   help="--offline: a profile from `pdserve tune --record`; several (recorded at different "
                        "decode.ep_size) are compared, and the EP size that sustains the most is recommended")
    p.add_argument("--rate", type=float, help="--offline: requests/s")
    p.add_argument("--input-len", type=float, help="--offline: prompt tokens")
    p.add_argument("--output-len", type=float, help="--offline: output tokens")
    p.add_argument("--slo-ttft-ms", type=float, help="--offline: default: the profile's slo")
    p.add_argument("--slo-tpot-ms", type=float, help="--offline: default: the profile's slo")


def _check(a: argparse.Namespace) -> None:
    if a.offline:
        missing = [f"--{k.replace('_', '-')}" for k in ("profile", "rate", "input_len", "output_len")
                   if getattr(a, k) is None]
        if missing:
            raise ValueError(f"--offline needs {', '.join(missing)}")
        if a.apply or a.watch or a.record:
            raise ValueError("--offline answers without a cluster: --apply, --watch and --record need one")
    for k in ("rate", "input_len", "output_len", "slo_ttft_ms", "slo_tpot_ms", "window", "interval", "grace"):
        v = getattr(a, k)
        if v is not None and not v > 0:
            raise ValueError(f"--{k.replace('_', '-')}: {v:g}; it must be above 0")
    if a.budget is not None and a.budget < 2:
        raise ValueError(f"--budget: {a.budget}; 1 prefill and 1 decode replica need at least 2")
    if a.confirm < 1 or a.margin < 0 or a.cooldown < 0 or a.min_requests < 1:
        raise ValueError("--confirm and --min-requests must be >= 1, --margin and --cooldown >= 0")


def main(a: argparse.Namespace) -> int:
    _check(a)
    if a.offline:
        return offline(a)
    from pdserve.control.commands import _controller, ask

    controller = _controller(a.address)  # first: it readies the environment Ray reads once, on import
    import ray

    if a.record:
        m = ask(controller, "load", a.window)
        with open(a.record, "w") as f:
            json.dump(m.to_json(), f, indent=1)
        print(f"wrote {a.record}: {sum(r[0] for b in m.steps.values() for r in b.values()):,} steps measured, "
              f"traffic {m.traffic.rate:.2f} req/s over {m.window_s:.0f} s")
        return 0
    if a.watch:
        return watch(controller, a)
    m = ask(controller, "load", a.window)
    p = plan(m, budget=a.budget)
    print(render(p, m))
    if a.apply and p.change:
        apply(controller, p, m, a.grace)
    return 0


def offline(a: argparse.Namespace) -> int:
    answers = []
    budget = a.budget
    for path in a.profile:
        m = Measured.load(path)
        if a.slo_ttft_ms:
            m.slo["ttft_ms"] = a.slo_ttft_ms
        if a.slo_tpot_ms:
            m.slo["tpot_ms"] = a.slo_tpot_ms
        m.replicas = {}  # no cluster now: nothing is "current"
        budget = budget or m.budget  # several profiles: all split the same budget (the first's, or --budget)
        answers.append((path, m, plan(m, Traffic(a.rate, a.input_len, a.output_len), budget)))
    path, m, best = max(answers, key=lambda x: x[2].best.max_rate)
    print(render(best, m, offline=True))
    if len(answers) > 1:
        print("EP size, each profile's best split of the same budget:")
        for path_i, m_i, p_i in answers:
            mark = "  <- recommended" if path_i == path else ""
            print(f"  decode.ep_size {m_i.limits.ep_size} ({path_i}): {p_i.best.prefill.replicas}P+"
                  f"{p_i.best.decode.replicas}D sustains {p_i.best.max_rate:.2f} req/s{mark}")
    return 0


def apply(controller, p, m: Measured, grace_s: float) -> None:
    """Move the cluster to the plan's split: replicas that change role flip in place (their process
    and weights stay: seconds, not a model load), where the cluster's replicas can flip; the
    rest of the change starts or drains replicas."""
    import ray

    from pdserve.control.commands import _log, ask, flip_with, scale_with

    now, target = p.current.counts, p.best.counts
    n, role = flips(now, target)
    if n and (why := ask(controller, "flippable")) is not None:
        _log(f"tune: no flips ({why}); starting and draining replicas instead")
        n = 0
    for _ in range(n):
        _log(f"tune: flipping a {'prefill' if role == 'decode' else 'decode'} replica to {role}")
        flip_with(controller, None, role, grace_s)
        now = (now[0] - 1, now[1] + 1) if role == "decode" else (now[0] + 1, now[1] - 1)
    if now == target:
        return
    free = ray.available_resources().get("GPU", 0.0)
    for counts in scale_steps(now, target, free, m.limits.ep_size, m.unit == "GPU"):
        _log(f"tune: scaling to {counts['prefill']} prefill + {counts['decode']} decode")
        scale_with(controller, counts, grace_s)


def flips(now: tuple[int, int], target: tuple[int, int]) -> tuple[int, str | None]:
    """How many replicas move from one role to the other between two (prefill, decode) splits, and
    to which role: a role that shrinks while the other grows gives its replicas to it."""
    dp, dd = target[0] - now[0], target[1] - now[1]
    if dp < 0 < dd:
        return min(-dp, dd), "decode"
    if dd < 0 < dp:
        return min(-dd, dp), "prefill"
    return 0, None


def too_little(t, window_s: float, min_requests: int) -> str | None:
    """Why a window's traffic is too little to plan on (None: enough)."""
    if t.requests < min_requests:
        return f"{t.requests} requests in {window_s:.0f} s, waiting for {min_requests}"
    if not t.finished:
        # Outputs are counted as requests finish: none finished says nothing of their length (read
        # as 0, a decode-heavy load looked prefill-bound and the split moved).
        return f"none of them finished in {window_s:.0f} s, so their outputs are unknown; waiting"
    return None


def watch(controller, a: argparse.Namespace) -> int:
    """Until Ctrl-C: a line per look; with --apply, moves that pass the hysteresis."""
    import ray

    from pdserve.control.commands import _log, ask

    h = Hysteresis(a.confirm, a.cooldown, a.margin)
    try:
        while True:
            t0 = time.monotonic()
            m = ask(controller, "load", a.window)
            t = m.traffic
            head = (f"{t.rate:.2f} req/s, prompts {t.input_len:,.0f}, outputs {t.output_len:,.0f}, now "
                    f"{m.replicas.get('prefill', 0)}P+{m.replicas.get('decode', 0)}D")
            if (wait := too_little(t, m.window_s, a.min_requests)) is not None:
                _log(f"tune: {head}: {wait}")
            else:
                try:
                    p = plan(m, budget=a.budget)
                except PlannerError as e:
                    _log(f"tune: {head}: {e}")
                else:
                    best = p.best
                    line = (f"tune: {head}: best {best.prefill.replicas}P+{best.decode.replicas}D "
                            f"sustains {best.max_rate:.2f} req/s ({best.bottleneck}-bound)")
                    if p.current is not None and p.change:
                        line += f", now {p.current.max_rate:.2f}"
                    move, why = h.decide(time.monotonic(), p) if a.apply else (None, "not applied (no --apply)")
                    _log(f"{line}: {why}")
                    if move:
                        apply(controller, p, m, a.grace)
                        h.last_change = time.monotonic()  # the cool-down counts from the end of the move
            time.sleep(max(0.0, a.interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0


def run(argv: list[str] | None = None) -> int:
    """`python -m pdserve.control.tune` (the same as `pdserve tune`)."""
    p = argparse.ArgumentParser(prog="pdserve tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    try:
        return main(p.parse_args(argv))
    except (ValueError, RuntimeError) as e:  # PlannerError is a ValueError
        print(f"pdserve tune: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
