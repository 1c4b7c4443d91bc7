"""The one rule for paths moeforge writes or deletes (core/safe_paths)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moeforge.core.safe_paths import (
    OWNED_MARKER,
    UnsafePathError,
    check_output_file,
    create_owned_dir,
    is_owned_dir,
    refuse_symlinked,
    remove_owned_dir,
    write_output_file,
)


def test_existing_file_needs_force_and_is_replaced_atomically(tmp_path: Path) -> None:
    target = tmp_path / "stats.json"
    target.write_text("user's\n")
    with pytest.raises(UnsafePathError, match="exists: pass --force"):
        check_output_file(target, flag="--expert-load-out")
    with pytest.raises(UnsafePathError, match="exists: pass --force"):
        write_output_file(target, "new")
    assert target.read_text() == "user's\n"
    write_output_file(target, "new", force=True)
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]  # no temporary left


def test_links_devices_and_directories_are_never_written(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(outside)
    for path, kind in [(link, "symbolic link"), (tmp_path, "directory"), (Path("/dev/null"), "/dev")]:
        with pytest.raises(UnsafePathError, match=kind):
            write_output_file(path, "x", force=True)
    assert outside.read_text() == "keep" and link.is_symlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match="a FIFO"):
        check_output_file(fifo, force=True)
    with pytest.raises(UnsafePathError, match="/proc"):
        check_output_file("/proc/self/fd/1", force=True)


def test_missing_or_readonly_folder_is_refused_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsafePathError, match="does not exist"):
        check_output_file(tmp_path / "no" / "x.json")
    real_open = os.open

    def read_only_mount(path: object, flags: int, *args: object) -> int:
        if flags & os.O_CREAT:  # as a read-only mount answers root, whom mode bits do not stop
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only_mount)
    with pytest.raises(UnsafePathError, match=r"does not take a new file \(Read-only file system"):
        check_output_file(tmp_path / "x.json")


def test_owned_dirs_are_the_only_ones_removed(tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("x")
    link = tmp_path / ".out.moeforge-partial"
    link.symlink_to(users)
    assert not is_owned_dir(link) and not remove_owned_dir(link)
    assert not remove_owned_dir(users)
    with pytest.raises(UnsafePathError, match="already exists"):
        create_owned_dir(link)
    assert (users / "thesis.tex").read_text() == "x"
    (users / OWNED_MARKER).write_text("x")  # a marker behind a link still does not make the link owned
    assert not is_owned_dir(link)
    owned = create_owned_dir(tmp_path / "deep" / "owned")
    inner_link = owned / "rank0"
    inner_link.symlink_to(users)
    assert is_owned_dir(owned) and remove_owned_dir(owned)
    assert not owned.exists() and (users / "thesis.tex").read_text() == "x"


def test_symlinked_folders_inside_an_owned_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ns"
    (root / "ab").mkdir(parents=True)
    (root / "cd").symlink_to(tmp_path)
    assert refuse_symlinked(root / "ab" / "x.blk", root=root, what="KV block") == root / "ab" / "x.blk"
    with pytest.raises(UnsafePathError, match="symbolic link inside"):
        refuse_symlinked(root / "cd" / "x.blk", root=root, what="KV block")
    with pytest.raises(UnsafePathError, match="outside"):
        refuse_symlinked(tmp_path / "x", root=root, what="KV block")
