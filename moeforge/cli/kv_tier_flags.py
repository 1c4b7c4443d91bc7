"""The KV-tier flags ``run``, ``serve`` and ``bench`` share (``CacheOptions`` host / disk tiers, runtime/kv_tiers)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeforge.core.host_memory import parse_size
from moeforge.runtime.engine_config import DEFAULT_DISK_BYTES, CacheOptions
from moeforge.runtime.kv_tiers.block_codec import OFFLOAD_DTYPES


def size_argument(text: str) -> int:
    """An argparse type for sizes such as 512M or 2G: whole bytes, 1 byte to 1 PiB (``core/host_memory.parse_size``;
    ``1.5G`` is whole bytes, ``0.5`` is refused rather than rounded to 0, which would mean "none")."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tier_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-host-bytes``, ``--kv-disk-dir``, ``--kv-disk-bytes``, ``--kv-offload-dtype`` (paged artifacts)."""
    group = parser.add_argument_group("KV-cache tiers (paged artifacts: prefix blocks evicted from the pool are "
                                      "kept below it and promoted back instead of recomputed)")
    group.add_argument("--kv-host-bytes", type=size_argument, default=0, metavar="SIZE",
                       help="L2: host memory for evicted KV blocks, e.g. 2G (default 0: none)")
    group.add_argument("--kv-disk-dir", type=Path, default=None, metavar="DIR",
                       help="L3: a directory for KV blocks, kept across restarts and shared by servers of the same "
                            "artifact; a clean shutdown writes every cached block there. Blocks are authenticated "
                            "with the key file $MOEFORGE_KV_DISK_KEY (default: a per-user key in the moeforge cache "
                            "folder); servers of several users or machines sharing DIR need the same key file")
    group.add_argument("--kv-disk-bytes", type=size_argument, default=DEFAULT_DISK_BYTES, metavar="SIZE",
                       help="most bytes the L3 directory holds for this artifact (least recently used out first; "
                            "default %(default)s bytes)")
    group.add_argument("--kv-offload-dtype", choices=OFFLOAD_DTYPES, default="native",
                       help="how L2/L3 store blocks: native (bit for bit) or int8 (4x smaller than fp32, lossy)")


def cache_options(args: argparse.Namespace, kv_blocks: int | None = None) -> CacheOptions:
    """The ``CacheOptions`` of ``args`` (parsed with ``add_tier_flags``)."""
    return CacheOptions(kv_blocks=kv_blocks, host_bytes=args.kv_host_bytes, disk_dir=args.kv_disk_dir,
                        disk_bytes=args.kv_disk_bytes, offload_dtype=args.kv_offload_dtype)
