"""The KV disk tier (L3) against a hostile or careless co-tenant of its folder (issue 48): links planted inside its
namespace, entries it did not make, forged block files, and fuzzed files. Real files in tmp_path, tiny payloads, no
model: the tier's classes directly.

Each test names the defect it pins: 1 a symlinked subfolder, 2 a symlinked block file, 3 stray entries turning the
tier off, 4 forged blocks loaded (the header proved integrity, not origin).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeforge.runtime.backends.base import BlockLayout, PoolShape
from moeforge.runtime.kv_tiers import disk_key, disk_tier
from moeforge.runtime.kv_tiers.disk_tier import DiskTier
from moeforge.runtime.kv_tiers.tiers import KVTiers, TierSettings

HEADER = 80
FIELDS = struct.Struct("<8s16s16sQ")  # magic, namespace hash, key, payload length (then a 32-byte MAC)
NS = "0123abcd-rank0"
SIZE = 1000


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = SIZE) -> bytes:
    return random.Random(i).randbytes(size)


def block_file(tier: DiskTier, k: bytes) -> Path:
    return tier.root / k.hex()[:2] / f"{k.hex()}.kvblock"


def forged(k: bytes, data: bytes, *, magic: bytes = b"MFKVBLK2", secret: bytes = b"an attacker's guess" * 2,
           namespace: str = NS) -> bytes:
    """A block file with a self-consistent header: right magic, namespace, key and length, and a MAC under a secret
    that is not the servers'."""
    fields = FIELDS.pack(magic, hashlib.blake2b(namespace.encode(), digest_size=16).digest(), k, len(data))
    return fields + hmac.new(secret, fields + data, hashlib.sha256).digest() + data


def forged_unkeyed(k: bytes, data: bytes, *, namespace: str = NS) -> bytes:
    """What issue 48's attacker wrote: the first format's header, whose blake2b digest anyone can compute."""
    header = struct.pack("<8s16s16sQ32s", b"MFKVBLK1", hashlib.blake2b(namespace.encode(), digest_size=16).digest(),
                         k, len(data), hashlib.blake2b(data, digest_size=32).digest())
    return header + data


Forge = Callable[[bytes, bytes], bytes]
Setup = Callable[[Path, Path, pytest.MonkeyPatch], str]


