"""A worker's link to a router, written from two threads: the channel's loop (answers, beats) and
the engine loop's (each step's deltas, `write_now`).

Handed to the channel's thread, a step's tokens waited for that thread to be woken and to get the
interpreter, which the engine's thread holds while it prepares the next step: up to the switch
interval (pdserve/priority.py). Written by the engine's thread itself they leave at once (the
development CPU, a lone 128-token prompt's hop trace: the worker's send to the router's read
0.52-0.59 ms before, 0.26 ms after). One lock orders the two writers, and the sealing of a TCP
connection's frames with them. A frame the socket does not take whole at once (its buffer full: a
router that reads slowly) goes to the loop, and so does every frame after it, from either thread,
until the loop has written it: the stream keeps the frames' order."""

import asyncio
import os
import threading

from pdserve.channel.wire import Link


class ThreadLink(Link):
    def __init__(self, writer: asyncio.StreamWriter, keys: tuple[bytes, bytes] | None,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(writer, keys)
        self._loop = loop
        self._lock = threading.Lock()
        self._behind = 0  # frames handed to the loop by the engine's thread, not yet written
        # A descriptor of our own for the socket: the transport may close its own at any turn of the
        # loop (the peer gone), and the number could then name another connection by our write.
        self._fd = os.dup(writer.transport.get_extra_info("socket").fileno())
        self._closed = False

    def write(self, body: bytes) -> None:
        """The channel loop's frames (its thread only)."""
        with self._lock:
            data = self.framed(body)
            if self._behind:  # after the engine's frames the loop has still to write
                self._behind += 1
                self._loop.call_soon(self._write_later, data)
            else:
                self.writer.write(data)

    def write_now(self, body: bytes) -> None:
        """A frame from another thread than the loop's: on the socket now where nothing waits to go
        before it and the socket takes it whole; else the loop writes it, in order."""
        with self._lock:
            if self._closed or self.writer.is_closing():
                return
            data = self.framed(body)
            if not self._behind and not self.writer.transport.get_write_buffer_size():
                try:
                    n = os.write(self._fd, data)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError:  # the connection broke: its reader on the loop sees that and ends it
                    return
                if n == len(data):
                    return
                data = data[n:]
            self._behind += 1
            self._loop.call_soon_threadsafe(self._write_later, data)

    def _write_later(self, data: bytes) -> None:
        with self._lock:
            self._behind -= 1
            if not self.writer.is_closing():
                self.writer.write(data)

    def close(self) -> None:
        """The connection is over (its reader's end): our descriptor goes; nothing is written after."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
