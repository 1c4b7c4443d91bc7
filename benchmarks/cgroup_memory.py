"""Memory as a container counts it: a command run alone in a fresh memory cgroup, measured, and the group removed.

``run_in_cgroup(cmd, limit_bytes)`` runs the command in a new memory cgroup (v1 or v2; needs root), with an optional
cap (``memory.limit_in_bytes`` / ``memory.max``, swap off). Its ``RunResult`` holds the group's peak (page cache
included: ``memory.max_usage_in_bytes`` / ``memory.peak``), OOM kills (``memory.oom_control`` /
``memory.events``, or death by SIGKILL), the largest peak RSS (VmHWM, sampled) of its processes and the wall
time; a run past its timeout is killed. The group (``MemoryCgroup``) is removed afterwards whatever happens.
``find_memory_cgroup`` finds where groups can be made, and ``memory_cgroup_reason`` says why not (for skips).

``drop_page_cache`` evicts files from the page cache, so that the next reader reads them cold and its group is
charged for them (as in a fresh container). Shared libraries already in memory (torch, onnxruntime) stay charged
to whoever loaded them first.

Scripts import it as a sibling module (``from cgroup_memory import run_in_cgroup``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timer import Stopwatch

MIB = 2**20


class CgroupUnavailable(RuntimeError):
    """No memory cgroup this process can create children in; the message says why."""


def mountinfo() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of every mount."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            mounts.append((fields[3], fields[4], tail[0], tail[2]))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and "" -> its v2 path."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _inside(mount_point: str, mount_root: str, path: str) -> Path:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return Path(mount_point) / ("" if relative == "." else relative)


def _writable_v1(candidates: list[Path]) -> Path | None:
    for candidate in candidates:
        if (candidate / "memory.limit_in_bytes").is_file() and os.access(candidate, os.W_OK):
            return candidate
    return None


def _v2_parent(group: Path, mount_point: Path) -> tuple[Path | None, str]:
    """The nearest of ``group`` and its ancestors under which a child gets the memory controller: memory is
    enabled in its subtree_control already, or can be (not where processes live, by v2's no-internal-process
    rule, except at the root)."""
    reasons = []
    candidate = group
    while True:
        controllers = (candidate / "cgroup.controllers").read_text().split() if \
            (candidate / "cgroup.controllers").is_file() else []
        subtree = candidate / "cgroup.subtree_control"
        if "memory" not in controllers:
            reasons.append(f"{candidate}: no memory controller in cgroup.controllers")
        elif subtree.is_file() and "memory" in subtree.read_text().split() and os.access(candidate, os.W_OK):
            return candidate, ""
        elif subtree.is_file() and os.access(subtree, os.W_OK):
            try:
                subtree.write_text("+memory")
                return candidate, ""
            except OSError as exc:
                reasons.append(f"{candidate}: cannot enable +memory in cgroup.subtree_control ({exc.strerror})")
        else:
            reasons.append(f"{candidate}: not writable")
        if candidate == mount_point or candidate.parent == candidate:
            return None, "; ".join(reasons)
        candidate = candidate.parent


def find_memory_cgroup() -> tuple[int, Path]:
    """(cgroup version, the folder under which ``MemoryCgroup`` creates its groups). Raises ``CgroupUnavailable``
    saying why when there is none: no memory controller, not root, or (v2) a hierarchy that cannot delegate it."""
    if not Path("/proc/self/cgroup").is_file():
        raise CgroupUnavailable("no /proc/self/cgroup: not Linux, or /proc is not mounted")
    own, mounts = _own_cgroups(), mountinfo()
    reasons = []
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(","):
            group = _inside(point, root, own.get("memory", "/"))
            found = _writable_v1([group, Path(point)])
            if found is not None:
                return 1, found
            reasons.append(f"cgroup v1 memory at {point}: neither {group} nor {point} is writable (run as root)")
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2":
            group = _inside(point, root, own.get("", "/"))
            if not group.is_dir():
                group = Path(point)
            parent, why = _v2_parent(group, Path(point))
            if parent is not None:
                return 2, parent
            reasons.append(f"cgroup v2 at {point}: {why}")
    raise CgroupUnavailable("; ".join(reasons) or "no cgroup v1 memory controller or cgroup v2 mount")


def memory_cgroup_reason() -> str | None:
    """None when ``find_memory_cgroup`` finds one, else why not (for skips)."""
    try:
        find_memory_cgroup()
    except (CgroupUnavailable, OSError) as exc:
        return str(exc)
    return None


class MemoryCgroup:
    """A fresh memory cgroup (v1 or v2) for one child process tree; ``close()`` kills what is left in it, reclaims
    its page cache (v1) and removes it. Use as a context manager."""

    _count = itertools.count()

    def __init__(self, limit_bytes: int | None = None, parent: tuple[int, Path] | None = None) -> None:
        self.version, base = parent or find_memory_cgroup()
        self.path = base / f"moeforge-compile-memory-{os.getpid()}-{next(self._count)}"
        self.path.mkdir()
        try:
            if self.version == 1:
                if limit_bytes is not None:
                    self._write("memory.limit_in_bytes", limit_bytes)
                    # No swap (none here anyway): memory + swap capped at the same number.
                    with contextlib.suppress(OSError):
                        self._write("memory.memsw.limit_in_bytes", limit_bytes)
            else:
                self._write("memory.max", "max" if limit_bytes is None else limit_bytes)
                with contextlib.suppress(OSError):
                    self._write("memory.swap.max", 0)
        except BaseException:
            self.close()
            raise
        self.limit_bytes = limit_bytes
        self._peak_polled = 0
        self.max_rss_bytes = 0  # see sample()

    def _write(self, name: str, value: object) -> None:
        (self.path / name).write_text(str(value))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _keyed(self, name: str) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in (line.split() for line in self._read(name).splitlines() if " " in line)}
        except (OSError, ValueError):
            return {}

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def sample(self) -> None:
        """Take one sample of what the kernel does not keep a peak of: the largest VmHWM (peak resident set) of
        the processes in the group, and memory.current on v2 without memory.peak (kernels before 5.19)."""
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.max_rss_bytes = max(self.max_rss_bytes, int(line.split()[1]) * 1024)
        if self.version == 2 and not (self.path / "memory.peak").is_file():
            with contextlib.suppress(OSError, ValueError):
                self._peak_polled = max(self._peak_polled, self.usage())

    def peak(self) -> int:
        """The group's peak memory in bytes, page cache included."""
        if self.version == 1:
            return int(self._read("memory.max_usage_in_bytes"))
        if (self.path / "memory.peak").is_file():
            return int(self._read("memory.peak"))
        return self._peak_polled

    def oom_kills(self) -> int:
        if self.version == 1:
            return self._keyed("memory.oom_control").get("oom_kill", 0)
        return self._keyed("memory.events").get("oom_kill", 0)

    def limit_hits(self) -> int | None:
        """Times the usage hit the cap (v1 memory.failcnt, v2 memory.events max): reclaim under pressure."""
        if self.version == 1:  # memsw is charged first when it is capped too; kernel 6.18 leaves both at 0
            counts = [self._read(name) for name in ("memory.failcnt", "memory.memsw.failcnt")
                      if (self.path / name).is_file()]
            return max(int(c) for c in counts) if counts else None
        return self._keyed("memory.events").get("max")

    def kill_all(self) -> None:
        """SIGKILL every process still in the group (all were started into it by ``run_in_cgroup``)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Kill what is left, reclaim the group's page cache (v1), remove the group. Idempotent."""
        if not self.path.is_dir():
            return
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            self.kill_all()
            time.sleep(0.05)
        if self.version == 1:
            with contextlib.suppress(OSError):
                self._write("memory.force_empty", 1)
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RunResult:
    """One command run in its own memory cgroup."""

    limit_bytes: int | None
    returncode: int
    seconds: float
    peak_bytes: int  # the cgroup's peak: anonymous memory + page cache (+ kernel memory the group is charged)
    max_rss_bytes: int  # the largest peak resident set (VmHWM) of a process in the group, sampled every 0.1 s
    oom_kills: int
    limit_hits: int | None
    timed_out: bool
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0 or (self.returncode == -signal.SIGKILL and not self.timed_out)

    @property
    def out_of_memory(self) -> bool:
        """Failed for memory: OOM-killed, or a MemoryError / bad_alloc the child reported itself."""
        if self.oom_killed:
            return True
        return not self.ok and not self.timed_out and any(
            word in self.log_tail for word in ("MemoryError", "bad_alloc", "Cannot allocate memory", "Killed"))

    def summary(self) -> dict[str, Any]:
        return {"cap_mib": None if self.limit_bytes is None else self.limit_bytes // MIB, "ok": self.ok,
                "oom_killed": self.oom_killed, "timed_out": self.timed_out, "returncode": self.returncode,
                "seconds": round(self.seconds, 1), "peak_mib": round(self.peak_bytes / MIB, 1),
                "max_rss_mib": round(self.max_rss_bytes / MIB, 1), "limit_hits": self.limit_hits}


