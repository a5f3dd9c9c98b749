"""Checkpoint files into a model's parameters at the disk's rate.

Each file's header says where every tensor's bytes lie (`safetensors_format.py`) and the model says
where each tensor goes (`WeightPlacer`), before anything is read; the bytes then go with few large
sequential reads straight to where they belong:

- CPU parameters (`HostReader`): scatter reads (preadv) of up to BATCH_BYTES of the file straight
  into the parameters' own memory, in file order; nothing is copied twice. A helper thread takes
  the first-write page faults of the parameters' fresh memory ahead of the reads.
- GPU parameters (`ChunkedReader`): READERS threads read files (one each at a time) in CHUNK_BYTES
  pieces into pinned staging buffers; the loading thread copies each piece to the tensors it covers with
  asynchronous copies on a stream of their own and hands the buffer back with the copies' event.
  The disk, the copies and the Python between them all overlap.

A tensor whose bytes are not the parameter's as they stand (another dtype, a fused expert tensor
transposed or cut to this rank's experts, a tensor-parallel rank's columns of a row-parallel weight)
is gathered whole in host memory and converted by torch, as any copy would. Tensors the model does
not take (another rank's experts) are not read, nor are the rows of a column-parallel weight that
other tensor-parallel ranks hold.
"""

import os
import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.models.decoder import DecoderLM, Placement, WeightPlacer
from pdserve.models.safetensors_format import TensorEntry, read_header

CHUNK_BYTES = 64 * 2**20  # one staging buffer: a read this large runs at the disk's sequential rate
STAGING_BUFFERS = 3  # with one reader: one being read, one being copied to the GPU, one spare for the reader's lead
READERS = 4  # files read at once by the GPU reader (an NVMe disk serves several requests in parallel)
GAP_BYTES = 2**20  # unwanted bytes between two wanted tensors shorter than this are read through, not skipped
BATCH_BYTES = 64 * 2**20  # one scatter read of the CPU reader: as large a request as a chunk
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16
_PAGE = 4096
READ_STALL_S = 300.0  # no chunk read in this long: the disk or file system is stuck


@dataclass
class LoadStats:
    """What loading the weights took: `source` "safetensors" (`bytes` read from `files` files) or
    "dummy" (`bytes` drawn at random); `weights_s` the reading (or drawing), `total_s` that plus
    building and allocating the model."""

    source: str
    files: int
    bytes: int
    weights_s: float
    total_s: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.weights_s, 1e-9) / 1e9

    def describe(self) -> str:
        what = f"{self.files} safetensors files" if self.source == "safetensors" else "dummy (random)"
        return (f"weights: {self.bytes / 1e9:.2f} GB, {what}, in {self.weights_s:.2f} s "
                f"({self.gb_per_s:.2f} GB/s); model built and loaded in {self.total_s:.2f} s")


@torch.no_grad()
def stream_safetensors(model: DecoderLM, files: list[Path], reader=None) -> int:
    """Fill every parameter of `model` (allocated, on its device) from `files`; returns the bytes
    read. `reader`: HostReader (the default for CPU parameters) or ChunkedReader (for GPU ones)."""
    placer = WeightPlacer(model)
    if reader is None:
        device = next(model.parameters()).device
        reader = ChunkedReader(device) if device.type == "cuda" else HostReader()
    total = reader.load(files, placer)
    placer.finish()
    return total


def _plan(path: Path, placer: WeightPlacer) -> list[tuple[TensorEntry, Placement]]:
    """The file's tensors the model takes, in file order, each with where it goes. Where a
    tensor-parallel rank takes a run of a tensor's rows (`Placement.rows`), only those are planned."""
    jobs = []
    for entry in read_header(path):
        if (target := placer.place(entry.name, entry.shape)) is None:
            continue
        if target.rows is not None:
            entry, target = _rows_of(entry, *target.rows), target.rows_only()
        jobs.append((entry, target))
    return jobs


def _rows_of(entry: TensorEntry, start: int, stop: int) -> TensorEntry:
    """The part of `entry` that holds its rows [start, stop) (row-major: one run of bytes)."""
    row = entry.nbytes // entry.shape[0]
    return TensorEntry(entry.name, entry.dtype, (stop - start, *entry.shape[1:]),
                       entry.start + start * row, entry.start + stop * row)


def _verbatim(entry: TensorEntry, target: Placement) -> bool:
    return target.verbatim and entry.dtype == target.dst.dtype


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (its bytes, in place)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _open(path: Path):
    return open(path, "rb", buffering=0)


def _read_into(f, buf: memoryview, path: Path) -> None:
    while buf:
        n = f.readinto(buf)
        if not n:
            raise ValueError(f"{path}: the file ends before the tensors its header lists")
        buf = buf[n:]


def _host_tensor(entry: TensorEntry, raw: torch.Tensor) -> torch.Tensor:
    return raw.view(entry.dtype).reshape(entry.shape) if entry.nbytes else torch.empty(entry.shape, dtype=entry.dtype)


