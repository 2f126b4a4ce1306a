"""The forms in which bench/affinity.py sends a conversation, as producers do: each turn's request is
the previous turn's prompt, its answer and the next user text.

  messages  the chat as `messages` (the gateway's chat completions);
  prompt    plain text: the system prompt on the first line, then `User: ...` and `Assistant:` lines,
            each answer as the model continued the prompt (the gateway's completions);
  template  Qwen3's chat format written by the producer as text (<|im_start|>role ... <|im_end|>);
  ids       the plain text as token ids, grown as a client that keeps ids grows them: the answer's
            ids, then the next user text's, appended (no chat markers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producer_client.schema import JobResult

FORMS = ("messages", "prompt", "template", "ids")


class Transcript(ABC):
    """One conversation in one form."""

    @abstractmethod
    def ask(self, user: str) -> dict[str, Any]:
        """The request fields of the next turn, whose user text is `user`."""

    @abstractmethod
    def answer(self, result: JobResult) -> None:
        """The turn's answer goes into the history of the next."""


class MessagesTranscript(Transcript):
    def __init__(self, system: str):
        self.history = [{"role": "system", "content": system}] if system else []

    def ask(self, user: str) -> dict[str, Any]:
        self.history.append({"role": "user", "content": user})
        return {"messages": list(self.history), "enable_thinking": False}

    def answer(self, result: JobResult) -> None:
        self.history.append({"role": "assistant", "content": result.text})


@dataclass(frozen=True)
class TextFormat:
    """How a text form writes the system prompt, a user turn (up to where the model answers) and
    what follows an answer."""

    system: str
    user: str
    after_answer: str


PLAIN = TextFormat("{}\n", "User: {}\nAssistant:", "\n")
QWEN3_CHAT = TextFormat(
    "<|im_start|>system\n{}<|im_end|>\n", "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\n"
)


class TextTranscript(Transcript):
    def __init__(self, system: str, form: TextFormat):
        self.form = form
        self.text = form.system.format(system) if system else ""

    def ask(self, user: str) -> dict[str, Any]:
        self.text += self.form.user.format(user)
        return {"prompt": self.text}

    def answer(self, result: JobResult) -> None:
        self.text += result.text + self.form.after_answer


class IdsTranscript(Transcript):
    def __init__(self, system: str, encode: Callable[[str], list[int]]):
        self.encode = encode
        self.ids = encode(PLAIN.system.format(system)) if system else []

    def ask(self, user: str) -> dict[str, Any]:
        self.ids += self.encode(PLAIN.user.format(user))
        return {"input_ids": list(self.ids)}

    def answer(self, result: JobResult) -> None:
        self.ids += result.token_ids + self.encode(PLAIN.after_answer)


def transcript(form: str, system: str, encode: Callable[[str], list[int]] | None) -> Transcript:
    """A new conversation in `form` (one of FORMS); `encode` (text to token ids) for the ids form."""
    if form == "messages":
        return MessagesTranscript(system)
    if form == "prompt":
        return TextTranscript(system, PLAIN)
    if form == "template":
        return TextTranscript(system, QWEN3_CHAT)
    if form == "ids" and encode is not None:
        return IdsTranscript(system, encode)
    raise ValueError(f"unknown form {form!r}, or no tokenizer for ids")
