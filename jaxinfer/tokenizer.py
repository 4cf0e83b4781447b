"""One Tokenizer for every checkpoint format: GGUF vocabularies, HF `tokenizer.json`, SentencePiece models.

Two backends do the actual work, both native libraries:
  * `tokenizers.Tokenizer` (HF) for byte-level BPE (GGUF `gpt2` vocabularies, built in memory from
    tokens + merges) and for any `tokenizer.json`;
  * `sentencepiece.SentencePieceProcessor` for SentencePiece vocabularies (GGUF `llama`, built in memory as
    a ModelProto from tokens + scores + token types) and for `tokenizer.model` files.

`Tokenizer` adds what the libraries leave to the caller: BOS/EOS exactly as the checkpoint declares,
special-token ids, id-range checks, and chat templates rendered the way HF transformers renders them.

Conventions (chosen to match HF transformers on the same checkpoint):
  * `encode(text, add_special_tokens=True)` recognizes special tokens written in the text (e.g. "<bos>")
    and prepends BOS / appends EOS only when the checkpoint asks for it (`add_bos_token` / `add_eos_token`).
  * `decode(ids, skip_special_tokens=True)` drops special ids first, then decodes; no
    "clean up tokenization spaces" pass, so decoding is a pure function of the surviving ids.
  * `eos_token_ids` is every id that ends a generation: the declared EOS, the generation config's list
    when there is one, GGUF `eot`/`eom` ids, and the end-of-turn markers of well-known chat formats that
    are special tokens of this vocabulary (Gemma's "<end_of_turn>", Llama 3's "<|eot_id|>", ...): a chat
    model stops at the end of its turn even where the GGUF carries no generation config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
import sentencepiece as spm
from jinja2.sandbox import ImmutableSandboxedEnvironment
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxinfer.checkpoint.gguf_metadata import read_gguf_metadata

__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer"]

# GGUF token types; the numbering is SentencePiece's ModelProto.SentencePiece.Type.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# GGUF `tokenizer.ggml.pre` -> the regexes (applied in order) that split text before byte-level BPE.
# These are the splits of the original HF tokenizers; "smollm" first isolates every digit.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}
# Llama 3 style vocabularies contain whole words that the merge list alone would not build; their
# tokenizer.json sets ignore_merges so such words map straight to their id.
_IGNORE_MERGES_PRE = frozenset({"llama-bpe"})
# Qwen2's tokenizer.json NFC-normalizes text before splitting.
_NFC_PRE = frozenset({"qwen2"})

# End-of-turn markers of common chat formats; counted as EOS when they are special tokens of the vocab.
_END_OF_TURN_MARKERS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>")


class TokenizerError(ValueError):
    """Bad tokenizer files, unsupported tokenizer types, or ids outside the vocabulary."""


class _Backend(Protocol):
    """What Tokenizer needs from a library: plain encode/decode without BOS/EOS handling."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def special_ids(self) -> frozenset[int]: ...

    def save_model(self, directory: Path) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Backends.
# ---------------------------------------------------------------------------------------------------------


