"""The cuda_ipc backend's block-copy kernel moves exactly the blocks asked for, in every layer asked
for (K and V planes, or MLA's one latent plane), and nothing else. On CPU it runs under Triton's interpreter (a subprocess: the interpreter is
chosen when the kernel is defined); tests/test_kvtransfer_gpu.py runs it between two GPUs."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r"""
import torch
from pdserve.kvtransfer.backends.block_copy import copy_blocks

g = torch.Generator().manual_seed(0)
for dtype, shape in [(torch.bfloat16, (4, 2, 12, 4, 2, 8)), (torch.float32, (3, 2, 9, 2, 3, 4)),
                     (torch.float16, (2, 2, 5, 1, 1, 3)),  # 8-, 4- and 2-byte words
                     (torch.bfloat16, (3, 1, 10, 4, 1, 20))]:  # an MLA latent cache: one plane
    layers, _, nblocks = shape[:3]
    for first, count in [(0, layers), (1, 1), (layers - 1, 1)]:
        src = torch.randn(shape, generator=g).to(dtype)
        dst = torch.randn((layers, shape[1], nblocks + 3, *shape[3:]), generator=g).to(dtype)
        want = dst.clone()
        n = int(torch.randint(1, nblocks, (1,), generator=g))
        s = torch.randperm(nblocks, generator=g)[:n]
        d = torch.randperm(nblocks + 3, generator=g)[:n]
        copy_blocks(src, dst, first, count, s.to(torch.int32), d.to(torch.int32))
        want[first:first + count, :, d] = src[first:first + count, :, s]
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), (dtype, shape, first, count)
print("ok")
"""


def test_copy_blocks_matches_indexing():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
