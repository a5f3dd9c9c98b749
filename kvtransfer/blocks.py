"""Block-id bookkeeping shared by the backends: a request's source and destination block ids as
runs of consecutive ids on both sides, each run one contiguous region per (layer, plane) and so
one transfer descriptor."""


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce block pairs into (src_start, dst_start, length) runs, consecutive on both sides."""
    assert len(src) == len(dst)
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