class _HFBackend:
    """HF `tokenizers` engine; special tokens in text are matched by its added-token vocabulary."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def save_model(self, directory: Path) -> None:
        self.tok.save(str(directory / "tokenizer.json"))


class _SPMBackend:
    """SentencePiece engine plus special-token handling, which SentencePiece itself does not do.

    SentencePiece never matches control pieces ("<bos>", "<start_of_turn>") in text and decodes them to
    "". HF treats them as special tokens: written in text they map to their id, and with
    skip_special_tokens=False they decode to their text. Both are done here by splitting at them.
    """

    def __init__(self, proto: sp_pb2.ModelProto) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.vocab_size = self.sp.get_piece_size()
        special_types = (TOKEN_CONTROL, TOKEN_UNKNOWN)
        self.special = frozenset(i for i, p in enumerate(proto.pieces) if p.type in special_types)
        self._splitter = _SpecialSplitter({self.sp.id_to_piece(i): i for i in self.special})
        # With a dummy prefix ("▁" prepended to the text), SentencePiece's decode drops the first piece's
        # leading space again. Only the start of the text gets the prefix (HF's "first" prepend scheme), so
        # text after a special token is encoded by a twin processor without it.
        self._strips_leading_space = bool(proto.normalizer_spec.add_dummy_prefix)
        self._mid = self.sp
        if self._strips_leading_space:
            proto.normalizer_spec.add_dummy_prefix = False
            self._mid = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
            proto.normalizer_spec.add_dummy_prefix = True

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for start, segment, special_id in self._splitter.split(text):
            if special_id is not None:
                ids.append(special_id)
            else:
                ids.extend((self.sp if start == 0 else self._mid).encode(segment))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for run, is_special in _runs(ids, self.special):
            if is_special:
                out.extend(self.sp.id_to_piece(i) for i in run)
                continue
            text = self.sp.decode(run)
            # Mid-text the space SentencePiece dropped from the run's first piece is a real one.
            if out and self._strips_leading_space and self.sp.id_to_piece(run[0]).startswith("\u2581"):
                text = " " + text
            out.append(text)
        return "".join(out)

    def id_to_token(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.sp.piece_to_id(token)
        return None if token_id == self.sp.unk_id() and token != self.sp.id_to_piece(token_id) else token_id

    def special_ids(self) -> frozenset[int]:
        return self.special

    def save_model(self, directory: Path) -> None:
        (directory / "tokenizer.model").write_bytes(self.sp.serialized_model_proto())


class _SpecialSplitter:
    """Cuts special-token strings out of text, longest match first.

    A regex alternation of thousands of literals (Gemma has 6k "<unusedN>" controls) takes over a second to
    compile; instead a small character class finds where a special could start and a dict lookup per
    distinct special length confirms it.
    """

    def __init__(self, specials: Mapping[str, int]) -> None:
        self.ids = dict(specials)
        self.lengths = sorted({len(s) for s in self.ids}, reverse=True)
        starts = sorted({s[0] for s in self.ids})
        self.starts = re.compile("[" + "".join(map(re.escape, starts)) + "]") if starts else None

    def _match_at(self, text: str, pos: int) -> str | None:
        for n in self.lengths:
            if text[pos : pos + n] in self.ids:
                return text[pos : pos + n]
        return None

    def split(self, text: str) -> Iterator[tuple[int, str, int | None]]:
        """Yield (start offset, text, special id or None) pieces of `text`, specials cut out."""
        done, pos = 0, 0
        while self.starts is not None and (m := self.starts.search(text, pos)):
            special = self._match_at(text, m.start())
            if special is None:
                pos = m.start() + 1
                continue
            if m.start() > done:
                yield done, text[done : m.start()], None
            yield m.start(), special, self.ids[special]
            done = pos = m.start() + len(special)
        if done < len(text):
            yield done, text[done:], None


def _runs(ids: Sequence[int], special: frozenset[int]) -> Iterator[tuple[list[int], bool]]:
    """Maximal runs of ids that are all special or all not."""
    run: list[int] = []
    for i in ids:
        if run and ((i in special) != (run[0] in special)):
            yield run, run[0] in special
            run = []
        run.append(i)
    if run:
        yield run, run[0] in special


# ---------------------------------------------------------------------------------------------------------
# Chat templates.
# ---------------------------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's tojson: unlike jinja's built-in it keeps non-ASCII text as is and does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """Sandboxed environment configured like transformers' so renders are byte-identical to HF's."""
    if source not in _TEMPLATE_CACHE:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


# ---------------------------------------------------------------------------------------------------------
# The Tokenizer.
# ---------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode text, expose the special ids, render chat templates. Build with `load_tokenizer`."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        extra_eos_token_ids: Sequence[int] = (),
        special_token_ids: frozenset[int] = frozenset(),
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = bool(add_bos_token and bos_token_id is not None)
        self.add_eos_token = bool(add_eos_token and eos_token_id is not None)
        declared = [eos_token_id, *extra_eos_token_ids]
        self.eos_token_ids: frozenset[int] = frozenset(i for i in declared if i is not None)
        self.all_special_ids: frozenset[int] = frozenset(special_token_ids) | {
            i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None
        }
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def backend(self) -> _Backend:
        """The engine underneath (HF `tokenizers` or SentencePiece), for adapters that need its own form
        (structured output hands llguidance the HF tokenizer's JSON)."""
        return self._backend

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_text(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized either way."""
        ids = self._backend.encode(text)
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_id)
        return ids

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as a list of Python ints; ValueError naming the first id outside [0, vocab_size)."""
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (vocab_size={self.vocab_size}).")
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = self.check_ids(ids)
        if skip_special_tokens:
            out = [i for i in out if i not in self.all_special_ids]
        return self._backend.decode(out) if out else ""

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, (int, np.integer)):
            return self._backend.id_to_token(self.check_ids([ids])[0])
        return [self._backend.id_to_token(i) for i in self.check_ids(ids)]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` with the checkpoint's (or the given) Jinja chat template, like HF does.

        With tokenize=True the rendered text is encoded without adding special tokens (the template writes
        its own), except that BOS is prepended when the checkpoint adds BOS and the template did not.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise TokenizerError("this tokenizer has no chat_template; pass chat_template=... explicitly.")
        variables = {k: v for k, v in self._template_tokens().items() if v is not None}
        variables.update(extra)
        text = _compile_template(source).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _template_tokens(self) -> dict[str, str | None]:
        return {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self._token_text(self.pad_token_id),
            "unk_token": self._token_text(self.unk_token_id),
        }

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json or tokenizer.model plus the HF-style configs that `load_tokenizer` reads back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save_model(directory)
        config = {k: v for k, v in self._template_tokens().items() if v is not None}
        config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        generation = {"bos_token_id": self.bos_token_id, "eos_token_id": sorted(self.eos_token_ids)}
        for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
            (directory / name).write_text(json.dumps(content, indent=1, ensure_ascii=False), encoding="utf-8")
        return directory

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from the `tokenizer.*` fields of a GGUF header (as read by `read_gguf_metadata`)."""
        return _tokenizer_from_gguf(metadata)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)}, "
            f"add_bos_token={self.add_bos_token}, chat_template={'yes' if self.chat_template else 'no'})"
        )


# ---------------------------------------------------------------------------------------------------------
# GGUF.
# ---------------------------------------------------------------------------------------------------------


def _gguf_field(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise TokenizerError(f"GGUF metadata has no '{key}' field, which this tokenizer type requires.")
    return meta[key]


def _gguf_token_types(meta: Mapping[str, Any], n: int) -> np.ndarray:
    types = meta.get("tokenizer.ggml.token_type")
    types = np.full(n, TOKEN_NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(types) != n:
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries but the vocabulary has {n}.")
    return types


def _gguf_bpe_backend(meta: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> _HFBackend:
    """Byte-level BPE (GGUF model "gpt2") assembled in memory with HF tokenizers."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise TokenizerError(
            f"tokenizer.ggml.pre '{pre}' is not supported (supported: {', '.join(sorted(_PRE_SPLITS))})."
        )
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(meta, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[pre]]
    # The splits are done above, so ByteLevel only maps bytes to its printable alphabet.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    if pre in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    _add_gguf_added_tokens(tok, tokens, types)
    return _HFBackend(tok)


def _add_gguf_added_tokens(tok: HFTokenizer, tokens: list[str], types: np.ndarray) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched in text)."""
    def added(kind: int, special: bool) -> list[AddedToken]:
        return [AddedToken(tokens[i], special=special, normalized=False) for i in np.flatnonzero(types == kind)]

    tok.add_special_tokens(added(TOKEN_CONTROL, special=True))
    tok.add_tokens(added(TOKEN_USER_DEFINED, special=False))


def _gguf_spm_proto(meta: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> sp_pb2.ModelProto:
    """A SentencePiece BPE model equivalent to the GGUF "llama" vocabulary (tokens, scores, types)."""
    scores = meta.get("tokenizer.ggml.scores")
    scores = np.zeros(len(tokens), np.float32) if scores is None else np.asarray(scores, np.float32)
    if len(scores) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries but the vocabulary has {len(tokens)}.")
    proto = sp_pb2.ModelProto()
    trainer = proto.trainer_spec
    trainer.model_type = sp_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = bool((types == TOKEN_BYTE).any())
    for name, key in (("unk", "unknown"), ("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = int(meta.get(f"tokenizer.ggml.{key}_token_id", -1))
        setattr(trainer, f"{name}_id", token_id)
        # SentencePiece looks these ids up by piece text, so the text must be the vocabulary's.
        if 0 <= token_id < len(tokens):
            setattr(trainer, f"{name}_piece", tokens[token_id])
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    types = types.copy()
    if trainer.unk_id >= 0:
        types[trainer.unk_id] = TOKEN_UNKNOWN  # SentencePiece keys its unknown handling on the piece type
    _fill_spm_pieces(proto, tokens, scores.tolist(), types.tolist())
    return proto


def _fill_spm_pieces(proto: sp_pb2.ModelProto, tokens: list[str], scores: list[float], types: list[int]) -> None:
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        # llama.cpp's converter writes the spaces of user-defined pieces as " "; SentencePiece matches
        # them after escaping whitespace to U+2581, so restore that form.
        piece.piece = token.replace(" ", "\u2581") if kind == TOKEN_USER_DEFINED else token
        piece.score = score
        piece.type = kind if kind in (1, 2, 3, 4, 5, 6) else TOKEN_NORMAL


def _gguf_eos_ids(meta: Mapping[str, Any], backend: _Backend, special: frozenset[int]) -> list[int]:
    ids = [meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
    return [i for i in ids if i is not None] + _marker_eos_ids(backend, special)


def _marker_eos_ids(backend: _Backend, special: frozenset[int]) -> list[int]:
    ids = (backend.token_to_id(marker) for marker in _END_OF_TURN_MARKERS)
    return [i for i in ids if i is not None and i in special]


def _tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    kind = _gguf_field(meta, "tokenizer.ggml.model")
    tokens = list(_gguf_field(meta, "tokenizer.ggml.tokens"))
    if not tokens:
        raise TokenizerError("tokenizer.ggml.tokens is empty; the GGUF has no vocabulary.")
    types = _gguf_token_types(meta, len(tokens))
    if kind == "gpt2":
        backend: _HFBackend | _SPMBackend = _gguf_bpe_backend(meta, tokens, types)
    elif kind == "llama":
        backend = _SPMBackend(_gguf_spm_proto(meta, tokens, types))
    else:
        raise TokenizerError(f"tokenizer.ggml.model '{kind}' is not supported (supported: 'gpt2', 'llama').")
    special = backend.special_ids()
    return Tokenizer(
        backend,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        # llama.cpp's defaults when the flag is absent: SentencePiece vocabularies add BOS, BPE ones do not.
        add_bos_token=meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
        extra_eos_token_ids=_gguf_eos_ids(meta, backend, special),
        special_token_ids=special,
        chat_template=meta.get("tokenizer.chat_template"),
    )


# ---------------------------------------------------------------------------------------------------------
# HF directories, tokenizer.json, tokenizer.model.
# ---------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}).") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config / special_tokens_map give tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _config_token_id(backend: _Backend, configs: Sequence[Mapping[str, Any]], name: str) -> int | None:
    for config in configs:
        content = _token_content(config.get(name))
        if content is not None:
            return backend.token_to_id(content)
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _spm_backend_from_file(path: Path) -> _SPMBackend:
    proto = sp_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf raises its own DecodeError hierarchy
        raise TokenizerError(f"{path} is not a SentencePiece model file ({e}).") from None
    if not proto.pieces:
        raise TokenizerError(f"{path} holds no vocabulary pieces.")
    return _SPMBackend(proto)


def _spm_declared_ids(backend: _SPMBackend) -> dict[str, int | None]:
    sp = backend.sp
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
    return {k: (v if v >= 0 else None) for k, v in ids.items()}


def _hf_backend_from_file(path: Path) -> _HFBackend:
    try:
        return _HFBackend(HFTokenizer.from_file(str(path)))
    except Exception as e:  # tokenizers raises a bare Exception subclass on parse errors
        raise TokenizerError(f"{path} is not a valid tokenizer.json ({e}).") from None


def _post_processor_adds(tok: HFTokenizer, token_id: int | None, at_start: bool) -> bool:
    """Whether tokenizer.json's own post-processor adds `token_id` around the text (its BOS/EOS policy)."""
    if token_id is None:
        return False
    ids = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    if len(ids) == len(plain):
        return False
    return (ids[0] == token_id) if at_start else (ids[-1] == token_id)


def _template_from_dir(folder: Path, config: Mapping[str, Any]) -> str | None:
    """Newer HF checkpoints keep the template in chat_template.jinja; older ones in tokenizer_config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _tokenizer_from_files(folder: Path, tokenizer_file: Path) -> Tokenizer:
    config = _read_json(folder / "tokenizer_config.json")
    configs = [config, _read_json(folder / "special_tokens_map.json")]
    generation = _read_json(folder / "generation_config.json")
    if tokenizer_file.suffix == ".json":
        backend: _HFBackend | _SPMBackend = _hf_backend_from_file(tokenizer_file)
        declared: dict[str, int | None] = {}
    else:
        backend = _spm_backend_from_file(tokenizer_file)
        declared = _spm_declared_ids(backend)
    ids = {k: _config_token_id(backend, configs, f"{k}_token") for k in ("bos", "eos", "pad", "unk")}
    ids = {k: v if v is not None else declared.get(k) for k, v in ids.items()}
    generation_eos = _as_id_list(generation.get("eos_token_id"))
    if ids["eos"] is None and generation_eos:
        ids["eos"] = generation_eos[0]
    special = backend.special_ids()
    add_bos, add_eos = _add_special_flags(backend, config, ids)
    return Tokenizer(
        backend,
        bos_token_id=ids["bos"] if ids["bos"] is not None else generation.get("bos_token_id"),
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        unk_token_id=ids["unk"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        extra_eos_token_ids=generation_eos + _marker_eos_ids(backend, special),
        special_token_ids=special,
        chat_template=_template_from_dir(folder, config),
    )


def _add_special_flags(
    backend: _Backend, config: Mapping[str, Any], ids: Mapping[str, int | None]
) -> tuple[bool, bool]:
    """tokenizer_config's add_bos_token/add_eos_token win; otherwise tokenizer.json's post-processor
    decides, and a bare SentencePiece model adds BOS (the Llama/Gemma convention HF follows)."""
    if isinstance(backend, _HFBackend):
        default_bos = _post_processor_adds(backend.tok, ids["bos"], at_start=True)
        default_eos = _post_processor_adds(backend.tok, ids["eos"], at_start=False)
    else:
        default_bos, default_eos = True, False
    return bool(config.get("add_bos_token", default_bos)), bool(config.get("add_eos_token", default_eos))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A Tokenizer from a .gguf file, an HF checkpoint directory, a tokenizer.json or a tokenizer.model."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return _tokenizer_from_files(path, path / name)
        raise TokenizerError(f"{path} holds neither tokenizer.json nor tokenizer.model.")
    if not path.is_file():
        raise TokenizerError(f"tokenizer path {path} does not exist.")
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    if path.suffix in (".json", ".model"):
        return _tokenizer_from_files(path.parent, path)
    raise TokenizerError(f"{path}: expected a .gguf, tokenizer.json or tokenizer.model file, or a directory.")
