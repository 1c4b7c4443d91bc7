"""Reasoning output: the thinking a model writes between ``<think>`` and ``</think>`` returned as ``reasoning_content``,
apart from the answer (vLLM's and SGLang's ``--reasoning-parser deepseek_r1``).

On for a chat template with thinking markers (DeepSeek R1, V3.1 and V4 in thinking mode, Qwen 3). A template whose
generation prompt ends with ``<think>`` (DeepSeek's thinking mode) starts the output inside the thinking: everything
up to ``</think>`` is reasoning. Otherwise the output is reasoning only when it opens with ``<think>``. Streamed:
text that may still be the start of a marker is held back until it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


def template_has_thinking(template: str | None) -> bool:
    return bool(template) and (THINK_START in (template or "") or THINK_END in (template or ""))


@dataclass
class ReasoningStream:
    """Splits output deltas into (reasoning, content) deltas. ``in_reasoning``: the prompt opened the thinking."""

    in_reasoning: bool = False
    started: bool = False  # the output's first non-space text has been seen
    pending: str = ""
    after_end: bool = False  # the thinking just ended: the answer's leading newlines are dropped

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning, content = "", ""
        if not self.started:
            stripped = text.lstrip()
            if not stripped or (THINK_START.startswith(stripped) and not final):
                self.pending = text
                return "", ""
            self.started = True
            if stripped.startswith(THINK_START):
                self.in_reasoning = True
                text = stripped[len(THINK_START):]
        if self.in_reasoning:
            head, sep, tail = text.partition(THINK_END)
            if sep:
                self.in_reasoning, self.after_end = False, True
                return head, self._answer(tail)
            keep = 0 if final else _partial_suffix(text, THINK_END)
            self.pending = text[len(text) - keep:] if keep else ""
            return text[:len(text) - keep], ""
        return reasoning, content + self._answer(text)

    def _answer(self, text: str) -> str:
        """The answer's text, without the newlines that separate it from the thinking."""
        if self.after_end:
            text = text.lstrip("\n")
            self.after_end = not text
        return text


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished output."""
    stream = ReasoningStream(in_reasoning=in_reasoning)
    reasoning, content = stream.feed(text, final=True)
    had = in_reasoning or text.lstrip().startswith(THINK_START)
    return (reasoning if had else None), content


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
