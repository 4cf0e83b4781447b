"""IncrementalDetokenizer: streamed text equals tokenizer.decode, never shows half a character, and each
step decodes a bounded window. Runs on the two bundled tokenizers (byte-level BPE and SentencePiece with
byte fallback) and on a tiny SentencePiece vocabulary with a dummy prefix (the leading-space rule)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from jaxinfer.engine.detokenize import IncrementalDetokenizer
from jaxinfer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tiny_spm() -> Tokenizer:
    """Llama-2 style: dummy prefix (decode drops the first piece's space), byte fallback, <s>/</s>."""
    words = ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "bc", "▁abc", "▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array([0.0] * 259 + [-float(i) for i in range(len(words))], np.float32),
        "tokenizer.ggml.token_type": np.array([2, 3, 3] + [6] * 256 + [1] * len(words), np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
    }
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def tokenizers(smollm2: Tokenizer, gemma3: Tokenizer, tiny_spm: Tokenizer) -> dict[str, Tokenizer]:
    return {"smollm2": smollm2, "gemma3": gemma3, "tiny_spm": tiny_spm}


def stream(tok: Tokenizer, ids: Sequence[int], **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(i) for i in ids]
    tail = detok.finish()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """Ids that stand for single raw bytes (SentencePiece <0xNN> pieces, or 1-char byte-level tokens)."""
    tokens = tok.convert_ids_to_tokens(range(tok.vocab_size))
    byte_pieces = [i for i, t in enumerate(tokens) if len(t) == 6 and t.startswith("<0x") and t.endswith(">")]
    return byte_pieces or [i for i, t in enumerate(tokens) if len(t) == 1]


TEXTS = [
    "Hello world, how are you?",
    "日本語のテキストを分割します。我们今天去公园散步吧",
    "emoji 🙂🚀🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵🇧🇷 skin 👍🏽 ZWJ 🏳️‍🌈",
    "  indented\n\tcode();\r\n\n\n   trailing   ",
    "naïve café déjà vu — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "tiny_spm"])
def test_streams_natural_text_exactly(tokenizers: dict[str, Tokenizer], model: str) -> None:
    tok = tokenizers[model]
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, tail = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) and tail == ""
        assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(stream(tokenizers[model], tok.encode(TEXTS[0]))[0]) == TEXTS[0]


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "tiny_spm"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_id_sequences_match_decode(
    tokenizers: dict[str, Tokenizer], model: str, skip_special_tokens: bool
) -> None:
    """Random ids, biased towards raw-byte tokens (partial and invalid UTF-8) and special tokens."""
    tok = tokenizers[model]
    rng = random.Random(1234)
    byte_ids, special_ids = byte_token_ids(tok), sorted(tok.all_special_ids)
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            pool = byte_ids if r < 0.4 else special_ids if r < 0.5 else range(tok.vocab_size)
            ids.append(rng.choice(pool))
        pieces, tail = stream(tok, ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_multibyte_characters_are_held_until_complete(gemma3: Tokenizer, smollm2: Tokenizer) -> None:
    # "一" is E4 B8 80: three byte-fallback pieces, two of which alone are half a character.
    byte_ids = gemma3.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0x80>"])
    assert [p for p in stream(gemma3, byte_ids)[0]] == ["", "", "一"]
    # Byte-level BPE splits 🙂 (F0 9F 99 82) across tokens; nothing is shown until the last one.
    ids = smollm2.encode("a🙂")
    pieces, _ = stream(smollm2, ids)
    assert pieces[0] == "a" and pieces[-1] == "🙂" and set(pieces[1:-1]) <= {""} and len(ids) > 2


def test_unfinished_character_is_flushed_by_finish(gemma3: Tokenizer) -> None:
    ids = gemma3.encode("ok", add_special_tokens=False) + gemma3.convert_tokens_to_ids(["<0xF0>", "<0x9F>"])
    pieces, tail = stream(gemma3, ids)
    assert "".join(pieces) == "ok" and tail == gemma3.decode(ids)[2:] and tail.startswith(REPLACEMENT)


def test_leading_space_depends_on_previous_token(tiny_spm: Tokenizer) -> None:
    ab, abc = tiny_spm.convert_tokens_to_ids(["▁ab", "▁abc"])
    assert tiny_spm.decode([abc]) == "abc" and tiny_spm.decode([ab, abc]) == "ab abc"
    assert stream(tiny_spm, [ab, abc])[0] == ["ab", " abc"]
    # With the prompt as context the first generated token keeps its space; the prompt is not emitted.
    assert stream(tiny_spm, [abc], prompt_ids=[1, ab])[0] == [" abc"]
    assert stream(tiny_spm, [abc], prompt_ids=[1])[0] == ["abc"]


def test_prompt_context_with_real_tokenizers(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    for tok in (smollm2, gemma3):
        prompt = tok.encode("Say: ab")
        generated = tok.encode(" abc 日本 🙂 done", add_special_tokens=False)
        pieces, tail = stream(tok, generated, prompt_ids=prompt)
        full = tok.decode(prompt + generated)
        assert "".join(pieces) + tail == full[len(tok.decode(prompt)) :] == " abc 日本 🙂 done"


def test_special_tokens_are_skipped_or_shown(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert "".join(stream(smollm2, ids)[0]) == "assistant\nHi!"
    shown = stream(smollm2, ids, skip_special_tokens=False)[0]
    assert "".join(shown) == "<|im_start|>assistant\nHi!<|im_end|>" and shown[-1] == "<|im_end|>"


class _CountingTokenizer:
    """Forwards to a Tokenizer and records how many ids each decode call sees."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.all_special_ids = tok.all_special_ids
        self.decode_lengths: list[int] = []

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        return self.tok.check_ids(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_each_step_decodes_a_small_window(tokenizers: dict[str, Tokenizer], model: str) -> None:
    tok = tokenizers[model]
    ids = tok.encode(" ".join(TEXTS) * 20)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids=ids[:50])
    text = "".join(detok.push(i) for i in ids) + detok.finish()
    assert text == tok.decode(ids[:50] + ids)[len(tok.decode(ids[:50])) :]
    assert len(ids) > 1000 and max(counting.decode_lengths) <= 12


def test_ids_past_the_tokenizer_have_no_text_and_do_not_stop_the_stream(smollm2: Tokenizer) -> None:
    """A model whose embedding is wider than its tokenizer can sample an id the tokenizer does not have."""
    ids = smollm2.encode("Hello world, again")
    detok = IncrementalDetokenizer(smollm2)
    pieces = [detok.push(i) for i in [ids[0], smollm2.vocab_size + 7, *ids[1:]]]
    assert pieces[1] == "" and "".join(pieces) + detok.finish() == smollm2.decode(ids)
