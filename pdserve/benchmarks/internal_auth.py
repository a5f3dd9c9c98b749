"""What authentication costs on the internal hot paths, per message, against the same path without
it in the same run (CPU; no GPU needed):

    python -m pdserve.benchmarks.internal_auth            # table
    python -m pdserve.benchmarks.internal_auth --json

- notice: a finish notice packed and read (Notice.pack / unpack) against sealed and opened
  (kvtransfer/notice_seal.py: HMAC-SHA256 over it, its sender and receiver).
- TCP KV frame: one layer's frame written by a TcpBackend and placed by another over loopback, per
  frame, sealed (AES-256-GCM, pdserve/frame_seal.py) and with the sealing replaced by a constant
  tag (the same code otherwise); and, beside it, what AES-256-GCM alone (encrypt at one end,
  decrypt at the other) and an HMAC-SHA256 at both ends (the alternative) take over the same
  payload.
- channel frame: one DELTAS frame of `--streams` requests' new tokens (one step's: 32 and 512 by
  default) built, written, read and unpacked through the channel's own framing
  (pdserve/channel/wire.py: pack_delta, Link.write, Link.open, unpack_delta), as a Unix socket
  carries it (unsealed) and as TCP does (sealed); the bytes go into a buffer, not a socket, so the
  difference is the sealing's alone.

Each figure is CPU time (this process's, every thread: both ends of the TCP pair run here), the
median of `--repeats` timings of `--count` messages, in microseconds a message: on a shared host
CPU time moves far less with the neighbours' load than the wall clock does.
"""

import argparse
import datetime
import hmac
import json
import os
import statistics
import time

import torch

from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache


