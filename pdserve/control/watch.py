"""`pdserve status --watch`: the cluster's state, replicas and routers, and the service's latency over
the last minute, redrawn until Ctrl-C, or until the cluster is gone (`pdserve down`, its controller
dead, Ray's GCS unreachable), which it says within an interval and exits 1. The router's /dashboard
(router/dashboard.py) shows the same figures, computed by the same functions.

The figures (the latency window, the rows) come from pdserve/cluster_view.py, which the router's
dashboard uses too; the drawing (rich, imported only here) is apart.

On a dead cluster Ray's own calls do not fail fast: they wait on Ray's reconnect to the GCS, which
ends the process after 60 s. So each interval first asks the GCS's port directly (a TCP connect),
every Ray call runs in a daemon thread waited on with a deadline (the main thread keeps taking
Ctrl-C), and leaving disconnects from Ray only where that cannot hang (see _leave).
"""

import os
import socket
import sys
import threading
import time

from pdserve.cluster_view import (Latency, Snapshot, Window, replica_rows, replica_snapshots, router_rows, router_urls,
                                  scrape)


# -- what is shown --------------------------------------------------------------------------------


def slo_mark(p90_s: float | None, target_ms: float | None) -> str:
    """"BREACH" when the p90 is above the target, "ok" below it, "" with no figure or no target."""
    if p90_s is None or not target_ms:
        return ""
    return "BREACH" if p90_s * 1000 > target_ms else "ok"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def view(status: dict, lat: Latency | None) -> dict:
    """The figures to draw, as rows of strings: state, replicas, routers, latency."""
    def text(v) -> str:
        return "-" if v is None else str(v)

    replicas = [[r.role, r.name, r.health, str(r.restarts), text(r.running), text(r.waiting),
                 "-" if r.kv_total is None else f"{r.kv_used}/{r.kv_total}"] for r in replica_rows(status)]
    routers = [[r.name, text(r.pid), r.health, text(r.streaming), str(r.restarts)] for r in router_rows(status)]
    slo = status.get("slo") or {}
    latency_rows = []
    if lat is not None:
        for what, p50, p90, target in (("TTFT", lat.ttft_p50, lat.ttft_p90, slo.get("ttft_ms")),
                                       ("TPOT", lat.tpot_p50, lat.tpot_p90, slo.get("tpot_ms"))):
            latency_rows.append([what, _ms(p50), _ms(p90), f"{target:g} ms" if target else "-",
                                 slo_mark(p90, target)])
    hit_rate = None if lat is None or lat.prefix_hit_rate is None else f"{lat.prefix_hit_rate:.0%}"
    http = (status.get("endpoints") or {}).get("http")
    return {"state": status["state"], "dashboard": f"{http}/dashboard" if http else None,
            "replicas": replicas, "routers": routers, "latency": latency_rows,
            "requests_per_s": None if lat is None else f"{lat.requests_per_s:.2f}",
            "window_s": None if lat is None else f"{lat.window_s:.0f}", "prefix_hit_rate": hit_rate}


REPLICA_COLUMNS = ["role", "replica", "health", "restarts", "running", "waiting", "KV blocks"]
ROUTER_COLUMNS = ["router", "pid", "health", "streaming", "restarts"]
LATENCY_COLUMNS = ["latency", "p50", "p90", "SLO", ""]


def _latency_title(v: dict) -> str:
    if v["window_s"] is None:
        return "latency: collecting (a second scrape is needed)"
    hits = f", prefix cache hit rate {v['prefix_hit_rate']}" if v.get("prefix_hit_rate") else ""
    return f"latency over the last {v['window_s']} s: {v['requests_per_s']} requests/s{hits}"


def _dashboard(v: dict) -> str:
    return f"  dashboard: {v['dashboard']}" if v.get("dashboard") else ""