def run_in_cgroup(cmd: Sequence[str], limit_bytes: int | None = None, *, timeout_s: float | None = None,
                  parent: tuple[int, Path] | None = None, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None, tail_chars: int = 4000, sample_s: float = 0.1) -> RunResult:
    """Run ``cmd`` alone in a new memory cgroup capped at ``limit_bytes`` (None: no cap) and measure it.

    The child joins the group before it execs ``cmd`` (a ``sh`` writes its own pid to ``cgroup.procs``, then execs),
    so everything ``cmd`` allocates or reads into the page cache is charged to the group. A run past ``timeout_s``
    is killed (``timed_out``). The group is removed afterwards, also on an exception or Ctrl-C."""
    with MemoryCgroup(limit_bytes, parent) as group, tempfile.TemporaryFile("w+b") as log:
        wrapped = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs_file), *cmd]
        timed_out, done = threading.Event(), threading.Event()

        def watch() -> None:
            started = time.monotonic()
            while not done.wait(sample_s):
                group.sample()
                if timeout_s is not None and time.monotonic() - started > timeout_s and not timed_out.is_set():
                    timed_out.set()
                    group.kill_all()

        with Stopwatch() as clock:
            # Not wait4's ru_maxrss: Linux carries the forking parent's peak into the child's, and this parent
            # holds torch. The watcher samples each process's own VmHWM instead.
            proc = subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                proc.wait()
            finally:
                done.set()
                watcher.join()
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - tail_chars))
        tail = log.read().decode(errors="replace")
        return RunResult(limit_bytes=limit_bytes, returncode=proc.returncode, seconds=clock.seconds,
                         peak_bytes=group.peak(), max_rss_bytes=group.max_rss_bytes, oom_kills=group.oom_kills(),
                         limit_hits=group.limit_hits(), timed_out=timed_out.is_set(), log_tail=tail)


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Evict the files' clean pages from the page cache (``posix_fadvise`` DONTNEED; dirty pages are flushed first),
    so the next reader reads them cold and its memory cgroup is charged for them. Only these files are touched."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