class HostReader:
    """CPU parameters: each file read front to back, straight into the parameters: one scatter read
    (preadv) fills the tensors of up to BATCH_BYTES of the file, so the disk sees requests as large
    as dd's, and nothing is copied twice. Freshly allocated memory costs a page fault per page on
    its first write, which inside the read would stall the disk: a helper thread touches each
    batch's pages first, while the batch before it is being read."""

    def load(self, files: list[Path], placer: WeightPlacer) -> int:
        batches = [(path, batch) for path in files for batch in _batches(_plan(path, placer))]
        touched = [threading.Event() for _ in batches]
        stop = threading.Event()
        toucher = threading.Thread(target=_touch_pages, args=(batches, touched, stop), name="pdserve-weights-touch",
                                   daemon=True)
        toucher.start()
        total, f, open_path = 0, None, None
        try:
            for (path, batch), ready in zip(batches, touched):
                if not ready.wait(READ_STALL_S):
                    raise RuntimeError(f"loading {path} stalled: its memory was not ready in {READ_STALL_S:.0f} s")
                if path != open_path:
                    if f is not None:
                        f.close()
                    f, open_path = _open(path), path
                total += _read_batch(f, path, batch)
                for _, target in batch:
                    placer.done(target)
        finally:
            stop.set()
            if f is not None:
                f.close()
            toucher.join(READ_STALL_S)
        return total


def _touch_pages(batches, touched: list[threading.Event], stop: threading.Event) -> None:
    """Write a byte on every page of each batch's destination (the page faults), in order, each
    batch strictly before it is read into (its event)."""
    try:
        for (_, batch), ready in zip(batches, touched):
            if stop.is_set():
                return
            for entry, target in batch:
                if _verbatim(entry, target):
                    _bytes_of(target.dst)[::_PAGE].zero_()
            ready.set()
    finally:
        for ready in touched:  # (on an error, the reader goes on without the head start)
            ready.set()


def _read_batch(f, path: Path, batch: list[tuple[TensorEntry, Placement]]) -> int:
    """One scatter read of a batch's bytes into its tensors (converted afterwards where they must
    be); returns the bytes read."""
    start, bufs, converted = batch[0][0].start, [], []
    pos = start
    for entry, target in batch:
        if entry.start > pos:  # a short run of bytes no parameter takes: read through
            bufs.append(memoryview(bytearray(entry.start - pos)))
        if _verbatim(entry, target):
            bufs.append(memoryview(_bytes_of(target.dst).numpy()))
        else:
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            bufs.append(memoryview(raw.numpy()))
            converted.append((entry, target, raw))
        pos = entry.end
    _pread_into(f.fileno(), bufs, start, path)
    for entry, target, raw in converted:
        target.copy(_host_tensor(entry, raw))
    return pos - start


def _batches(jobs: list[tuple[TensorEntry, Placement]]) -> list[list[tuple[TensorEntry, Placement]]]:
    """Jobs read by one scatter read each: within one run (_runs), up to BATCH_BYTES (a larger
    tensor alone) and fewer buffers than the system's IOV_MAX (gaps count as buffers too)."""
    batches = []
    for first, last in _runs(jobs):
        batch: list = []
        for entry, target in jobs[first:last]:
            if batch and (entry.end - batch[0][0].start > BATCH_BYTES or 2 * len(batch) + 2 > _IOV_MAX):
                batches.append(batch)
                batch = []
            batch.append((entry, target))
        batches.append(batch)
    return batches


def _pread_into(fd: int, bufs: list[memoryview], offset: int, path: Path) -> None:
    """Fill `bufs` from the file's bytes at `offset` on, in order (preadv, again after a short read)."""
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise ValueError(f"{path}: the file ends before the tensors its header lists")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


