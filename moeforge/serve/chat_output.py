"""A chat choice's output text split into what the API returns apart: reasoning, content and tool calls.

The thinking comes first (``reasoning.py``), then the answer, whose tool-call block (``tool_calls.py``) becomes
``tool_calls``. One object per choice; ``feed`` per streamed delta, or ``finish`` once on the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeforge.serve.reasoning import ReasoningStream, split_reasoning
from moeforge.serve.tool_calls import CallDelta, ParsedCall, ToolCallFormat, ToolCallStream, parse_tool_calls


@dataclass(frozen=True)
class ChatOutputOptions:
    """How a request's output is read: ``tool_format`` None parses no calls; ``reasoning``: the template has
    thinking markers; ``in_reasoning``: its prompt opened the thinking."""

    tool_format: ToolCallFormat | None = None
    reasoning: bool = False
    in_reasoning: bool = False


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ChatOutputStream:
    options: ChatOutputOptions
    reasoning: ReasoningStream | None = None
    tools: ToolCallStream | None = None

    def __post_init__(self) -> None:
        if self.options.reasoning:
            self.reasoning = ReasoningStream(in_reasoning=self.options.in_reasoning)
        if self.options.tool_format is not None:
            self.tools = ToolCallStream(self.options.tool_format)

    @property
    def called(self) -> bool:
        """Some tool call has been sent."""
        return self.tools is not None and self.tools.calls_sent > 0

    def feed(self, delta: str, final: bool) -> ChatDelta:
        reasoning, content = self.reasoning.feed(delta, final) if self.reasoning is not None else ("", delta)
        if self.tools is None:
            return ChatDelta(reasoning, content)
        content, calls = self.tools.feed(content, final)
        return ChatDelta(reasoning, content, calls)


def split_chat_output(text: str, options: ChatOutputOptions) -> tuple[str | None, str, list[ParsedCall]]:
    """(reasoning or None, content, tool calls) of a finished output."""
    reasoning: str | None = None
    if options.reasoning:
        reasoning, text = split_reasoning(text, options.in_reasoning)
    if options.tool_format is None:
        return reasoning, text, []
    content, calls = parse_tool_calls(options.tool_format, text)
    return reasoning, content, calls
