"""Releasing a mapped file's pages from the process: whole pages only, the data still readable."""

import numpy as np

from scratchllm.formats.mapped import map_file, release_pages, release_range


def _rss_file_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_released_pages_leave_the_process_and_read_back_the_same(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)  # 32 MiB
    path = tmp_path / "blob.bin"
    data.tofile(path)
    mapped = map_file(path)
    checksum = int(mapped.sum(dtype=np.uint64))  # every page read: resident
    touched = _rss_file_kib()
    view = mapped[12345 : 12345 + (16 << 20)]  # 16 MiB, not page-aligned at either end
    release_range(view)
    assert _rss_file_kib() < touched - 15 * 1024  # about 16 MiB left the process
    assert int(mapped.sum(dtype=np.uint64)) == checksum  # faults back in, unchanged
    release_pages(mapped)
    assert _rss_file_kib() < touched - 31 * 1024
    assert np.array_equal(mapped[:4096], data[:4096])
    release_range(mapped[10:20])  # inside one page: nothing whole to release, no error
