"""Structured output on the host: grammars compiled by llguidance, one matcher per constrained sequence.

Why llguidance (measured with scripts/measure_grammar_backends.py on SmolLM2's 49k vocabulary, 2 CPU cores,
docs/benchmarks/grammar_backends_cpu.json): a JSON schema compiles in 0.4 ms on average against xgrammar's
33 ms, one row's mask plus the advance by one token takes 61 us against 293 us, and 64 rows' masks take
2.6 ms per step against 19.8 ms; and it is a single wheel with no dependencies, while xgrammar imports torch
(several GB with its CUDA libraries), which jaxinfer keeps out of its runtime.

`GrammarCache` (one per engine): `compile(structured)` checks and compiles a StructuredOutputs once per
distinct (kind, spec), keeping the compiled matcher as a template in a small LRU; `matcher(template)` is a
cheap deep copy for one sequence. A grammar that does not compile is an `InvalidInput` naming
`structured.<kind>`, raised at the door. `fill(rows, bitmask)` writes the allowed-token bitmask of every
constrained row ([S, ceil(V/32)] int32, bit v % 32 of word v // 32 set iff token v is allowed) in parallel
on llguidance's own threads, outside the GIL. The mask allows EOS exactly when the grammar accepts.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfer.errors import InvalidInput
from jaxinfer.structured import StructuredOutputs

CACHE_SIZE = 256  # compiled grammars kept (distinct schemas); a copy per request costs about a microsecond
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPECIAL_MARKER = b"\xff"  # llguidance's prefix for special tokens: never produced by text


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll: Any = None
        self._templates: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self.num_compiled = 0

    def _lib(self) -> Any:
        """llguidance and its tokenizer, built on first use (about 0.25 s for a 49k vocabulary)."""
        if self._ll is None:
            try:
                import llguidance
                import llguidance.numpy  # noqa: F401 - the bitmask helpers
            except ImportError:
                raise InvalidInput("structured output needs llguidance: pip install 'jaxinfer[serve]' (or llguidance).",
                                   field="structured") from None
            self._ll = llguidance
            self.ll_tokenizer = _ll_tokenizer(llguidance, self.tokenizer, self.vocab_size, self.eos_ids)
            self.executor = llguidance.LLExecutor()
        return self._ll

    def compile(self, structured: StructuredOutputs) -> Any:
        """The compiled template of `structured` (cached); InvalidInput naming structured.<kind> if it fails."""
        key = (structured.kind, structured.spec)
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            return template
        ll = self._lib()
        grammar = _grammar_text(ll, structured)
        template = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            field = "json" if structured.kind == "json_object" else structured.kind
            raise InvalidInput(f"SamplingParams.structured.{field} does not compile: {template.get_error()}",
                               field=f"structured.{field}", value=structured.spec[:200],
                               accepted="a grammar llguidance compiles")
        self.num_compiled += 1
        self._templates[key] = template
        if len(self._templates) > CACHE_SIZE:
            self._templates.popitem(last=False)
        return template

    def matcher(self, template: Any) -> Any:
        return template.deep_copy()

    def fill(self, rows: Sequence[tuple[Any, int]], bitmask: np.ndarray) -> None:
        """Write each (matcher, row) pair's allowed tokens into `bitmask` [S, W] int32 (C-contiguous)."""
        if rows:
            self._lib().numpy.fill_next_token_bitmask_par(self.executor, list(rows), bitmask)


def _grammar_text(ll: Any, s: StructuredOutputs) -> str:
    kind = s.kind
    if kind in ("json", "json_object"):
        return ll.LLMatcher.grammar_from_json_schema(s.spec, overrides=JSON_OPTIONS)
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(s.regex)
    if kind == "choice":
        return ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in s.choice))
    try:
        return ll.grammar_from("grammar", s.grammar)  # Lark, or llama.cpp's GBNF converted to Lark
    except ValueError as e:
        raise InvalidInput(f"SamplingParams.structured.grammar does not parse: {e}", field="structured.grammar",
                           value=s.grammar[:200], accepted="a Lark or GBNF grammar") from None


def _ll_tokenizer(ll: Any, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """llguidance's view of the model's tokenizer: HF `tokenizers` JSON when there is one (byte-level BPE),
    else every token's bytes (SentencePiece pieces, "<0xNN>" byte pieces, special tokens marked)."""
    backend = tokenizer.backend
    hf = getattr(backend, "tok", None)
    if hf is not None:
        return ll.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos_ids)
    return ll.LLTokenizer(ll.TokenizerWrapper(_BytesTokenizer(tokenizer, eos_ids)), n_vocab=vocab_size,
                          eos_token=eos_ids)


class _BytesTokenizer:
    """What llguidance.TokenizerWrapper reads: ids' bytes, special ids, BOS/EOS, and encode(text)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_ids[0] if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [_piece_bytes(tokenizer.convert_ids_to_tokens(i), i in special) for i in range(tokenizer.vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


def _piece_bytes(piece: str, special: bool) -> bytes:
    if special:
        return _SPECIAL_MARKER + piece.encode("utf-8")
    byte = _BYTE_PIECE.match(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
