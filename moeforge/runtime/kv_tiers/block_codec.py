"""BlockCodec: one KV-cache block of every layer as one byte string, for the tiers below the pool.

A paged backend's cache is a set of pools, [num_blocks, Bs, Hkv, D] each (per layer: key and value, an MLA
latent, a DSA indexer's keys). A block of the cache is row ``block_id`` of every pool; the codec packs those
rows, pool after pool in the backend's order, into one ``bytes`` and back. The layout (``BlockLayout``) is part
of what a stored block means, so the disk tier keys its files by the artifact and the codec's ``tag``.

``dtype="native"``: the pool's own bytes, bit for bit (a promoted block is the block that was demoted).
``dtype="int8"``: each float pool row quantised symmetrically with one float32 scale per (token, head), amax /
127 (the existing ``--kv-quant int8`` scales per head over calibration prompts; a block is small enough to
scale it exactly instead). 4x fewer bytes than float32 (2x float16), plus 4 / D bytes per value for the
scales; lossy, so outputs can differ from the uncompressed cache (benchmarks/kv_tiers.py measures by how much).

Letters: Bs tokens per block, Hkv heads of one pool (1 for an MLA latent), D values per head.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from moeforge.runtime.backends.base import BlockLayout, PoolShape

OFFLOAD_DTYPES = ("native", "int8")
FORMAT_VERSION = 1  # raise it when an encoding changes: the disk tier's namespace (the codec tag) changes with it


class BlockCodec:
    """Encode a block's pool rows (one [Bs, Hkv, D] array per pool) to bytes and back, as ``dtype`` says."""

    def __init__(self, layout: BlockLayout, dtype: str = "native") -> None:
        if dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"offload dtype {dtype!r} is unknown: use one of {', '.join(OFFLOAD_DTYPES)}")
        self.layout = layout
        self.dtype = dtype
        # int8 applies to float pools only; any other pool is stored as it is.
        self._quantised = [dtype == "int8" and np.issubdtype(np.dtype(p.dtype), np.floating) for p in layout.pools]
        self.nbytes = sum(_encoded_bytes(p, q) for p, q in zip(layout.pools, self._quantised, strict=True))
        # The format version, dtype and every pool's shape: a file of another encoding is never read as this one.
        description = f"v{FORMAT_VERSION};{dtype};" + ";".join(f"{p.dtype}{list(p.shape)}" for p in layout.pools)
        self.tag = hashlib.blake2b(description.encode(), digest_size=8).hexdigest()  # what a payload's bytes mean

    def encode(self, rows: Sequence[np.ndarray]) -> bytes:
        """One block's rows, [Bs, Hkv, D] per pool in layout order -> ``nbytes`` bytes."""
        parts: list[bytes] = []
        for row, pool, quantised in zip(rows, self.layout.pools, self._quantised, strict=True):
            if row.shape != pool.shape or row.dtype != np.dtype(pool.dtype):
                raise ValueError(f"block row {row.dtype}{list(row.shape)} does not match its pool "
                                 f"{pool.dtype}{list(pool.shape)}")
            if not quantised:
                parts.append(np.ascontiguousarray(row).tobytes())
                continue
            values = row.astype(np.float32)
            scales = np.abs(values).max(axis=-1, keepdims=True) / 127.0  # [Bs, Hkv, 1] per token and head
            safe = np.where(scales > 0, scales, 1.0)
            codes = np.clip(np.rint(values / safe), -127, 127).astype(np.int8)
            parts += [scales.astype(np.float32).tobytes(), codes.tobytes()]
        return b"".join(parts)

    def decode(self, payload: bytes | memoryview) -> list[np.ndarray]:
        """``encode``'s inverse: one [Bs, Hkv, D] array per pool, in the pools' dtypes."""
        if len(payload) != self.nbytes:
            raise ValueError(f"a block payload has {len(payload)} bytes, the layout needs {self.nbytes}")
        rows: list[np.ndarray] = []
        at = 0
        for pool, quantised in zip(self.layout.pools, self._quantised, strict=True):
            if not quantised:
                rows.append(np.frombuffer(payload, np.dtype(pool.dtype), int(np.prod(pool.shape)), at)
                            .reshape(pool.shape))
                at += pool.nbytes
                continue
            count = int(np.prod(pool.shape[:-1]))
            scales = np.frombuffer(payload, np.float32, count, at).reshape(*pool.shape[:-1], 1)
            at += 4 * count
            codes = np.frombuffer(payload, np.int8, int(np.prod(pool.shape)), at).reshape(pool.shape)
            at += codes.nbytes
            rows.append((codes.astype(np.float32) * scales).astype(pool.dtype))
        return rows


def _encoded_bytes(pool: PoolShape, quantised: bool) -> int:
    if not quantised:
        return pool.nbytes
    return int(np.prod(pool.shape)) + 4 * int(np.prod(pool.shape[:-1]))  # int8 codes + float32 scales
