"""Prometheus metrics of the KV tiers below the pool (``--kv-host-bytes``, ``--kv-disk-dir``; runtime/kv_tiers).

Built at scrape time from the engine loop's latest ``KVTierStats`` snapshot (cumulative since the engine opened its
tiers, so no differencing): ``kv_tier_hits_total{tier}`` / ``kv_tier_misses_total{tier}`` (blocks promoted from /
looked up and not found in ``host`` or ``disk``), ``kv_tier_bytes{tier}`` / ``kv_tier_capacity_bytes{tier}`` (held /
allowed), ``kv_tier_read_bytes_total{tier="disk"}`` / ``kv_tier_written_bytes_total{tier="disk"}``,
``kv_tier_io_seconds_total{tier, op}`` (host: demotion copies ``write`` and promotions ``read`` on the engine thread;
disk: file reads and writes), ``kv_tier_demotions_total``, ``kv_tier_promotions_total``,
``kv_tier_prefetched_total``, ``kv_tier_prefetch_hits_total``, ``kv_tier_dropped_total`` (blocks not kept below the
pool), ``kv_tier_disk_rejected_files_total`` (corrupt, truncated or foreign files removed unread) and
``kv_tier_disk_write_errors_total`` (disk full, unwritable). Absent when the server has no tiers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moeforge.runtime.kv_tiers.tiers import KVTierStats

PREFIX = "moeforge:"


class KVTierMetrics(Collector):
    """The tiers' series from ``snapshot`` (replaced by the loop thread after each step, never written in place)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: KVTierStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        if stats is None:
            return
        m = self.model_name
        disk = stats.disk

        def per_tier(name: str, doc: str, host: float, on_disk: float | None, gauge: bool = False) -> Metric:
            family: CounterMetricFamily | GaugeMetricFamily = (GaugeMetricFamily if gauge else CounterMetricFamily)(
                PREFIX + name, doc, labels=["model_name", "tier"])
            family.add_metric([m, "host"], host)
            if on_disk is not None:
                family.add_metric([m, "disk"], on_disk)
            return family

        def total(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        has_disk = disk is not None
        yield per_tier("kv_tier_hits", "KV blocks promoted into the pool from this tier.", stats.host_hits,
                       stats.disk_hits if has_disk else None)
        yield per_tier("kv_tier_misses", "KV blocks looked up in this tier (after the tiers above missed) and not "
                       "found.", stats.host_misses, stats.disk_misses if has_disk else None)
        yield per_tier("kv_tier_bytes", "Bytes of KV blocks the tier holds.", stats.host_bytes,
                       disk.bytes if disk is not None else None, gauge=True)
        yield per_tier("kv_tier_capacity_bytes", "Bytes the tier may hold.", stats.host_capacity_bytes,
                       stats.disk_capacity_bytes if has_disk else None, gauge=True)
        seconds = CounterMetricFamily(PREFIX + "kv_tier_io_seconds", "Seconds spent moving KV blocks: host = "
                                      "demotion copies (write) and promotions (read) on the engine thread; disk = "
                                      "file I/O.", labels=["model_name", "tier", "op"])
        seconds.add_metric([m, "host", "write"], stats.demote_seconds)
        seconds.add_metric([m, "host", "read"], stats.promote_seconds)
        if has_disk:
            seconds.add_metric([m, "disk", "write"], stats.disk_write_seconds)
            seconds.add_metric([m, "disk", "read"], stats.disk_read_seconds)
            yield total("kv_tier_read_bytes", "Bytes read from the disk tier.", stats.disk_read_bytes)
            yield total("kv_tier_written_bytes", "Bytes written to the disk tier.", stats.disk_write_bytes)
            yield total("kv_tier_disk_rejected_files", "Disk-tier files found corrupt, truncated or foreign and "
                        "removed without being loaded.", disk.rejected if disk is not None else 0)
            yield total("kv_tier_disk_write_errors", "Disk-tier writes that failed (disk full, unwritable).",
                        disk.write_errors if disk is not None else 0)
        yield seconds
        yield total("kv_tier_demotions", "KV blocks copied out of the pool when it evicted them.", stats.demotions)
        yield total("kv_tier_promotions", "KV blocks written into the pool from a tier below (not recomputed).",
                    stats.promotions)
        yield total("kv_tier_prefetched", "KV blocks read from disk ahead of their request's turn.", stats.prefetched)
        yield total("kv_tier_prefetch_hits", "Promotions served by a prefetched block (no disk wait in the step).",
                    stats.prefetch_hits)
        yield total("kv_tier_dropped", "KV blocks not kept below the pool (writer backlog full, disk refusing).",
                    stats.dropped)