def render_text(v: dict) -> str:
    """A plain snapshot (output that is not a terminal)."""
    def table(columns, rows):
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]  # (rows may be none)
        return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]

    lines = [f"state: {v['state']}  ({time.strftime('%H:%M:%S')}){_dashboard(v)}"]
    lines += table(REPLICA_COLUMNS, v["replicas"])
    if v["routers"]:
        lines += table(ROUTER_COLUMNS, v["routers"])
    lines.append(_latency_title(v))
    if v["latency"]:
        lines += table(LATENCY_COLUMNS, v["latency"])
    return "\n".join(lines)


def render_rich(v: dict):
    """The same as tables for rich.live.Live."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(title, columns, rows, style=None):
        t = Table(title=title, title_justify="left")
        for c in columns:
            t.add_column(c)
        for row in rows:
            t.add_row(*[Text(cell, style=style(cell) if style else None) for cell in row])
        return t

    def health(cell):
        return "red" if cell.startswith("down") or cell == "BREACH" else "yellow" if cell == "draining" else None

    state_style = {"running": "green", "degraded": "red"}.get(v["state"], "yellow")
    parts = [Text.assemble("state: ", (v["state"], state_style), f"  ({time.strftime('%H:%M:%S')}){_dashboard(v)}"),
             table("replicas", REPLICA_COLUMNS, v["replicas"], health)]
    if v["routers"]:
        parts.append(table("routers", ROUTER_COLUMNS, v["routers"], health))
    parts.append(table(_latency_title(v), LATENCY_COLUMNS, v["latency"], health) if v["latency"]
                 else Text(_latency_title(v)))
    return Group(*parts)


# -- the loop -------------------------------------------------------------------------------------

# How long the controller may go without answering while Ray's GCS still takes connections (a
# controller wedged, or its node cut off) before the watch gives up on it: what `pdserve status` waits.
ANSWER_S = 30.0
# A TCP connect to the GCS is refused at once where its process is gone; this bounds one to a host
# that no longer answers at all.
PROBE_S = 2.0
# How long leaving may wait for Ray's disconnect (ray.shutdown) before the process ends without it.
SHUTDOWN_S = 5.0
# The controller's states once `pdserve down` (or a stopped `pdserve up`) is taking the cluster away.
GONE_STATES = ("stopping", "stopped")
CALL_THREAD = "pdserve-watch-call"


class Gone(Exception):
    """The cluster is no more: its controller stopped or died, or Ray's GCS went away. Says which."""


class Unanswered(Exception):
    """The controller has not answered for ANSWER_S, though Ray's GCS is up."""


def gcs_answers(address: str, timeout: float = PROBE_S) -> bool:
    """Whether Ray's GCS at HOST:PORT still accepts a TCP connection. Asked outside Ray on purpose: a
    Ray call on a dead GCS waits on Ray's own reconnect, which gives up only after 60 s, by ending
    the process."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def call(fn, until: float, gcs: str, probe_every: float):
    """fn()'s result, fn run in a daemon thread and waited on here: the main thread stays free to take
    Ctrl-C (a Ray call blocks in C++, where no KeyboardInterrupt is raised), the GCS is probed every
    probe_every seconds meanwhile (Gone once it refuses), and past `until` (time.monotonic()) the
    call is abandoned (Unanswered): a daemon thread does not keep the process."""
    out: dict = {}
    done = threading.Event()

    def work():
        try:
            out["value"] = fn()
        except BaseException as e:  # (raised again in the caller's thread)
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name=CALL_THREAD, daemon=True).start()
    while not done.wait(max(0.0, min(probe_every, until - time.monotonic()))):
        if not gcs_answers(gcs):
            raise Gone(f"Ray's GCS at {gcs} no longer accepts connections")
        if time.monotonic() >= until:
            raise Unanswered
    if "error" in out:
        raise out["error"]
    return out["value"]


def _calls_in_flight() -> bool:
    return any(t.name == CALL_THREAD and t.is_alive() for t in threading.enumerate())


def _cause(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__


def _restarting() -> bool:
    """Whether the controller that failed a call is still named: Ray is restarting it (one stopped
    for good is no longer found)."""
    import ray

    from pdserve.actors import CONTROLLER, NAMESPACE

    try:
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except Exception:
        return False
    return True


def fetch(controller, timeout: float) -> tuple[dict, dict[str, Snapshot]]:
    """The controller's status, and each router's and replica's figures for the window."""
    import ray

    s = ray.get(controller.status.remote(), timeout=timeout)
    return s, scrape(router_urls(s)) | replica_snapshots(s)


