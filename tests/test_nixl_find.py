"""Which NIXL build loads (kvtransfer/backends/nixl_find.py): the meta package first, then the build
of torch's CUDA, read from torch's package metadata without importing it."""

import pytest

from pdserve.kvtransfer.backends.nixl_find import cuda_major_of, search_order


@pytest.mark.parametrize("version,requires,major", [
    ("2.11.0+cu130", [], 13),
    ("2.9.1+cu128", ["nvidia-cuda-runtime-cu12==12.8.90; platform_system == 'Linux'"], 12),
    ("2.13.0+cpu", ["nvidia-cuda-runtime-cu12==12.8.90"], None),
    ("2.8.0", ["filelock", "nvidia-cuda-runtime-cu12==12.8.90; platform_system == 'Linux'"], 12),
    ("2.10.0", ["nvidia-cuda-runtime==13.0.96; platform_system == 'Linux'"], 13),
    ("2.13.0", ["filelock"], None),
])
def test_torchs_cuda_from_its_metadata(version, requires, major):
    assert cuda_major_of(version, requires) == major


def test_the_build_of_torchs_cuda_comes_after_the_meta_package_only():
    assert search_order(13) == ("nixl", "nixl_cu13", "nixl_cu12")
    assert search_order(12) == ("nixl", "nixl_cu12", "nixl_cu13")
    assert search_order(None) == ("nixl", "nixl_cu12", "nixl_cu13")  # a CPU host: CUDA 12's UCX moves CPU memory too
