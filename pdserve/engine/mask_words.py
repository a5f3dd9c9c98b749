"""Where a step's packed grammar masks reach the device: two buffers, used by turns.

The fill thread (grammar.py) copies a step's masks [rows, ceil(vocab / 32)] int32 from the host on a
stream of its own while the forward runs on the engine's stream: a 256-row mask over a 152k vocabulary
is ~5 MB, ~0.2–0.4 ms that the forward's stream would otherwise spend before the step's sampling. The
engine's stream waits for the copy (`ready_on`) only where it applies the masks. A buffer is written
again two steps later, once the engine's stream has passed the masks that read it (`used`): by then
the copy stream waits on nothing in practice, but the order is the streams', not luck's."""

import torch


class WordSlot:
    """One device buffer of masks, its last copy, and where the engine's stream last read it."""

    def __init__(self, width: int):
        self.width = width  # int32 words per row
        self.rows = 0  # the step's
        self.buf: torch.Tensor | None = None  # [rows, width] on the device
        self.stream: torch.cuda.Stream | None = None  # the copy stream (shared by both slots)
        self.view: torch.Tensor | None = None  # the step's rows: the device buffer's, or the host's on a CPU
        self.ready: torch.cuda.Event | None = None  # the copy done
        self.free: torch.cuda.Event | None = None  # the engine's stream done reading the buffer

    def fit(self, rows: int, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        """On the engine's thread: room for `rows` rows on `device`."""
        self.stream, self.rows = stream, rows
        if device.type != "cuda" or (self.buf is not None and self.buf.shape[0] >= rows):
            return
        self.buf = torch.empty(max(rows, 2 * (0 if self.buf is None else self.buf.shape[0])), self.width,
                               dtype=torch.int32, device=device)
        # A fresh buffer may sit where the allocator kept a freed one that work queued on the engine's
        # stream still reads: the copy waits for that work.
        self.free = torch.cuda.Event()
        self.free.record(torch.cuda.current_stream(device))

    def load(self, host: torch.Tensor) -> None:
        """On the fill thread: the filled host rows to the device; returns once they are read."""
        if self.buf is None:
            # A CPU step: its own copy, as a device's buffer would be. The step may be sampled after
            # the next step's fill has overwritten the host buffer (overlapped, when no row of the
            # next step reads this one's tokens, this one is sampled only when the engine reads it).
            self.view = host.clone()
            return
        torch.cuda.set_device(self.buf.device)  # (a thread starts on device 0)
        # (The buffer was made in the engine's inference mode: only there may it be written.)
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            if self.free is not None:
                self.stream.wait_event(self.free)
            self.view = self.buf[: self.rows]
            self.view.copy_(host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)
        self.ready.synchronize()

    def ready_on(self, device: torch.device) -> torch.Tensor:
        """On the engine's thread: the rows, the engine's stream ordered after their copy."""
        if self.ready is not None:
            torch.cuda.current_stream(device).wait_event(self.ready)
        return self.view

    def used(self) -> None:
        """On the engine's thread, after queueing the ops that read the rows."""
        if self.buf is not None:
            self.free = torch.cuda.Event()
            self.free.record(torch.cuda.current_stream(self.buf.device))


class WordSlots:
    """The two slots, handed out by turns (a step's fill may run while the step before is sampled)."""

    def __init__(self, width: int):
        self._slots = [WordSlot(width), WordSlot(width)]
        self._next = 0
        self._stream: torch.cuda.Stream | None = None

    def take(self, rows: int, device: torch.device) -> WordSlot:
        if device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        slot = self._slots[self._next]
        self._next ^= 1
        slot.fit(rows, device, self._stream)
        return slot
