"""The conversation of ``aiayn generate RUN_DIR --chat -``: user messages read from a stream, one a
line, each answered with the whole conversation so far laid out by the chat template.

A line is a user message (surrounding whitespace stripped; blank lines skipped) or a command:
``/reset`` forgets the turns so far (the ``--system`` message stays), ``/exit`` ends the
conversation, as the end of the stream does. Each message joins the conversation (after the system
message, if any); the conversation's ids (``encode``: the template's layout ending with the opening
of the assistant's turn, as ``apply_chat_template(messages, add_generation_prompt=True)``) are
answered by ``respond``, which prints the reply, and the reply joins the conversation as an
``assistant`` message for the turns that follow.

Longer than the context, the conversation drops its oldest turns (a user message and its reply), one
at a time, never the system message nor the newest message, until it fits; dropped turns stay
dropped, and a warning on stderr says how many went. A newest message that does not fit even alone
(with the system message) keeps the last ``context`` ids, with a warning, as a ``--prompt`` does.

The loop knows nothing of models: ``encode`` and ``respond`` come from ``aiayn.commands.generate``.
"""

from __future__ import annotations

import sys
from typing import IO, Callable, Iterator, TextIO

EXIT, RESET = "/exit", "/reset"
MARKER = "> "  # written to the marker stream (stderr at a terminal) before each line is read

Messages = list[dict[str, str]]


class Conversation:
    """The system message (or None) and the turns since the start or the last ``/reset``, oldest
    first, each a user message and the reply to it."""

    def __init__(self, system: str | None):
        self.system = system
        self.turns: list[tuple[str, str]] = []

    def messages(self, message: str) -> Messages:
        """The conversation with ``message`` as its newest user message."""
        laid_out = [{"role": "system", "content": self.system}] if self.system else []
        for user, reply in self.turns:
            laid_out += [{"role": "user", "content": user},
                         {"role": "assistant", "content": reply}]
        return laid_out + [{"role": "user", "content": message}]


def fit(conversation: Conversation, message: str, encode: Callable[[Messages], list[int]],
        context: int) -> list[int]:
    """The ids of the conversation with ``message`` as its newest message, at most ``context`` of
    them: the oldest turns dropped from ``conversation`` until it fits, else the last ``context``
    ids kept (warnings on stderr either way)."""
    ids = encode(conversation.messages(message))
    longest, dropped = len(ids), 0
    while len(ids) > context and conversation.turns:
        del conversation.turns[0]
        dropped += 1
        ids = encode(conversation.messages(message))
    if dropped:
        print(f"aiayn generate: warning: the conversation has {longest} tokens, more than the "
              f"context of {context} allows; dropped its {dropped} oldest "
              f"turn{'s' if dropped > 1 else ''}", file=sys.stderr)
    if len(ids) > context:
        print(f"aiayn generate: warning: the message has {len(ids)} tokens with the chat "
              f"template, more than the context of {context} allows; keeping its last {context}",
              file=sys.stderr)
        ids = ids[-context:]
    return ids


def lines(stream: IO, marker: TextIO | None) -> Iterator[str]:
    """The non-blank lines of ``stream`` (bytes, as ``sys.stdin.buffer``, or text), stripped;
    ``MARKER`` written to ``marker`` (if given) before each read. As every command reads stdin:
    a leading byte-order mark is dropped, and a line that is not UTF-8 is a ValueError naming
    it."""
    from aiayn.data.text_files import decode_lines

    def raw_lines() -> Iterator[bytes]:
        while True:
            if marker is not None:
                marker.write(MARKER)
                marker.flush()
            line = stream.readline()
            if not line:
                if marker is not None:  # the shell's prompt starts on a line of its own
                    marker.write("\n")
                return
            yield line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line

    for _, line in decode_lines(raw_lines(), "stdin"):
        if line.strip():
            yield line.strip()


def converse(stream: IO, *, system: str | None, encode: Callable[[Messages], list[int]],
             respond: Callable[[list[int]], str], context: int,
             marker: TextIO | None = None, on_reset: Callable[[], None] | None = None) -> None:
    """Answer the messages of ``stream`` until ``/exit`` or its end.

    Args:
        system: the system message that opens the conversation (None: the template's default).
        encode: the ids of a conversation, ending with the opening of the assistant's turn.
        respond: prints the reply to a conversation's ids and returns its text.
        context: the most ids ``respond`` takes.
        marker: where ``MARKER`` asks for each line (None: nowhere, e.g. when piped).
        on_reset: called at ``/reset`` (e.g. to drop the cached keys of the turns forgotten).
    """
    conversation = Conversation(system)
    for message in lines(stream, marker):
        if message == EXIT:
            return
        if message == RESET:
            conversation.turns.clear()
            if on_reset is not None:
                on_reset()
            continue
        reply = respond(fit(conversation, message, encode, context))
        conversation.turns.append((message, reply))
