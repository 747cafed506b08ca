"""Streamed text of a thinking-mode answer split into ``reasoning_content`` and ``content``.

``ReasoningSplitter`` takes the text deltas of one answer and gives back (reasoning, content)
deltas whose concatenations equal ``split_reasoning`` of the whole text, however the text was cut
(an answer that continues a prefix starts in its reasoning or its content instead):
a leading ``<think>`` is dropped, the reasoning runs up to the first ``</think>`` and the content
is everything after it. A delta that may be the start of either tag is held back until the next
one decides it (or ``finish`` releases it as reasoning, as ``split_reasoning`` would).
"""

from __future__ import annotations

from dsv4ray.text.chat_encoding import THINK_END, THINK_START


class ReasoningSplitter:
    def __init__(self, state: str = "start") -> None:
        """state: "start" (a leading <think> may still come), "reasoning" or "content" (an
        answer that continues a prefix: text/chat_encoding.prefix_state)."""
        self._state = state
        self._held = ""  # text that may be part of a tag, not yet given back

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer -> (reasoning, content), as its deltas would give them."""
        reasoning, content = self.push(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content

    def push(self, text: str) -> tuple[str, str]:
        """The next text delta -> (reasoning delta, content delta)."""
        if self._state == "content":
            return "", text
        held = self._held + text
        if self._state == "start":
            if len(held) < len(THINK_START) and THINK_START.startswith(held):
                self._held = held
                return "", ""
            if held.startswith(THINK_START):
                held = held[len(THINK_START) :]
            self._state = "reasoning"
        reasoning, found, content = held.partition(THINK_END)
        if found:
            self._state, self._held = "content", ""
            return reasoning, content
        num_held = _tag_prefix_len(held, THINK_END)
        self._held = held[len(held) - num_held :]
        return held[: len(held) - num_held], ""

    def finish(self) -> tuple[str, str]:
        """The end of the answer: what is still held back is reasoning (no tag completed it)."""
        held, self._held = self._held, ""
        return ("", held) if self._state == "content" else (held, "")


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