def per_message_us(fn, count: int, repeats: int) -> float:
    """CPU microseconds (process_time: every thread of this process) a call of fn, median of repeats."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(count):
            fn()
        times.append((time.process_time() - t0) / count * 1e6)
    return statistics.median(times)


def notice(count: int, repeats: int) -> dict:
    from pdserve.kvtransfer.notice_seal import NoticeSeal
    from pdserve.kvtransfer.wire import Notice

    sender, receiver = NoticeSeal("token", "prefill-0"), NoticeSeal("token", "decode-0")
    lp = (-0.25, [(17, -0.25), (3, -1.5), (9, -2.0)])

    def plain():
        Notice.unpack(Notice.finish("req-0123456789", 42, lp).pack())

    def sealed():
        receiver.open(sender.seal(Notice.finish("req-0123456789", 42, lp), "decode-0"))

    return {"plain_us": per_message_us(plain, count, repeats), "sealed_us": per_message_us(sealed, count, repeats)}


def _tcp_pair(blocks: int):
    from pdserve.kvtransfer.backends.tcp import TcpBackend
    from pdserve.kvtransfer.metadata import KVAgentMetadata

    # Qwen3-30B-A3B's KV per block and layer (4 KV heads x 128, 16 tokens, bfloat16): 16 KiB a plane.
    layout = KVLayout(2, blocks, 16, 4, 128, torch.bfloat16, "kv")
    ends = []
    for name in ("decode-0", "prefill-0"):
        kv = allocate_kv_cache(layout, torch.device("cpu"))
        ends.append(TcpBackend(KVAgentMetadata.for_cache(name, "tcp", kv, layout, "bench", "127.0.0.1"), kv,
                               cluster_token="token"))
    receiver, sender = ends
    receiver.add_peer(sender.meta)
    sender.add_peer(receiver.meta)
    receiver.grant("prefill-0", "r", list(range(blocks)))
    return receiver, sender, layout


def tcp_frame(blocks: int, count: int, repeats: int) -> dict:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from pdserve.frame_seal import TAG_BYTES, Sealer

    receiver, sender, layout = _tcp_pair(blocks)
    ids = list(range(blocks))
    seq = [0]

    def frames():
        for _ in range(count):
            sender.write("decode-0", 1, ids, ids).result(30)
        seq[0] += 1
        mark = b"%d" % seq[0]
        sender.notify("decode-0", mark)  # read after every frame before it: all are placed
        while mark not in receiver.notifications():
            time.sleep(0.001)  # (a sleep costs no CPU)

    def timed() -> float:
        return per_message_us(frames, 1, repeats) / count

    try:
        frames()  # (connected, warm)
        with_mac = timed()
        real = Sealer.seal, Sealer.open
        Sealer.seal = lambda self, payload, header=b"": payload + b"\0" * TAG_BYTES  # the same path,
        Sealer.open = lambda self, sealed, header=b"": sealed[:-TAG_BYTES]  # nothing sealed
        try:
            frames()
            without = timed()
        finally:
            Sealer.seal, Sealer.open = real
        with_mac = min(with_mac, timed())  # (interleaved: the host's load moves both)
    finally:
        receiver.close()
        sender.close()
    payload = os.urandom(blocks * 2 * layout.bytes_per_block)
    key, aes, nonce = os.urandom(32), AESGCM(os.urandom(32)), os.urandom(12)
    mac_us = per_message_us(lambda: hmac.digest(key, payload, "sha256"), 20, repeats)
    aes_us = per_message_us(lambda: aes.decrypt(nonce, aes.encrypt(nonce, payload, None), None), 20, repeats)
    return {"payload_bytes": len(payload), "sealed_us": with_mac, "unsealed_us": without,
            "hmac_both_ends_us": 2 * mac_us, "aes_gcm_both_ends_us": aes_us}


class _Buffer:
    """Where a Link writes: the bytes kept for the reading end (a socket's kernel copy left out)."""

    def __init__(self):
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def is_closing(self) -> bool:
        return False


def channel_frame(streams: int, count: int, repeats: int) -> dict:
    from pdserve.channel.wire import DELTAS, LEN, Link, pack, pack_delta, session_keys, unframe, unpack_delta
    from pdserve.messages import RequestDelta

    deltas = [RequestDelta(f"req-{i:04d}", " tok", [1000 + i]) for i in range(streams)]
    nonces = os.urandom(32)

    def path(sealed: bool):
        keys = session_keys("token", nonces, "router-0", "decode-0") if sealed else None
        buffer = _Buffer()
        worker, router = Link(buffer, keys[::-1] if keys else None), Link(_Buffer(), keys)

        def one():
            # (the engine thread's part, pack; then the channel thread's, write: sealed there)
            worker.write(pack(DELTAS, [pack_delta(d) for d in deltas]))
            data = buffer.chunks.pop()
            [unpack_delta(a) for a in unframe(router.open(data[LEN.size:]))[1]]
        return one

    plain, sealed = path(False), path(True)
    out = {"streams": streams, "frame_bytes": len(pack(DELTAS, [pack_delta(d) for d in deltas])),
           "plain_us": per_message_us(plain, count, repeats), "sealed_us": per_message_us(sealed, count, repeats)}
    out["plain_us"] = min(out["plain_us"], per_message_us(plain, count, repeats))  # (interleaved, as above)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=2000, help="messages a timing (notices, channel frames)")
    ap.add_argument("--frames", type=int, default=50, help="KV frames a timing")
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 64, 256], help="blocks a KV frame")
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 512], help="requests' deltas a channel frame")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
           "notice": notice(a.count, a.repeats),
           "tcp_frame": [tcp_frame(b, a.frames, a.repeats) for b in a.blocks],
           "channel_frame": [channel_frame(n, max(20, a.count * 8 // n), a.repeats) for n in a.streams]}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    n = out["notice"]
    print(f"notice: {n['plain_us']:.2f} us plain, {n['sealed_us']:.2f} us sealed "
          f"(+{n['sealed_us'] - n['plain_us']:.2f} us, {n['sealed_us'] / n['plain_us']:.2f}x)")
    for t in out["tcp_frame"]:
        print(f"TCP KV frame of {t['payload_bytes'] / 1024:.0f} KiB: {t['unsealed_us']:.0f} us unsealed, "
              f"{t['sealed_us']:.0f} us sealed ({t['sealed_us'] / t['unsealed_us']:.2f}x); AES-GCM at both "
              f"ends alone {t['aes_gcm_both_ends_us']:.0f} us, HMAC-SHA256 at both ends {t['hmac_both_ends_us']:.0f} us")
    for c in out["channel_frame"]:
        print(f"channel DELTAS frame of {c['streams']} streams ({c['frame_bytes']} bytes): {c['plain_us']:.1f} us "
              f"unsealed, {c['sealed_us']:.1f} us sealed (+{c['sealed_us'] - c['plain_us']:.1f} us, "
              f"{c['sealed_us'] / c['plain_us']:.2f}x)")


if __name__ == "__main__":
    main()
