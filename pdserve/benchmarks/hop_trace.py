"""A lone request's time to its first token, split into the hops it crosses (issue 40).

    PDSERVE_HOP_TRACE=/tmp/hops pdserve up c.yaml &
    PDSERVE_HOP_TRACE=/tmp/hops pdserve bench --rate 1 --max-concurrency 1 --num-prompts 20 ...
    python -m pdserve.benchmarks.hop_trace /tmp/hops [--json out.json]

Reads every process's hops (`pdserve/hop_trace.py`), sorts them into one timeline (one host: one
clock) and cuts it into one segment per request the bench sent, from its `send` to its
`first_event` (the client's first streamed token). Within a segment each hop counts once, at its
first passing. Prints, for every hop, in the order requests pass them, the median time from `send`
and the median time from the hop before: the client (send, first_event), the router (door,
validated, began, admitted, out_<call>, answer_in, deltas_in, first_delta, written), the worker
(frame_in, inbox, deltas_out) and its engine loop (taken, step, stepped). Only for requests sent one
at a time: segments that overlap are left out (counted).
"""

import argparse
import json
import statistics
from pathlib import Path


def read(trace_dir: Path) -> list[tuple[int, str]]:
    """(ns, hop) of every process, in time order."""
    marks = []
    for f in trace_dir.glob("*.hops"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit():
                marks.append((int(parts[0]), parts[1]))
    marks.sort()
    return marks


def segments(marks: list[tuple[int, str]], starts: list[int] | None = None) -> tuple[list[dict[str, float]], int]:
    """Per request sent alone: {hop: ms after its send} up to its first_event; and how many were
    left out (sent while another was in flight, from its send to its `done`: the hops of a process
    then belong to either). `starts` gets each kept request's send (ns)."""
    out, overlapped = [], 0
    current: dict[str, float] | None = None
    t0 = 0
    in_flight = 0
    for t, name in marks:
        if name == "done":
            in_flight = max(0, in_flight - 1)
            continue
        if name == "send":
            in_flight += 1
            if current is not None:
                overlapped += 1
            current, t0 = ({"send": 0.0}, t) if in_flight == 1 else (None, t)
            if current is None:
                overlapped += 1
            continue
        if current is None or name in current:
            continue
        current[name] = (t - t0) / 1e6
        if name == "first_event":
            out.append(current)
            if starts is not None:
                starts.append(t0)
            current = None
    return out, overlapped


def table(segs: list[dict[str, float]]) -> list[dict]:
    """Rows in the order of their median time after send: hop, requests that passed it, median ms
    after send, median ms after the hop before (on the same requests)."""
    names = {n for s in segs for n in s}
    order = sorted(names, key=lambda n: statistics.median(s[n] for s in segs if n in s))
    rows, prev = [], None
    for n in order:
        at = [s[n] for s in segs if n in s]
        gap = [s[n] - s[prev] for s in segs if n in s and prev in s] if prev else []
        rows.append({"hop": n, "requests": len(at), "after_send_ms": round(statistics.median(at), 3),
                     "after_previous_ms": round(statistics.median(gap), 3) if gap else None})
        prev = n
    return rows


def spans(marks: list[tuple[int, str]], begin: str, end: str) -> list[float]:
    """ms from each `begin` to the `end` after it (a step's host part: step -> stepped; a KV-events
    poll on a worker: kv_events -> kv_events_done), over the whole trace."""
    out, t0 = [], None
    for t, name in marks:
        if name == begin:
            t0 = t
        elif name == end and t0 is not None:
            out.append((t - t0) / 1e6)
            t0 = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N requests (warm-up)")
    ap.add_argument("--last", type=int, help="only the last N requests (the directory holds earlier runs too: "
                                             "leave it be while the cluster runs, its processes keep their files)")
    ap.add_argument("--span", nargs=2, action="append", metavar=("BEGIN", "END"),
                    help="also print the durations from each BEGIN hop to the END after it, e.g. step stepped")
    ap.add_argument("--json")
    a = ap.parse_args()
    marks = read(a.dir)
    starts: list[int] = []
    segs, overlapped = segments(marks, starts)
    segs, starts = segs[a.skip:], starts[a.skip:]
    if a.last:
        segs, starts = segs[-a.last:], starts[-a.last:]
    if starts:  # spans over the requests' own stretch of the trace (from the first one's send on)
        window = [m for m in marks if m[0] >= starts[0]]
        for begin, end in a.span or []:
            d = sorted(spans(window, begin, end))
            if d:
                print(f"{begin} -> {end}: {len(d)}, median {statistics.median(d):.3f} ms, p90 "
                      f"{d[int(0.9 * (len(d) - 1))]:.3f}, max {d[-1]:.3f}")
    if not segs:
        raise SystemExit(f"no request from send to first_event in {a.dir}: was PDSERVE_HOP_TRACE set for both "
                         f"`pdserve up` and `pdserve bench`, to this directory?")
    rows = table(segs)
    print(f"{len(segs)} requests ({overlapped} overlapping left out); medians")
    print(f"{'hop':<14} {'n':>4} {'after send ms':>14} {'after previous ms':>18}")
    for r in rows:
        prev = "" if r["after_previous_ms"] is None else f"{r['after_previous_ms']:.3f}"
        print(f"{r['hop']:<14} {r['requests']:>4} {r['after_send_ms']:>14.3f} {prev:>18}")
    if a.json:
        Path(a.json).write_text(json.dumps({"requests": len(segs), "overlapped": overlapped, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