class ChunkedReader:
    """GPU parameters (or any, for tests): `readers` threads each take a whole file at a time, plan
    it and read it in chunks into staging buffers (pinned on a GPU); the loading thread copies each
    chunk to the tensors it covers (asynchronously on a GPU, on a stream of their own) and hands the
    buffer back with the copies' event, which a reader waits for before reading into that buffer
    again. One sequential stream leaves a fast NVMe disk idle between requests: several files read
    at once keep more requests in its queue (cold_start.py measures both against `dd`)."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, buffers: int | None = None,
                 readers: int | None = None):
        cuda = device.type == "cuda"
        self.device, self.chunk_bytes, self.readers = device, chunk_bytes, max(1, readers or READERS)
        self.stream = torch.cuda.Stream(device) if cuda else None
        if cuda:
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the parameters were allocated there
        # one being read per reader, one being copied to the GPU, one spare for a reader's lead
        buffers = buffers or self.readers + STAGING_BUFFERS - 1
        self.staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(buffers)]

    def load(self, files: list[Path], placer: WeightPlacer) -> int:
        free: queue.Queue = queue.Queue()  # (buffer index, the event of its last copies) to read into
        for k in range(len(self.staging)):
            free.put((k, None))
        # ("file", path, jobs) | ("chunk", path, k, pos, n) | ("end", path) | ("done",) | ("error", e)
        filled: queue.Queue = queue.Queue()
        todo: queue.Queue = queue.Queue()
        for path in files:
            todo.put(path)
        stop, lock = threading.Event(), threading.Lock()
        left = [min(self.readers, len(files))]  # readers still reading; the last one says "done"
        if not left[0]:
            filled.put(("done",))
        threads = [threading.Thread(target=self._read_files, args=(todo, placer, free, filled, stop, lock, left),
                                    name=f"pdserve-weights-{i}", daemon=True) for i in range(left[0])]
        for t in threads:
            t.start()
        try:
            total = self._copy_chunks(placer, free, filled)
        finally:
            stop.set()
            for _ in range(len(self.staging) + len(threads)):
                free.put((None, None))  # wakes the readers waiting for a buffer, to see `stop`
            for t in threads:
                t.join(READ_STALL_S)
            if self.stream is not None:
                self.stream.synchronize()  # (also on failure: no copy may still read a buffer freed below)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.staging = []
        return total

    def _read_files(self, todo: queue.Queue, placer: WeightPlacer, free: queue.Queue, filled: queue.Queue,
                    stop: threading.Event, lock: threading.Lock, left: list[int]) -> None:
        try:
            while not stop.is_set():
                try:
                    path = todo.get_nowait()
                except queue.Empty:
                    break
                with lock:  # the placer is not shared between threads otherwise
                    jobs = _plan(path, placer)
                filled.put(("file", path, jobs))
                with _open(path) as f:
                    for first, last in _runs(jobs):
                        pos, end = jobs[first][0].start, jobs[last - 1][0].end
                        f.seek(pos)
                        while pos < end:
                            k, copied = free.get()
                            if k is None or stop.is_set():
                                return
                            if copied is not None:
                                copied.synchronize()  # its copies are done: it may be overwritten
                            n = min(self.chunk_bytes, end - pos)
                            _read_into(f, memoryview(self.staging[k].numpy())[:n], path)
                            filled.put(("chunk", path, k, pos, n))
                            pos += n
                filled.put(("end", path))
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    filled.put(("done",))
        except BaseException as e:  # raised again on the loading thread
            filled.put(("error", e))

    def _copy_chunks(self, placer: WeightPlacer, free: queue.Queue, filled: queue.Queue) -> int:
        """Each file's chunks arrive in order (one reader reads a file); files interleave."""
        total, files = 0, {}  # path -> [jobs, the first job not finished, {job: its bytes gathered on the host}]
        while True:
            try:
                item = filled.get(timeout=READ_STALL_S)
            except queue.Empty:
                raise RuntimeError(f"reading {', '.join(map(str, files)) or 'the checkpoint'} stalled: nothing read "
                                   f"in {READ_STALL_S:.0f} s") from None
            kind = item[0]
            if kind == "error":
                raise item[1]
            if kind == "done":
                return total
            if kind == "file":
                files[item[1]] = [item[2], 0, {}]
            elif kind == "chunk":
                _, path, k, pos, n = item
                state = files[path]
                state[1] = self._scatter(state[0], state[1], pos, self.staging[k][:n], state[2], placer)
                free.put((k, self.stream.record_event() if self.stream is not None else None))
                total += n
            else:  # "end": what no chunk of the file reached holds no bytes
                jobs, j, _ = files.pop(item[1])
                for entry, target in jobs[j:]:
                    assert entry.nbytes == 0, f"{item[1]}: {entry.name} was not read"
                    placer.done(target)

    def _scatter(self, jobs: list[tuple[TensorEntry, Placement]], j: int, pos: int, chunk: torch.Tensor,
                 pending: dict[int, torch.Tensor], placer: WeightPlacer) -> int:
        """Copy the chunk (the file's bytes [pos, pos + len)) to the tensors it covers, from job j
        on; returns the first job it did not finish."""
        end = pos + chunk.numel()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            while j < len(jobs) and jobs[j][0].start < end:
                entry, target = jobs[j]
                a, b = max(entry.start, pos), min(entry.end, end)
                if b > a:
                    if _verbatim(entry, target):
                        _bytes_of(target.dst)[a - entry.start:b - entry.start].copy_(chunk[a - pos:b - pos],
                                                                                      non_blocking=True)
                    else:  # gathered on the host, converted by torch once whole
                        raw = pending.setdefault(j, torch.empty(entry.nbytes, dtype=torch.uint8))
                        raw[a - entry.start:b - entry.start].copy_(chunk[a - pos:b - pos])
                if entry.end > end:
                    break  # it goes on in the next chunk
                if j in pending:
                    target.copy(_host_tensor(entry, pending.pop(j)))
                placer.done(target)
                j += 1
        return j


def _runs(jobs: list[tuple[TensorEntry, Placement]]) -> list[tuple[int, int]]:
    """Job index ranges [first, last) whose bytes are read as one sequential run: neighbours closer
    than GAP_BYTES join (a short skip costs more as a seek than as a read)."""
    runs: list[tuple[int, int]] = []
    for i, (entry, _) in enumerate(jobs):
        if runs and entry.start - jobs[runs[-1][1] - 1][0].end < GAP_BYTES:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
