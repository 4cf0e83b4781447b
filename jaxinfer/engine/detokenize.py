"""Streaming detokenization: turn generated token ids into text as they arrive, one token at a time.

Decoding each token on its own is wrong in two ways:
  * one character can span several tokens (byte-fallback pieces "<0xE4><0xB8><0x80>", or byte-level BPE
    tokens that each hold part of an emoji's UTF-8 bytes); a lone part decodes to U+FFFD;
  * a token's text can depend on the token before it (SentencePiece drops the dummy-prefix space of the
    first piece it decodes, so "▁world" alone is "world" but " world" after "Hello").

So the detokenizer decodes a short window instead: the *context* (the tokens of the last emitted chunk)
plus the *pending* tokens not yet emitted. The new text is the window's text minus the context's text; the
context absorbs the first-piece rules because both decodes start with the same token. While the window's
text ends in U+FFFD the pending tokens may still be the start of a character, so nothing is emitted; once
it does not, the text is final and the window slides forward. Each step decodes O(window) tokens, not
the whole sequence.

Invariant (tested on random id sequences): "".join(pushes) + finish() == tokenizer.decode(all ids).
`finish()` exists because a sequence may end in the middle of a character (or in a genuine U+FFFD), which
no push may emit early. A run of k undecodable bytes in a row keeps k tokens pending (O(k) per step); that
only happens for garbage ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as the initial context. One token settles the first-piece space rule; the rest cover
# a prompt that ends partway through a multi-byte character (at most 3 trailing bytes).
_PROMPT_CONTEXT_TOKENS = 6


class _Decoder(Protocol):
    """The part of jaxinfer.tokenizer.Tokenizer this module uses."""

    all_special_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def check_ids(self, ids: Sequence[int]) -> list[int]: ...


class IncrementalDetokenizer:
    """Feed token ids with `push`; each call returns only the text that became final with that token.

    `prompt_ids` (optional) only provide context so the first generated token decodes as it would after
    the prompt (e.g. keeps its leading space); the prompt's own text is not emitted, except for a
    character the prompt leaves unfinished, which is emitted whole once generation completes it. Special
    tokens are dropped when `skip_special_tokens` is true, exactly as `tokenizer.decode` drops them.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        context = [i for i in tokenizer.check_ids(prompt_ids or ()) if i not in self._skipped]
        # self._ids[:self._read] is the context, self._ids[self._read:] the pending tokens.
        self._ids: list[int] = context[-_PROMPT_CONTEXT_TOKENS:]
        self._read = self._final_prefix_len(self._ids)
        self._context_text = self._decode(self._ids[: self._read])
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (by push and finish)."""
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly final text ("" while a character is incomplete).

        An id past the tokenizer's vocabulary has no text and is passed over like a skipped special token:
        a model's embedding may be padded beyond its tokenizer (or serve one made for a smaller vocabulary),
        and one such sample must not cost the request the rest of its output."""
        try:
            (token_id,) = self._tokenizer.check_ids([token_id])
        except ValueError:
            return ""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        window_text = self._decode(self._ids)
        if window_text.endswith(_REPLACEMENT):
            return ""
        new_text = window_text[len(self._context_text) :]
        # The emitted chunk becomes the next context; older tokens are no longer needed.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return self._emit(new_text)

    def extend(self, token_ids: Iterable[int]) -> str:
        """Push several tokens; return the concatenated new text."""
        return "".join(self.push(i) for i in token_ids)

    def finish(self) -> str:
        """Emit whatever is still held back (an unfinished character decodes to U+FFFD, as in decode)."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids)[len(self._context_text) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        if new_text:
            self._chunks.append(new_text)
        return new_text

    def _decode(self, ids: Sequence[int]) -> str:
        # Skipped ids were filtered on the way in; whatever is left is decoded verbatim.
        return self._tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def _final_prefix_len(self, ids: Sequence[int]) -> int:
        """Longest prefix of the prompt context whose text is final (does not end inside a character)."""
        end = len(ids)
        while end > 0 and self._decode(ids[:end]).endswith(_REPLACEMENT):
            end -= 1
        return end
