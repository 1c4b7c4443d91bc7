"""Greedy decode tokens/s of an engine: what the A/B benchmarks of one engine setting measure (argmax_head.py,
huge_pages.py).

``decode_rate(engine, batch, new_tokens)`` adds ``batch`` greedy requests of ``new_tokens`` tokens (fixed 8-token
prompts, EOS ignored), runs their prefill as one step, and times the decode steps after it: ``batch * steps`` tokens
over their seconds. Call it once with a few tokens first as a warm-up; alternate the settings with ``timer.Rounds``.

Scripts import it as a sibling module (``from decode_rate import decode_rate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from timer import Stopwatch

if TYPE_CHECKING:
    from moeforge.runtime.engine import LLMEngine


def decode_rate(engine: LLMEngine, batch: int, new_tokens: int, prompt_len: int = 8) -> float:
    """Decode tokens/s of ``batch`` greedy requests of ``new_tokens`` (the prefill step excluded)."""
    from moeforge.runtime.sampler import SamplingParams

    vocab = engine.backend.vocab_size
    prompts = [[(31 * b + 7 * i) % vocab for i in range(prompt_len)] for b in range(batch)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill (all prompts fit one step)
    watch, steps = Stopwatch(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return batch * steps / watch.elapsed()
