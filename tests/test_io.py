"""tasks/_io.atomic_write: complete or absent, never partial; shared files are 0644."""
from __future__ import annotations

import stat

import pytest

from tasks._io import atomic_write, atomic_write_text


def test_atomic_write_replaces_whole_file_with_mode_0644(tmp_path):
    p = atomic_write_text(tmp_path / "sub" / "a.txt", "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two" and stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.txt"]  # no temporary file left behind


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = atomic_write_text(tmp_path / "a.txt", "old")

    def half(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, half)
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["a.txt"]
