"""`pdserve up`'s checkpoint prefetch (control/prefetch.py): which files it reads, that it reads
every byte of them, that it stops when told, and that it never reads for a preset or dummy weights."""

import time

from pdserve.cli import main as cli
from pdserve.control import prefetch
from pdserve.control.prefetch import Prefetch, checkpoint_files, plan, start_prefetch


def _files(tmp_path, sizes):
    out = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"model-{i}.safetensors"
        path.write_bytes(bytes([i]) * size)
        out.append(path)
    return out


def _wait(p: Prefetch, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not p.done():
        assert time.monotonic() < end, "the prefetch did not end"
        time.sleep(0.01)


def test_plan_takes_files_in_order_while_they_fit(tmp_path):
    files = _files(tmp_path, [100, 200, 300])
    assert plan(files, 10_000) == files
    assert plan(files, 300) == files[:2]
    assert plan(files, 299) == files[:1]  # in order: a later small file does not jump the queue
    assert plan(files, 99) == []


def test_reads_every_byte_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK", 1000)
    files = _files(tmp_path, [12_345, 1, 0, 70_000, 5_000, 3])
    lines = []
    p = Prefetch(files, lines.append)
    _wait(p)
    assert p.bytes == sum(f.stat().st_size for f in files)
    assert len(lines) == 1 and lines[0].startswith("checkpoint prefetch done: 0.00 GB"), lines


def test_stops_when_told(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK", 1)  # a byte a read: far from done when stopped
    files = _files(tmp_path, [2_000_000] * 4)
    lines = []
    p = Prefetch(files, lines.append)
    p.stop()
    _wait(p)
    assert p.bytes < sum(f.stat().st_size for f in files)
    assert len(lines) == 1 and lines[0].startswith("checkpoint prefetch stopped"), lines


def test_start_reads_what_half_the_memory_holds_and_nothing_for_presets(tmp_path):
    ck = tmp_path / "tiny-moe"
    assert cli(["write-checkpoint", "tiny-moe", str(ck), "--dtype", "float32", "--shard-size", "5MB"]) == 0
    files = checkpoint_files(str(ck), "auto")
    assert len(files) >= 3
    sizes = [f.stat().st_size for f in files]
    lines = []
    p = start_prefetch(files, lines.append, memory=2 * (sizes[0] + sizes[1]))  # half of it: the first two
    _wait(p)
    assert p.files == files[:2] and p.bytes == sizes[0] + sizes[1]
    assert f"2 of {len(files)} files" in lines[0] and "model.prefetch: false" in lines[0], lines
    assert start_prefetch(files, lines.append, memory=sizes[0]) is None  # not even the first fits
    assert checkpoint_files(str(ck), "dummy") == []  # dummy weights read no file
    assert checkpoint_files("tiny-moe", "auto") == []  # a preset has none