def run(controller, interval: float, gcs: str | None = None) -> int:
    """A redrawn view on a terminal, else one plain snapshot per interval: until Ctrl-C (0), or until
    the cluster is gone or its controller stops answering (1, saying so). `gcs` is Ray's GCS
    HOST:PORT (by default the one this process is connected to). Either way the process ends
    promptly: see _leave."""
    import ray

    gcs = gcs or ray.get_runtime_context().gcs_address
    window = Window()
    answered = time.monotonic()

    def tick() -> dict | None:
        """The view to draw now; None when the controller did not answer this time."""
        nonlocal answered
        if not gcs_answers(gcs):  # before any Ray call: one on a dead GCS would wait out Ray's reconnect
            raise Gone(f"Ray's GCS at {gcs} no longer accepts connections")
        until = answered + ANSWER_S
        try:
            s, snaps = call(lambda: fetch(controller, max(0.1, until - time.monotonic())), until, gcs, interval)
        except ray.exceptions.ActorUnavailableError:  # for now (its node unreachable): asked again next time
            if time.monotonic() >= until:
                raise Unanswered from None
            return None
        except ray.exceptions.RayActorError as e:
            if _restarting() and time.monotonic() < until:  # its process died and Ray restarts it: ask again
                return None
            raise Gone(f"its controller died: {_cause(e)}") from None
        except ray.exceptions.GetTimeoutError:
            raise Unanswered from None
        answered = time.monotonic()
        if s["state"] in GONE_STATES:
            raise Gone(f"its controller is {s['state']}: `pdserve down` ran, or its `pdserve up` was stopped")
        window.add(answered, snaps)
        return view(s, window.latency())

    def views():
        while True:
            if (v := tick()) is not None:
                yield v
            time.sleep(interval)

    try:
        if sys.stdout.isatty():
            from rich.live import Live

            with Live(auto_refresh=False, screen=False) as live:
                for v in views():
                    live.update(render_rich(v), refresh=True)
        else:
            for v in views():
                print(render_text(v), end="\n\n", flush=True)
    except KeyboardInterrupt:
        return _leave(0, gcs)
    except Gone as e:
        print(f"pdserve: the cluster is gone ({e}); `pdserve up` starts one", file=sys.stderr, flush=True)
        return _leave(1, None)  # nothing left to disconnect from
    except Unanswered:
        print(f"pdserve: the controller has not answered for {ANSWER_S:g} s though Ray is up; `pdserve up`'s "
              f"output says why, `pdserve down` stops the cluster", file=sys.stderr, flush=True)
        return _leave(1, gcs)


def _leave(code: int, gcs: str | None) -> int:
    """`code`, once Ray is let go. Left to itself, Ray's atexit ray.shutdown waits on a dead GCS (its
    reconnect thread ends the process 60 s later, with its own message), and one beside a call
    still in flight can hang. So the disconnect is made here, only where the GCS (`gcs`; None: it
    is gone) answers and no call is in flight, in a daemon thread for at most SHUTDOWN_S; where it
    is not done by then, the process ends at once, its output flushed."""
    import ray

    if gcs is not None and not _calls_in_flight() and gcs_answers(gcs):
        done = threading.Thread(target=ray.shutdown, name="pdserve-watch-shutdown", daemon=True)
        done.start()
        try:
            done.join(SHUTDOWN_S)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            pass
        if not done.is_alive():
            return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
