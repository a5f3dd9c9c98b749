"""The safetensors file format, read and written without the library's whole-file calls.

A file is an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
data_offsets [begin, end) relative to the data, plus "__metadata__"), then the data: every tensor's
bytes, row-major, little-endian, one after another. Knowing the layout lets the loader read a file
with few large sequential reads straight into the model's parameters, and lets the checkpoint writer
put a header down before it has drawn the tensors it describes.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the library refuses larger headers too: a corrupt length, not a real one
ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as the library writes it


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: where its bytes lie (absolute file offsets [start, end))."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of a .safetensors file, in the order of their bytes in it."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    size, base = path.stat().st_size, 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}; pdserve reads "
                             f"{', '.join(DTYPES)}")
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        expected = dtype.itemsize * _numel(shape)
        if end - begin != expected or base + end > size:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) claims bytes "
                             f"[{begin}, {end}) of the data; it needs {expected}, and the file has {size - base}")
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    entries.sort(key=lambda e: e.start)
    return entries


def header_bytes(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> bytes:
    """The length and JSON header of a file holding `tensors` (name, dtype, shape), whose bytes then
    follow in this order without gaps."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        n = dtype.itemsize * _numel(shape)
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