@pytest.fixture(autouse=True)
def _key_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default key file under tmp_path/cache (never the user's home), outside the KV folder tmp_path/kv."""
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOEFORGE_KV_DISK_KEY", raising=False)


@pytest.fixture
def kv(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- 1: a symlinked subfolder -------------------------------------------------------------------------------------

def test_a_symlinked_subfolder_is_never_written_through(kv: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(kv, 1 << 20, NS)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tier.root / key(1).hex()[:2])
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        assert tier.put(key(1), payload(1))
        assert tier.put(key(1), payload(1))
    assert list(outside.iterdir()) == []  # nothing written where the link points
    assert not block_file(tier, key(1)).parent.is_symlink() and block_file(tier, key(1)).is_file()
    assert tier.get(key(1)) == payload(1)
    assert len([m for m in warnings_of(caplog) if "symbolic link" in m]) == 1


def test_a_symlinked_subfolder_is_never_read_counted_or_evicted(kv: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # Blocks valid for this namespace and key, but in a folder outside it that a link points to.
    source = DiskTier(tmp_path / "elsewhere", 1 << 20, NS)
    assert source.put(key(1), payload(1))
    outside = block_file(source, key(1)).parent
    tier = DiskTier(kv, 3 * (HEADER + SIZE), NS)
    os.symlink(outside, tier.root / key(1).hex()[:2])
    assert tier.get(key(1)) is None  # never read through the link
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        restarted = DiskTier(kv, 3 * (HEADER + SIZE), NS)  # the scan neither counts nor follows the link
    assert restarted.stats().files == 0
    assert any("symbolic link" in m for m in warnings_of(caplog))
    assert not (restarted.root / key(1).hex()[:2]).is_symlink()  # the link (only) is gone
    for i in range(2, 12):  # evictions never reach the files the link pointed to
        assert restarted.put(key(i), payload(i))
    assert restarted.stats().evictions > 0
    assert source.get(key(1)) == payload(1)


# -- 2: a symlinked block file ------------------------------------------------------------------------------------

def test_a_symlinked_block_file_is_never_touched_or_read(kv: Path, tmp_path: Path) -> None:
    tier = DiskTier(kv, 1 << 20, NS)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * (HEADER + SIZE))  # the block's size: what the old put trusted
    os.utime(victim, (1_000_000, 1_000_000))
    path = block_file(tier, key(1))
    path.parent.mkdir()
    os.symlink(victim, path)
    assert tier.put(key(1), payload(1))  # the old put saw the size match and touched the link's target
    assert victim.stat().st_mtime == 1_000_000 and victim.read_bytes() == b"v" * (HEADER + SIZE)
    assert not path.is_symlink() and tier.get(key(1)) == payload(1)
    # A link to a valid block file elsewhere is not read either.
    copy = tmp_path / "copy"
    copy.write_bytes(path.read_bytes())
    os.utime(copy, (1_000_000, 1_000_000))
    path.unlink()
    os.symlink(copy, path)
    assert tier.get(key(1)) is None
    assert copy.stat().st_mtime == 1_000_000


# -- 3: entries moeforge did not make -----------------------------------------------------------------------------

def test_stray_entries_are_skipped_and_leave_the_tier_on(kv: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = kv / NS
    sub = {i: root / key(i).hex()[:2] for i in (1, 2, 3)}
    for folder in sub.values():
        folder.mkdir(parents=True, exist_ok=True)
    old = 1_000_000
    for stray in (root / "junk.tmp", sub[1] / "junk.kvblock.1.2.3.tmp", sub[2] / f"{key(2).hex()}.kvblock",
                  root / "zz"):
        stray.mkdir()
        os.utime(stray, (old, old))
    (root / "notes.txt").write_text("mine")
    os.mkfifo(sub[3] / f"{key(3).hex()}.kvblock")
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        tier = DiskTier(kv, 1 << 20, NS)
        assert tier.usable
        assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
        assert tier.get(key(3)) is None  # a FIFO at a block's name: a miss, and no hang
        assert not tier.put(key(2), payload(2))  # a folder at its name: not stored, not an error
        DiskTier(kv, 1 << 20, NS)  # a restart warns once more, not once per entry
    messages = warnings_of(caplog)
    assert not any("writable" in m for m in messages)
    assert len([m for m in messages if "skipping" in m]) == 2  # once per tier instance
    assert tier.stats().write_errors == 0 and tier.stats().files == 1
    for name in ("junk.tmp", "zz", "notes.txt"):
        assert (root / name).exists()  # not moeforge's: never removed


def test_only_an_unwritable_folder_says_so(kv: Path, caplog: pytest.LogCaptureFixture) -> None:
    (kv / NS).mkdir(parents=True)
    (kv / NS).chmod(0o500)
    try:
        if os.access(kv / NS, os.W_OK):  # root writes anyway: the probe cannot fail here
            pytest.skip("running as root: permission bits do not stop a write")
        with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
            tier = DiskTier(kv, 1 << 20, NS)
        assert not tier.usable and any("writable" in m for m in warnings_of(caplog))
    finally:
        (kv / NS).chmod(0o700)


# -- 4: forged blocks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("forge", [forged, forged_unkeyed])
def test_a_forged_block_is_never_loaded(kv: Path, caplog: pytest.LogCaptureFixture, forge: Forge) -> None:
    tier = DiskTier(kv, 1 << 20, NS)
    for i in (1, 2):
        path = block_file(tier, key(i))
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(forge(key(i), b"evil" * 250))
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        assert tier.get(key(1)) is None and tier.get(key(2)) is None
    assert not block_file(tier, key(1)).exists() and not block_file(tier, key(2)).exists()
    stats = tier.stats()
    assert stats.hits == 0
    if forge is forged:  # counted and warned once
        assert stats.unauthenticated == stats.rejected == 2
        assert len([m for m in warnings_of(caplog) if "authentication" in m]) == 1
    else:  # the older format: a miss
        assert stats.misses == 2 and stats.rejected == 0
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)  # recomputed and stored again


def test_a_forged_file_of_the_right_size_does_not_stop_a_write(kv: Path) -> None:
    tier = DiskTier(kv, 1 << 20, NS)
    path = block_file(tier, key(1))
    path.parent.mkdir()
    path.write_bytes(forged(key(1), payload(99)))  # the block's size: the old put kept it and touched it
    assert tier.put(key(1), payload(1))
    assert tier.get(key(1)) == payload(1)


def test_servers_share_blocks_only_with_the_same_key(kv: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("a", "b"):
        (keys / name).write_bytes(os.urandom(32).hex().encode())
        (keys / name).chmod(0o600)
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(keys / "a"))
    assert DiskTier(kv, 1 << 20, NS).put(key(1), payload(1))
    assert DiskTier(kv, 1 << 20, NS).get(key(1)) == payload(1)  # another server with the key
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(keys / "b"))
    other = DiskTier(kv, 1 << 20, NS)
    assert other.get(key(1)) is None and other.stats().unauthenticated == 1


def test_the_default_key_file_is_private_and_reused(kv: Path, tmp_path: Path) -> None:
    first = DiskTier(kv, 1 << 20, NS)
    assert first.put(key(1), payload(1))
    key_file = tmp_path / "cache" / "kv-disk.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert DiskTier(kv, 1 << 20, NS).get(key(1)) == payload(1)  # a restart reads the same key
    assert not list(kv.rglob("*.key"))


def _inside(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    kv.mkdir()
    (kv / "k").write_bytes(b"x" * 64)
    (kv / "k").chmod(0o600)
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(kv / "k"))
    return "inside --kv-disk-dir"


def _short(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "k").write_bytes(b"x" * 8)
    (tmp_path / "k").chmod(0o600)
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(tmp_path / "k"))
    return "holds 8 bytes"


