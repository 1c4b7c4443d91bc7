"""Progress for the waits a user sees: a stage bar for the compile, stage lines for the other commands.

Both name the stage that runs now and keep its clock moving while it runs. tqdm redraws only when it is told to (an
update, a new postfix), and one stage -- the export of a real model -- runs for minutes with neither: a ``Ticker``
thread redraws every ``interval`` seconds until the display closes, after success or an exception alike.

Everything goes to stderr (stdout carries results that scripts parse); a display made with ``enabled=False`` (the
commands' ``--quiet``) writes nothing and starts no thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TextIO, TypeVar

from tqdm import tqdm

# Stages differ in length by orders of magnitude (a pass takes milliseconds, the export minutes), so the bar shows
# stages done and time spent, never a rate or an ETA extrapolated from them.
STAGE_BAR_FORMAT = "{desc}: {n}/{total} stages [{elapsed}]{postfix}"
# How often the ticker redraws: every 0.5 s on a terminal (a clock that moves); every 5 s into a file or a pipe (a CI
# log), where each redraw is one more line that stays.
TTY_INTERVAL_S, FILE_INTERVAL_S = 0.5, 5.0

T = TypeVar("T")


class Stages(Protocol):
    """Where a long job reports its stages: a ``StageBar``, a rank's share of one (``StageBar.scoped``), a worker
    process's pipe to its parent's bar, or ``QUIET``."""

    def stage(self, name: str) -> None:
        """``name`` starts now (it replaces the stage shown; its clock starts at 0)."""
        ...

    def advance(self, n: int = 1) -> None:
        """``n`` more stages are done."""
        ...


class _Quiet:
    def stage(self, name: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


QUIET: Stages = _Quiet()


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


class Ticker:
    """Calls ``tick`` every ``interval`` seconds on a daemon thread until ``stop`` (which waits for the thread)."""

    def __init__(self, tick: Callable[[], None], interval: float) -> None:
        self._tick, self._interval = tick, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeforge-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._tick()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@contextlib.contextmanager
def ticking(bar: tqdm, interval: float | None = None) -> Iterator[tqdm]:
    """Redraw ``bar`` (any tqdm) every ``interval`` seconds while the ``with`` body runs, so that its clock moves
    between its updates; nothing for a disabled bar."""
    if bar.disable:
        yield bar
        return
    ticker = Ticker(bar.refresh, interval or (TTY_INTERVAL_S if _isatty(bar.fp) else FILE_INTERVAL_S))
    try:
        yield bar
    finally:
        ticker.stop()


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


class StageBar:
    """A tqdm bar over ``total`` stages: "compile: 2/6 stages [01:14], export to ONNX (41 s)". The postfix names the
    running stage and its own time; a ``Ticker`` keeps both clocks moving. Close it (``with`` does) to stop the
    ticker and clear the line."""

    def __init__(self, total: int, desc: str, enabled: bool, file: TextIO | None = None,
                 interval: float | None = None) -> None:
        self._bar = tqdm(total=total, desc=desc, unit="stage", disable=not enabled, leave=False,
                         bar_format=STAGE_BAR_FORMAT, file=file)
        self._lock = threading.Lock()  # the ticker's thread reads what stage() sets
        self._name, self._started = "", time.monotonic()
        if interval is None:
            interval = TTY_INTERVAL_S if _isatty(file if file is not None else sys.stderr) else FILE_INTERVAL_S
        self.ticker = Ticker(self._redraw, interval) if enabled else None

    def stage(self, name: str) -> None:
        with self._lock:
            self._name, self._started = name, time.monotonic()
        self._redraw()

    def advance(self, n: int = 1) -> None:
        self._bar.update(n)

    @property
    def stages_done(self) -> int:
        return int(self._bar.n)

    def scoped(self, prefix: str) -> Stages:
        """This bar as one part of the job sees it: each stage named "{prefix}: {name}" (a rank of a sharded
        compile)."""
        return _Scoped(self, prefix)

    def _redraw(self) -> None:
        with self._lock:
            seconds = time.monotonic() - self._started
            name = f"{self._name} ({_seconds(seconds)})" if self._name and seconds >= 1 else self._name
            self._bar.set_postfix_str(name, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self.ticker is not None:
            self.ticker.stop()
        self._bar.close()

    def __enter__(self) -> StageBar:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class _Scoped:
    def __init__(self, bar: StageBar, prefix: str) -> None:
        self._bar, self._prefix = bar, prefix

    def stage(self, name: str) -> None:
        self._bar.stage(f"{self._prefix}: {name}")

    def advance(self, n: int = 1) -> None:
        self._bar.advance(n)


class StageLog:
    """One line per stage on stderr, for commands whose result goes to stdout: "loading artifact ... 3.2 s". On a
    terminal the line's clock ticks while the stage runs; into a file or a pipe the line is written once when the
    stage starts ("...") and ended with its time. ``enabled=False`` (``--quiet``): nothing."""

    def __init__(self, enabled: bool, file: TextIO | None = None, interval: float | None = None) -> None:
        self.enabled = enabled
        self._file = file
        self._interval = interval

    @property
    def file(self) -> TextIO:
        return self._file if self._file is not None else sys.stderr  # late: a test's capture replaces sys.stderr

    def run(self, text: str, work: Callable[[], T]) -> T:
        """``work()`` shown as the stage ``text``."""
        with self.stage(text):
            return work()

    @contextlib.contextmanager
    def stage(self, text: str) -> Iterator[StageLine]:
        """Show ``text`` while the ``with`` body runs; its line ends when the body does, with its time and the
        ``outcome`` the body set (also on an exception, so that an error message starts on a line of its own)."""
        line = StageLine()
        if not self.enabled:
            yield line
            return
        file, start = self.file, time.monotonic()
        live = self._interval is not None or _isatty(file)
        lock, drawn = threading.Lock(), [0]

        def draw(tail: str, newline: bool = False) -> None:  # live: the whole line again, over the last one
            with lock:
                body = f"{text} ... {tail}"
                file.write("\r" + body.ljust(drawn[0]) + ("\n" if newline else ""))
                file.flush()
                drawn[0] = len(body)

        def end(result: str) -> None:
            if live:
                draw(result, newline=True)
            else:
                file.write(f" {result}\n")
                file.flush()

        file.write(f"{text} ...")
        file.flush()
        ticker = Ticker(lambda: draw(_seconds(time.monotonic() - start)), self._interval or TTY_INTERVAL_S) \
            if live else None
        try:
            yield line
        except BaseException as exc:
            if ticker is not None:
                ticker.stop()
            took = _seconds(time.monotonic() - start)
            end(f"interrupted after {took}" if isinstance(exc, KeyboardInterrupt) else f"failed after {took}")
            raise
        if ticker is not None:
            ticker.stop()
        took = _seconds(time.monotonic() - start)
        end(f"{line.outcome} ({took})" if line.outcome else took)


class StageLine:
    """What the body of a ``StageLog.stage`` may add to its line: ``outcome`` ("skipped: ..."), shown before the
    time."""

    def __init__(self) -> None:
        self.outcome = ""
