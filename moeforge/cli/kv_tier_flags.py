"""The KV-tier options of ``run``, ``serve`` and ``bench`` (``CacheOptions`` host / disk tiers, runtime/kv_tiers);
their flags are declared in ``cli/parser.add_tier_flags``."""

from __future__ import annotations

import argparse

from moeforge.runtime.engine_config import CacheOptions


def cache_options(args: argparse.Namespace, kv_blocks: int | None = None) -> CacheOptions:
    """The ``CacheOptions`` of ``args`` (parsed with ``add_tier_flags``)."""
    return CacheOptions(kv_blocks=kv_blocks, host_bytes=args.kv_host_bytes, disk_dir=args.kv_disk_dir,
                        disk_bytes=args.kv_disk_bytes, offload_dtype=args.kv_offload_dtype)
