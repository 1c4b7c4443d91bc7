"""Where one decode step's time goes: ONNX Runtime's kernels vs the engine's host work around them.

`python benchmarks/step_overhead.py ARTIFACT [ARTIFACT ...] [--batch 1 8] [--steps 128]` runs greedy decode on each
artifact and times every engine step in parts, by wrapping the engine's own objects (nothing is changed in them):

- ``ort_run``: ``InferenceSession.run_with_iobinding`` (ONNX Runtime: kernels and its own dispatch);
- ``backend_host``: the rest of ``Backend.execute`` (building ids/positions/mask, IOBinding setup, OrtValues,
  copying logits out);
- ``schedule``: ``Scheduler.schedule``; ``sample``: ``Sampler.sample``; ``update``: ``Scheduler.update``;
- ``engine_other``: the rest of ``LLMEngine.step`` (stop strings, outputs, bookkeeping).

Host overhead per step = step - ort_run. In situ it includes what the kernels cost the host code around them
(caches they evicted, their threads winding down), so a second number isolates the host code: ``host_only_ms``,
the same decode steps with ``run_with_iobinding`` replaced by a no-op (the logits buffer keeps the last real step's
values, so sampling still sees real logits). Medians over the decode steps (prefill steps are skipped) are written
to benchmarks/results/step_overhead.json with the machine described, and printed as a table.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import onnxruntime as ort
from timer import Samples, Stopwatch

from moeforge.cli.bench import write_result
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "step_overhead.json"
PARTS = ("ort_run", "backend_host", "schedule", "sample", "update", "engine_other")


class StepTimer:
    """Accumulates seconds per part within the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def call(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its seconds added to ``part``."""
        watch = Stopwatch()
        try:
            return fn(*args, **kwargs)
        finally:
            self.current[part] += watch.elapsed()

    def wrap(self, owner: Any, name: str, part: str) -> None:
        """Replace ``owner.name`` (a bound method) by a timed wrapper adding to ``part``."""
        setattr(owner, name, partial(self.call, part, getattr(owner, name)))


def find_sessions(backend: Any) -> list[ort.InferenceSession]:
    """The ONNX Runtime sessions a backend holds (attributes one or two levels deep)."""
    found = []
    for value in vars(backend).values():
        if isinstance(value, ort.InferenceSession):
            found.append(value)
        elif hasattr(value, "__dict__"):
            found += [v for v in vars(value).values() if isinstance(v, ort.InferenceSession)]
    return found


class TimedSession:
    """A proxy of an InferenceSession whose run_with_iobinding is timed (the real class's methods are read-only)."""

    def __init__(self, session: ort.InferenceSession, timer: StepTimer) -> None:
        self._session, self._timer = session, timer
        self.skip = False  # True: the run is a no-op (host_only_ms)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        if self.skip:
            return None
        return self._timer.call("ort_run", self._session.run_with_iobinding, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def instrument(engine: LLMEngine, timer: StepTimer) -> list[TimedSession]:
    """Wrap the engine's scheduler, sampler, backend and ONNX Runtime session(s) with ``timer``; returns the
    session proxies."""
    backend = engine.backend
    proxies = []
    for holder in [backend, *(v for v in vars(backend).values() if hasattr(v, "__dict__"))]:
        for key, value in list(vars(holder).items()):
            if isinstance(value, ort.InferenceSession):
                proxies.append(TimedSession(value, timer))
                setattr(holder, key, proxies[-1])
    timer.wrap(backend, "execute", "execute")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update", "update")
    timer.wrap(engine.sampler, "sample", "sample")
    return proxies


def measure(artifact: str, batch: int, steps: int, prompt_len: int) -> dict[str, Any]:
    """Median per-part milliseconds of ``steps`` greedy decode steps at ``batch`` rows."""
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len)))
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prompts = [[(7 * b + 3 * i) % engine.backend.vocab_size + 10 for i in range(prompt_len)] for b in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    timer = StepTimer()
    proxies = instrument(engine, timer)
    for prompt in prompts:
        engine.add_request(prompt, params)
    rows: list[dict[str, float]] = []
    while engine.has_unfinished():
        timer.current.clear()
        with Stopwatch() as step:
            engine.step()
        total = step.seconds
        parts = dict(timer.current)
        if "execute" in parts:
            execute = parts.pop("execute", 0.0)
            parts["backend_host"] = execute - parts.get("ort_run", 0.0)
            parts["engine_other"] = total - execute - sum(parts.get(p, 0.0) for p in ("schedule", "sample", "update"))
            parts["step"] = total
            rows.append(parts)
    rows = rows[1:]  # the first timed step is the prefill
    result: dict[str, Any] = {"artifact": artifact, "batch": batch, "steps": len(rows)}
    for part in (*PARTS, "step"):
        result[f"{part}_ms"] = round(1e3 * statistics.median(r.get(part, 0.0) for r in rows), 4)
    result["host_overhead_ms"] = round(result["step_ms"] - result["ort_run_ms"], 4)
    result["host_only_ms"] = round(1e3 * host_only(engine, proxies, prompts, steps), 4)
    result["decode_tokens_per_s"] = round(batch / (result["step_ms"] / 1e3), 1)
    return result


def host_only(engine: LLMEngine, proxies: list[TimedSession], prompts: list[list[int]], steps: int) -> float:
    """Median seconds of a decode step with ONNX Runtime's run a no-op (the prefill runs for real)."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill, real
    for proxy in proxies:
        proxy.skip = True
    times = Samples()
    while engine.has_unfinished():
        with times.measure():
            engine.step()
    for proxy in proxies:
        proxy.skip = False
    return times.median()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = [measure(a, b, args.steps, args.prompt_len) for a in args.artifacts for b in args.batch]
    header = ["artifact", "batch", "step_ms", "ort_run_ms", "host_overhead_ms", "host_only_ms",
              *(f"{p}_ms" for p in PARTS[1:])]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        print("| " + " | ".join(str(r[h]) if h != "artifact" else Path(r[h]).name for h in header) + " |")
    write_result(args.results, "step_overhead", {"runs": results})


if __name__ == "__main__":
    main()