def _world_writable(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "k").write_bytes(b"x" * 64)
    (tmp_path / "k").chmod(0o666)
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(tmp_path / "k"))
    return "chmod 600"


def _missing(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MOEFORGE_KV_DISK_KEY", str(tmp_path / "nope"))
    return "does not exist"


def _default_is_a_link(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cache").mkdir()
    (tmp_path / "planted").write_bytes(b"x" * 64)
    (tmp_path / "planted").chmod(0o600)
    os.symlink(tmp_path / "planted", tmp_path / "cache" / "kv-disk.key")
    return "not a symbolic link"


@pytest.mark.parametrize("setup", [_inside, _short, _world_writable, _missing, _default_is_a_link])
def test_an_unusable_key_turns_the_tier_off_and_says_why(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture, setup: Setup) -> None:
    expected = setup(kv, tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        tier = DiskTier(kv, 1 << 20, NS)
    assert not tier.usable and not tier.put(key(1), payload(1)) and tier.get(key(1)) is None
    messages = warnings_of(caplog)
    assert len(messages) == 1 and expected in messages[0] and "writable directory" not in messages[0]


def test_an_unwritable_cache_folder_falls_back_to_a_process_key(kv: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "blocker").write_bytes(b"")
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "blocker" / "cache"))  # under a file: cannot exist
    with caplog.at_level(logging.WARNING, logger=disk_tier.__name__):
        tier = DiskTier(kv, 1 << 20, NS)
    assert tier.usable and tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
    assert any("this process only" in m for m in warnings_of(caplog))


# -- the tiers above: a forged block costs a recompute, never a wrong KV ------------------------------------------

LAYOUT = BlockLayout((PoolShape((2, 1, 3), "float32"),))


class Pools:
    def __init__(self) -> None:
        self.array = np.zeros((2, 2, 1, 3), np.float32)

    def layout(self) -> BlockLayout:
        return LAYOUT

    def read(self, block_ids: Sequence[int]) -> list[list[np.ndarray]]:
        return [[self.array[b].copy()] for b in block_ids]

    def write(self, block_ids: Sequence[int], rows: Sequence[Sequence[np.ndarray]]) -> None:
        for block_id, block in zip(block_ids, rows, strict=True):
            self.array[block_id] = block[0]


def test_a_forged_block_is_recomputed_by_the_tiers(kv: Path) -> None:
    pools = Pools()
    pools.array[0] = 1.5
    tiers = KVTiers(TierSettings(disk_dir=kv, disk_bytes=1 << 20), pools, "artifact")
    assert tiers.flush([(0, key(1))]) == 1
    tiers.close()
    (path,) = kv.rglob("*.kvblock")
    evil = np.full((2, 1, 3), 666.0, np.float32).tobytes()  # issue 48's attack, on the tiers' own namespace
    path.write_bytes(forged_unkeyed(key(1), evil, namespace=path.parent.parent.name))
    fresh_pools = Pools()
    fresh = KVTiers(TierSettings(disk_dir=kv, disk_bytes=1 << 20), fresh_pools, "artifact")
    assert fresh.find([key(1)]) == 1 and fresh.promote([key(1)], [1]) == 0  # found, then refused: recomputed
    assert not (fresh_pools.array == 666.0).any()
    fresh.close()


# -- fuzz: the block-file reader ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_tier() -> Iterator[tuple[DiskTier, bytes]]:
    """One tier and one valid block file's bytes, shared by the examples (each rewrites the file)."""
    with tempfile.TemporaryDirectory() as folder:
        tier = DiskTier(Path(folder) / "kv", 1 << 16, NS, secret=b"s" * 32)
        assert tier.put(key(1), payload(1, 64))
        yield tier, block_file(tier, key(1)).read_bytes()


def _check_read(tier: DiskTier, data: bytes) -> None:
    path = block_file(tier, key(1))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    got = tier.get(key(1))  # never raises
    assert got is None or got == payload(1, 64)  # a block is the stored one or none: the tokens cannot change


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzz_random_block_files(fuzz_tier: tuple[DiskTier, bytes], data: bytes) -> None:
    _check_read(fuzz_tier[0], data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.integers(0, 200), tail=st.binary(max_size=8))
def test_fuzz_mutated_block_files(fuzz_tier: tuple[DiskTier, bytes], edits: list[tuple[int, int]], cut: int,
                                  tail: bytes) -> None:
    tier, valid = fuzz_tier
    data = bytearray(valid)
    for at, value in edits:
        data[at % len(data)] = value
    _check_read(tier, bytes(data[:max(0, len(data) - cut)]) + tail)


def test_two_processes_creating_the_default_key_agree(tmp_path: Path) -> None:
    # Ranks of one server start together: the second creator links its key in too late and reads the first one's.
    path = tmp_path / "cache" / disk_key.DEFAULT_KEY_FILE
    first = disk_key.load_disk_key(tmp_path / "kv")
    assert disk_key._create_key(path) == first
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left behind
