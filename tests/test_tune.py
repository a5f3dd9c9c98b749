"""`pdserve tune` on a running CPU cluster: a workload that shifts from short prompts / long outputs
to long prompts / short outputs makes it recommend more prefill, `--watch --apply` moves the
cluster there and back with zero failed requests, and the KV blocks end idle."""

import json
import signal
import subprocess
import sys
import threading

import pytest

from serving_cluster import Cluster, until


DECODE_HEAVY = {"input_len": 16, "output_len": 64, "rate": 6}  # phase A: generation dominates
PREFILL_HEAVY = {"input_len": 1000, "output_len": 2, "rate": 1.5}  # phase B: prompts dominate


def bench(url: str, phase: dict, seconds: float, seed: int, out) -> subprocess.Popen:
    """`pdserve bench` as a user runs it, for `seconds` of Poisson arrivals."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "bench", "--url", url, "--rate", str(phase["rate"]),
         "--duration", str(seconds), "--input-len", str(phase["input_len"]), "--output-len",
         str(phase["output_len"]), "--warmup", "0", "--seed", str(seed), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def split(cluster: Cluster) -> tuple[int, int]:
    """Prefill and decode replicas serving now, as `pdserve status` shows them."""
    lines = [ln for ln in cluster.status().splitlines() if ln.startswith("pdserve-") and "running" in ln]
    return (sum(ln.startswith("pdserve-prefill-") for ln in lines), sum(ln.startswith("pdserve-decode-") for ln in lines))


def test_a_shifting_workload_moves_the_split_there_and_back_and_fails_nothing(tmp_path):
    cluster = Cluster(tmp_path, prefill={"replicas": 1}, decode={"replicas": 2}, kv_transfer={"backend": "tcp"},
                      slo={"ttft_ms": 2000, "tpot_ms": 100})
    watcher = None
    log: list[str] = []  # what the watcher printed
    try:
        cluster.wait_ready()
        assert split(cluster) == (1, 2)
        watcher = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "tune", "--watch", "--apply", "--interval", "2", "--window", "10",
             "--confirm", "2", "--cooldown", "5", "--min-requests", "8", "--grace", "120",
             "--address", cluster.up.ray_address()],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: log.extend(watcher.stdout), daemon=True).start()

        def moved_to(split_: str) -> bool:
            """The watcher decided the move: only then is `pdserve status` (a process joining Ray, under
            the bench's load) worth polling for it."""
            return any(f"moving to {split_}" in ln for ln in list(log))

        # A: decode-heavy. The split it started with (1P+2D) is the one to keep.
        a = bench(cluster.url, DECODE_HEAVY, 20, 1, tmp_path / "a.json")
        a.wait(timeout=120)
        assert split(cluster) == (1, 2), "".join(log)

        # B: prefill-heavy. One-shot tune recommends more prefill; --watch --apply moves there.
        b = bench(cluster.url, PREFILL_HEAVY, 60, 2, tmp_path / "b.json")
        until(lambda: moved_to("2P+1D") and split(cluster) == (2, 1), 90, "the move to 2 prefill + 1 decode")
        shot = cluster.cli("tune", "--window", "10", timeout=60)
        assert shot.returncode == 0, shot.stderr
        assert "recommended: 2 prefill + 1 decode" in shot.stdout, shot.stdout
        b.wait(timeout=180)

        # A again: back to more decode.
        a2 = bench(cluster.url, DECODE_HEAVY, 60, 3, tmp_path / "a2.json")
        until(lambda: moved_to("1P+2D") and split(cluster) == (1, 2), 90, "the move back to 1 prefill + 2 decode")
        a2.wait(timeout=180)

        for name in ("a", "b", "a2"):  # every request of every phase answered, while the cluster moved
            result = json.loads((tmp_path / f"{name}.json").read_text())
            summary = result["runs"][0]
            assert summary["sent"] > 0 and summary["failed"] == 0, (name, summary, "".join(log))
            assert summary["completed"] == summary["sent"]
        moves = [ln for ln in log if "moving to" in ln]
        assert [m.split("moving to ")[1].strip() for m in moves] == ["2P+1D", "1P+2D"], "".join(log)
        # Each move swapped one replica's role: a flip in place, not a start and a drain.
        flipped = [ln for ln in log if "flipped: " in ln]
        assert len(flipped) == 2 and not any("scaled: " in ln for ln in log), "".join(log)
        print("".join(flipped))
        stats = cluster.wait_idle()
        assert stats and all(s["used"] == 0 for s in stats.values()), stats
    finally:
        try:
            if watcher is not None:
                watcher.send_signal(signal.SIGINT)  # Ctrl-C ends the watch (~1 s): exit 0
                try:
                    assert watcher.wait(timeout=30) == 0, "".join(log)
                finally:
                    watcher.kill()
        finally:
            cluster.stop()  # (also when the watcher did not end: a cluster left running slows every later test)
