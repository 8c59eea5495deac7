"""The sources' fingerprint (``fusion_backend.sources``): what tells the persistent caches that the code changed."""

import os

from fusion_backend import sources


def test_the_fingerprint_lists_every_source_file_and_skips_bytecode_and_other_files(tmp_path):
    (tmp_path / "kernels" / "__pycache__").mkdir(parents=True)
    (tmp_path / "ops.py").write_text("A = 1\n")
    (tmp_path / "kernels" / "conv.py").write_text("B = 2\n")
    (tmp_path / "kernels" / "__pycache__" / "conv.cpython-312.py").write_text("")
    (tmp_path / "notes.txt").write_text("not a source")
    stats = sources.source_stats(tmp_path)
    assert [(path, size) for path, size, _ in stats] == [("kernels/conv.py", 6), ("ops.py", 6)]


def test_an_edit_of_the_same_size_a_new_file_and_a_moved_file_each_change_the_fingerprint(tmp_path):
    (tmp_path / "kernels").mkdir()
    kernel = tmp_path / "kernels" / "conv.py"
    kernel.write_text("B = 2\n")
    seen = {repr(sources.source_stats(tmp_path))}

    kernel.write_text("B = 3\n")  # the same size: its modification time tells it
    stamp = kernel.stat().st_mtime_ns
    os.utime(kernel, ns=(stamp, stamp + 1_000_000))
    seen.add(repr(sources.source_stats(tmp_path)))
    (tmp_path / "kernels" / "pool.py").write_text("")
    seen.add(repr(sources.source_stats(tmp_path)))
    (tmp_path / "kernels" / "pool.py").rename(tmp_path / "pool.py")
    seen.add(repr(sources.source_stats(tmp_path)))
    assert len(seen) == 4


def test_the_fingerprint_is_read_once_per_process_and_folder(tmp_path):
    (tmp_path / "ops.py").write_text("A = 1\n")
    first = sources.fingerprint(tmp_path)
    (tmp_path / "more.py").write_text("")
    assert sources.fingerprint(tmp_path) == first  # cached for the process
    sources.fingerprint.cache_clear()  # what a new process starts with
    assert sources.fingerprint(tmp_path) != first
