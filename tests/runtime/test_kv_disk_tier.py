"""The KV cache's disk tier (L3): files that survive restarts, checked on read, shared by processes.

Real files in tmp_path throughout. Faults are made for real where a test can (truncated, flipped,
foreign and misnamed files; a folder under a regular file) and patched where it cannot (a full disk).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moeforge.runtime.kv_tiers import disk_tier
from moeforge.runtime.kv_tiers.disk_tier import DiskTier

HEADER = 80  # magic 8 + namespace hash 16 + key 16 + length 8 + digest 32
NS = "0123abcd-rank0"


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = 1000) -> bytes:
    return random.Random(i).randbytes(size)


def block_file(tier: DiskTier, k: bytes) -> Path:
    return tier.root / k.hex()[:2] / f"{k.hex()}.kvblock"


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_round_trip_and_stats(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    assert tier.usable
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert tier.put(key(1), payload(1))
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert tier.get(key(1)) == payload(1)
    assert block_file(tier, key(1)).stat().st_size == HEADER + 1000
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.writes) == (1, 1, 1)
    assert stats.write_bytes == stats.read_bytes == stats.bytes == HEADER + 1000
    assert stats.files == 1 and stats.write_errors == stats.rejected == stats.evictions == 0
    # Storing the same key again keeps the one file (same key, same content).
    assert tier.put(key(1), payload(1))
    assert files_under(tmp_path) == [block_file(tier, key(1))]


def test_restart_finds_blocks(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20, NS).put(key(1), payload(1, 5000))
    tier = DiskTier(tmp_path, 1 << 20, NS)
    stats = tier.stats()
    assert (stats.files, stats.bytes) == (1, HEADER + 5000)
    assert tier.get(key(1)) == payload(1, 5000)


def _truncate(tier: DiskTier, path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip_payload_byte(tier: DiskTier, path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER + 500] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign(tier: DiskTier, path: Path) -> None:
    other = DiskTier(tier.root.parent, 1 << 20, "other-artifact")
    assert other.put(key(1), payload(1))
    path.write_bytes(block_file(other, key(1)).read_bytes())


def _wrong_key(tier: DiskTier, path: Path) -> None:
    assert tier.put(key(2), payload(2))
    os.replace(block_file(tier, key(2)), path)


@pytest.mark.parametrize("damage", [_truncate, _flip_payload_byte, _foreign, _wrong_key])
def test_bad_file_is_rejected_and_removed(tmp_path: Path, damage: Callable[[DiskTier, Path], None]) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    assert tier.put(key(1), payload(1))
    path = block_file(tier, key(1))
    damage(tier, path)
    assert tier.contains(key(1))
    assert tier.get(key(1)) is None
    assert not path.exists()
    stats = tier.stats()
    assert stats.rejected == 1 and stats.hits == 0
    # It is stored again afterwards, and read back whole.
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)


def test_scan_rejects_short_and_misnamed_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    assert tier.put(key(1), payload(1))
    short = block_file(tier, key(3))
    short.parent.mkdir(exist_ok=True)
    short.write_bytes(b"MFKVBLK1")  # shorter than a header
    misnamed = tier.root / "zz" / "not-a-key.kvblock"
    misnamed.parent.mkdir()
    misnamed.write_bytes(b"x" * 200)  # not in a key folder: left alone
    wrong_folder = tier.root / ("00" if key(4).hex()[:2] != "00" else "01") / f"{key(4).hex()}.kvblock"
    wrong_folder.parent.mkdir(exist_ok=True)
    wrong_folder.write_bytes(b"x" * 200)
    restarted = DiskTier(tmp_path, 1 << 20, NS)
    stats = restarted.stats()
    assert (stats.files, stats.rejected) == (1, 2)
    assert not short.exists() and not wrong_folder.exists() and misnamed.exists()
    assert restarted.get(key(1)) == payload(1)


def test_namespaces_are_separate(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    assert tier.put(key(1), payload(1))
    other = DiskTier(tmp_path, 1 << 20, "0123abcd-rank1")
    assert other.stats().files == 0
    assert not other.contains(key(1)) and other.get(key(1)) is None
    assert other.stats().misses == 1
    assert tier.get(key(1)) == payload(1)  # untouched by the other namespace


def _lru_tier(tmp_path: Path) -> DiskTier:
    size = HEADER + 1000
    tier = DiskTier(tmp_path, 3 * size + size // 2, NS)  # room for 3 files
    for i in range(3):
        assert tier.put(key(i), payload(i))
        os.utime(block_file(tier, key(i)), (1_000_000 + i, 1_000_000 + i))  # key(0) is the oldest
    return tier


def test_lru_evicts_oldest_mtime(tmp_path: Path) -> None:
    tier = _lru_tier(tmp_path)
    assert tier.put(key(3), payload(3))
    assert not block_file(tier, key(0)).exists()
    assert all(block_file(tier, key(i)).exists() for i in (1, 2, 3))
    stats = tier.stats()
    assert (stats.evictions, stats.files, stats.bytes) == (1, 3, 3 * (HEADER + 1000))


def test_lru_get_refreshes_block(tmp_path: Path) -> None:
    tier = _lru_tier(tmp_path)
    assert tier.get(key(0)) == payload(0)  # now the youngest
    assert tier.put(key(3), payload(3))
    assert tier.get(key(0)) == payload(0)
    assert not block_file(tier, key(1)).exists()
    assert tier.stats().evictions == 1


def test_payload_over_capacity_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4096, NS)
    assert not tier.put(key(1), payload(1, 4096 - HEADER + 1))
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert stats.writes == stats.write_errors == 0
    assert tier.put(key(2), payload(2, 4096 - HEADER))  # exactly the capacity fits


def _fail_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", enospc)


def _fail_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def full_disk_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        file = real_open(path, mode, *args, **kwargs)
        if "w" in mode:  # part of the file got out before the disk filled up
            file.write(b"MFKVBLK1")
            file.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return file

    monkeypatch.setattr(disk_tier, "open", full_disk_open, raising=False)


@pytest.mark.parametrize("fail", [_fail_replace, _fail_write])
def test_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                   fail: Callable[[pytest.MonkeyPatch], None]) -> None:
    tier = DiskTier(tmp_path, 1 << 20, NS)
    fail(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        assert not tier.put(key(1), payload(1))
        assert files_under(tmp_path) == []  # neither the temporary file nor a final one
        assert tier.stats().write_errors == 1 and tier.stats().writes == 0
        for i in range(100):
            assert not tier.put(key(100 + i), payload(i))
    assert tier.stats().write_errors == 101
    assert len([r for r in caplog.records if "cannot store" in r.getMessage()]) == 2  # the 1st and 101st
    assert files_under(tmp_path) == []
    assert tier.get(key(1)) is None
    monkeypatch.undo()
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
    assert tier.stats().write_errors == 101


def test_unwritable_directory_turns_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        tier = DiskTier(blocker / "cache", 1 << 20, NS)
    assert not tier.usable
    assert any(str(blocker) in r.getMessage() for r in caplog.records)
    assert not tier.put(key(1), payload(1))
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.stats().write_errors == 0


def test_bad_arguments(tmp_path: Path) -> None:
    for namespace in ("", "a/b", "..", "name space"):
        with pytest.raises(ValueError, match="namespace"):
            DiskTier(tmp_path, 1 << 20, namespace)
    with pytest.raises(ValueError, match="--kv-disk-bytes"):
        DiskTier(tmp_path, 0, NS)
    tier = DiskTier(tmp_path, 1 << 20, NS)
    with pytest.raises(ValueError):
        tier.put(b"short", b"x")
    with pytest.raises(ValueError):
        tier.get(bytes(17))


def test_stale_tmp_removed_at_startup(tmp_path: Path) -> None:
    folder = tmp_path / NS / "ab"
    folder.mkdir(parents=True)
    stale, fresh = folder / "x.kvblock.1.2.3.tmp", folder / "y.kvblock.1.2.4.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    old = time.time() - 120
    os.utime(stale, (old, old))
    tier = DiskTier(tmp_path, 1 << 20, NS)
    assert not stale.exists() and fresh.exists()  # a writer may still be at work on the fresh one
    assert tier.stats().files == 0


# -- several processes --------------------------------------------------------------------------------

SHARED, OWN = 30, 30


def _expected(i: int) -> bytes:
    return payload(i, 10_000 + (i * 7919) % 30_000)


# A writer process: runs from moeforge alone (the tests folder is not importable in a child: pytest's importlib mode).
# It stores the shared keys (the same content as the other writer's) and keys of its own, starting when GO exists.
_WRITER = """
import hashlib, os, random, sys, time
from moeforge.runtime.kv_tiers.disk_tier import DiskTier
directory, namespace, worker, shared, own, go = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), sys.argv[6]
def key(i): return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()  # as key() and _expected()
def expected(i): return random.Random(i).randbytes(10_000 + (i * 7919) % 30_000)
tier = DiskTier(directory, 1 << 30, namespace)
while not os.path.exists(go):
    time.sleep(0.001)
ids = list(range(shared)) + [1000 * (worker + 1) + i for i in range(own)]
assert all(tier.put(key(i), expected(i)) for i in ids)
stats = tier.stats()
assert stats.write_errors == stats.rejected == 0, stats
"""


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    ids = list(range(SHARED)) + [1000 * (w + 1) + i for w in range(2) for i in range(OWN)]
    directory = tmp_path / "kv"
    reader = DiskTier(directory, 1 << 30, NS)
    go = tmp_path / "go"
    workers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), NS, str(w), str(SHARED), str(OWN),
                                 str(go)], stderr=subprocess.PIPE, text=True) for w in range(2)]
    go.write_text("")  # start together, so both write the shared keys at the same time
    try:
        while any(process.poll() is None for process in workers):
            for i in ids:
                got = reader.get(key(i))
                if got is not None:
                    assert got == _expected(i)  # never a wrong or torn payload
    finally:
        for process in workers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    assert [process.returncode for process in workers] == [0, 0], [p.stderr.read() for p in workers if p.stderr]
    for i in ids:
        assert reader.get(key(i)) == _expected(i)
    assert reader.stats().rejected == 0
    assert list(directory.rglob("*.tmp")) == []
    assert len(files_under(directory)) == len(ids)
