"""The checkpoint read into this host's page cache while Ray starts and the workers spawn.

`pdserve up` spends many seconds before any worker reads a weight (Ray's start, the worker processes'
imports, building the model); the disk idles all that time, and then the weights take as long
as the disk takes. Reading the files from the command's first second on moves that wait under
the rest: a worker on this host then finds the first files in the page cache (its reader goes at
memory speed there, several times the disk's) and meets the disk only
where the prefetch has not yet been.

Only as much as the page cache can keep: files, in the loaders' order, up to half of the host's
available memory (a prefetch the cache evicts before the worker reads it would only read twice).
A worker on another host gains nothing; nor does a second start, whose files are cached already
(then this reads at memory speed and costs a second or two of one core).
"""

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

CHUNK = 16 * 2**20  # one read; discarded: only the page cache keeps what it read
STREAMS = 4  # files read at once: a disk serves several requests in parallel (as ChunkedReader reads)
MEMORY_SHARE = 0.5  # of MemAvailable: the most the prefetch reads


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where the host does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan(files: list[Path], budget: int) -> list[Path]:
    """The files to prefetch: in order, while their sizes fit in `budget` bytes."""
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > budget:
            break
        chosen.append(path)
        total += size
    return chosen


class Prefetch:
    """Reads `files` (whole, STREAMS at once) on daemon threads; `stop()` ends it early. What
    it did is logged once at the end through `log`."""

    def __init__(self, files: list[Path], log: Callable[[str], None]):
        self.files, self.log = files, log
        self.bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._todo: queue.Queue = queue.Queue()
        for path in files:
            self._todo.put(path)
        self._left = min(STREAMS, len(files))
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._read, name=f"pdserve-prefetch-{i}", daemon=True)
                         for i in range(self._left)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def _read(self) -> None:
        buf = bytearray(CHUNK)
        failed = None
        try:
            while not self._stop.is_set():
                try:
                    path = self._todo.get_nowait()
                except queue.Empty:
                    break
                with open(path, "rb", buffering=0) as f:
                    while not self._stop.is_set() and (n := f.readinto(buf)):
                        with self._lock:
                            self.bytes += n
        except OSError as e:  # a prefetch is only a head start: the worker's own read will say what is wrong
            failed = e
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if failed is not None:
            self.log(f"checkpoint prefetch stopped: {failed}")
        if last:
            s = time.monotonic() - self._t0
            how = "stopped" if self._stop.is_set() else "done"
            self.log(f"checkpoint prefetch {how}: {self.bytes / 1e9:.2f} GB into the page cache in {s:.2f} s "
                     f"({self.bytes / max(s, 1e-9) / 1e9:.2f} GB/s)")


def start_prefetch(files: list[Path], log: Callable[[str], None], memory: int | None = None) -> Prefetch | None:
    """A Prefetch of as many of `files` as half the available memory holds; None where that is none."""
    memory = available_memory() if memory is None else memory
    if memory is None:
        return None
    chosen = plan(files, int(memory * MEMORY_SHARE))
    if not chosen:
        return None
    size = sum(p.stat().st_size for p in chosen)
    total = sum(p.stat().st_size for p in files)
    log(f"prefetching the checkpoint into the page cache while Ray starts: {size / 1e9:.2f} of "
        f"{total / 1e9:.2f} GB ({len(chosen)} of {len(files)} files; model.prefetch: false turns this off)")
    return Prefetch(chosen, log)


def checkpoint_files(model_path: str, load_format: str) -> list[Path]:
    """The safetensors files `pdserve up`'s workers will read, or [] (a preset, dummy weights)."""
    from pdserve.models.loader import safetensors_files

    path = Path(model_path)
    if load_format == "dummy" or not path.is_dir():
        return []
    try:
        return safetensors_files(path)
    except FileNotFoundError:
        return []
