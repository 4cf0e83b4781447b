"""Tokenizer and GGUF metadata tests on the two bundled checkpoints (SmolLM2: GGUF byte-level BPE, no BOS;
Gemma 3: GGUF SentencePiece vocabulary, BOS) plus small synthetic files for the error paths.

HF parity: the golden files from scripts/make_golden.py are compared case by case when present; a few
ids checked once against HF transformers (AutoTokenizer.from_pretrained(folder, gguf_file=...)) are pinned
below so the parity check runs even before the golden files exist.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
from jinja2.sandbox import SecurityError

from jaxinfer.checkpoint.gguf_metadata import GGUFMetadataError, read_gguf_metadata
from jaxinfer.tokenizer import Tokenizer, TokenizerError, load_tokenizer

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_FILES = {"smollm2": "smollm2-135m-instruct.json", "gemma3": "gemma3-270m.json"}


# ---------------------------------------------------------------------------------------------------------
# Fixtures.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(smollm2: Tokenizer, gemma3: Tokenizer) -> dict[str, Tokenizer]:
    return {"smollm2": smollm2, "gemma3": gemma3}


def _golden_tokenizer_section(model: str) -> dict | None:
    path = GOLDEN_DIR / GOLDEN_FILES[model]
    return json.loads(path.read_text(encoding="utf-8"))["tokenizer"] if path.is_file() else None


def _golden_params(section_key: str) -> list:
    """One param per golden case (read at collection time), or one skipped param when the file is absent."""
    params = []
    for model in GOLDEN_FILES:
        section = _golden_tokenizer_section(model)
        if section is None:
            params.append(pytest.param(model, None, marks=pytest.mark.skip(reason=f"no golden file for {model}")))
            continue
        params += [pytest.param(model, case, id=f"{model}-{i}") for i, case in enumerate(section[section_key])]
    return params


# ---------------------------------------------------------------------------------------------------------
# GGUF metadata.
# ---------------------------------------------------------------------------------------------------------


def _write_synthetic_gguf(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    """A tensor-less GGUF holding one field of every value type, small and large arrays."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve ✓ 日本")
    writer.add_array("t.small_ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "", "ü", "<0x0A>"])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.scores", np.linspace(-1, 1, 1000, dtype=np.float32).tolist())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_metadata_matches_gguf_reader(tmp_path: Path, endianess: gguf.GGUFEndian) -> None:
    path = tmp_path / "synthetic.gguf"
    _write_synthetic_gguf(path, endianess)
    meta = read_gguf_metadata(path)
    assert meta["t.u64"] == 2**63 + 5 and meta["t.i64"] == -(2**62) and meta["t.f64"] == 1e-300
    assert meta["t.str"] == "naïve ✓ 日本" and meta["t.bool"] is True
    assert meta["t.small_ints"] == [1, 2, 3] and meta["t.bools"] == [True, False, True]
    assert meta["t.strs"] == ["a", "", "ü", "<0x0A>"]
    scores = meta["t.scores"]
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.dtype.isnative
    np.testing.assert_array_equal(scores, np.linspace(-1, 1, 1000, dtype=np.float32))
    reader = gguf.GGUFReader(path)
    from_reader = read_gguf_metadata(reader)
    assert from_reader.keys() == meta.keys() == reader.fields.keys()
    for name, field in reader.fields.items():
        got = meta[name].tolist() if isinstance(meta[name], np.ndarray) else meta[name]
        again = from_reader[name].tolist() if isinstance(from_reader[name], np.ndarray) else from_reader[name]
        assert got == again == pytest.approx(field.contents()), name


def test_metadata_of_real_checkpoint_is_fast_and_complete(smollm2_path: Path) -> None:
    start = time.perf_counter()
    meta = read_gguf_metadata(smollm2_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"reading a 49k-token vocabulary took {elapsed:.2f}s"
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(meta["tokenizer.ggml.merges"]) == 48900
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert meta["tokenizer.ggml.token_type"].shape == (49152,)
    assert meta["GGUF.tensor_count"] == 272 and meta["GGUF.kv_count"] == len(meta) - 3


def test_metadata_errors_name_the_file(tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFMetadataError, match=r"weights\.bin is not a readable GGUF file"):
        read_gguf_metadata(not_gguf)
    full = tmp_path / "full.gguf"
    _write_synthetic_gguf(full)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(full.read_bytes()[:200])
    with pytest.raises(GGUFMetadataError, match=r"cut\.gguf is truncated"):
        read_gguf_metadata(truncated)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFMetadataError, match="empty.gguf"):
        read_gguf_metadata(empty)


# ---------------------------------------------------------------------------------------------------------
# Parity with HF transformers.
# ---------------------------------------------------------------------------------------------------------

# (text, ids with add_special_tokens=True) as HF transformers produced them from the same GGUF files.
HF_IDS = {
    "smollm2": [
        ("Hello world", [19556, 905]),
        ("  leading spaces", [216, 2899, 5600]),
        ("tabs\tbetween\t\twords", [100, 7366, 197, 18946, 197, 197, 6774]),
        ("1234567890", [33, 34, 35, 36, 37, 38, 39, 40, 41, 32]),
        ("emoji 🙂🚀🎉 mixed with text", [391, 33777, 47526, 10813, 244, 218, 10813, 232, 227, 6468, 351, 1694]),
        (
            "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
            [1, 4093, 198, 6004, 665, 2, 198, 1, 520, 9531, 198],
        ),
        (
            "<bos><eos><pad><unk> literal markers",
            [44, 34761, 21198, 85, 395, 21198, 16384, 21198, 5131, 46, 19620, 11610],
        ),
    ],
    "gemma3": [
        ("Hello world", [2, 9259, 1902]),
        ("  leading spaces", [2, 138, 26016, 9952]),
        ("tabs\tbetween\t\twords", [2, 39218, 255968, 19195, 255969, 8992]),
        ("1234567890", [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771]),
        ("日本語のテキストを分割します。", [2, 94951, 236945, 95830, 237051, 92194, 11914, 236924]),
        ("emoji 🙂🚀🎉 mixed with text", [2, 67906, 57235, 242015, 242061, 9726, 607, 1816]),
        (
            "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
            [2, 105, 2364, 107, 2202, 993, 106, 107, 105, 4368, 107],
        ),
        ("<bos><eos><pad><unk> literal markers", [2, 2, 1, 0, 3, 37087, 26401]),
    ],
}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_pinned_hf_ids(tokenizers: dict[str, Tokenizer], model: str) -> None:
    tok = tokenizers[model]
    for text, ids in HF_IDS[model]:
        assert tok.encode(text) == ids, text
        bos = [tok.bos_token_id] if tok.add_bos_token else []
        assert tok.encode(text, add_special_tokens=False) == ids[len(bos) :], text


@pytest.mark.parametrize("model, case", _golden_params("cases"))
def test_golden_encode(tokenizers: dict[str, Tokenizer], model: str, case: dict) -> None:
    assert tokenizers[model].encode(case["text"], add_special_tokens=case["add_special_tokens"]) == case["ids"]


@pytest.mark.parametrize("model, case", _golden_params("chat"))
def test_golden_chat(tokenizers: dict[str, Tokenizer], model: str, case: dict) -> None:
    tok = tokenizers[model]
    kwargs = {"add_generation_prompt": case["add_generation_prompt"]}
    if tok.chat_template is None:  # Gemma's GGUF ships none; the golden script supplied Gemma 3's published one
        kwargs["chat_template"] = _golden_tokenizer_section(model)["chat_template"]
    assert tok.apply_chat_template(case["messages"], tokenize=False, **kwargs) == case["text"]
    assert tok.apply_chat_template(case["messages"], tokenize=True, **kwargs) == case["ids"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_golden_special_ids(tokenizers: dict[str, Tokenizer], model: str) -> None:
    section = _golden_tokenizer_section(model)
    if section is None:
        pytest.skip(f"no golden file for {model}")
    tok = tokenizers[model]
    assert (tok.bos_token_id, tok.eos_token_id) == (section["bos_token_id"], section["eos_token_id"])
    if "add_bos_token" in section:
        assert tok.add_bos_token == section["add_bos_token"]


# ---------------------------------------------------------------------------------------------------------
# Behaviour.
# ---------------------------------------------------------------------------------------------------------


def test_declared_special_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert (smollm2.bos_token_id, smollm2.eos_token_id, smollm2.pad_token_id) == (1, 2, 2)
    assert not smollm2.add_bos_token and smollm2.eos_token_ids == {2}
    assert smollm2.vocab_size == 49152 and smollm2.eos_token == "<|im_end|>"
    assert (gemma3.bos_token_id, gemma3.eos_token_id, gemma3.pad_token_id) == (2, 1, 0)
    # Gemma's chat turns end with <end_of_turn>, which the GGUF does not list as EOS.
    assert gemma3.add_bos_token and gemma3.eos_token_ids == {1, 106}
    assert gemma3.vocab_size == 262144 and gemma3.bos_token == "<bos>"


TEXTS = [
    "",
    " ",
    "Hello world",
    "  leading and trailing  ",
    "line one\nline two\n\n\tindented\r\n",
    "naïve café, Straße, Łódź, Đà Nẵng",
    "日本語 中文 한국어 Привет שלום مرحبا",
    "emoji 🙂🚀 family 👨‍👩‍👧‍👦 flags 🇯🇵 skin 👍🏽",
    "zero\u200bwidth and non\u00a0breaking\u3000ideographic",
    "def f(x):\n    return {'a': [1, 2.5e-3]}\n",
]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_decode_inverts_encode(tokenizers: dict[str, Tokenizer], model: str) -> None:
    tok = tokenizers[model]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_skip_special_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert smollm2.decode(ids) == "user\nhi\n"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"
    ids = gemma3.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[:2] == [2, 105]
    assert gemma3.decode(ids) == "user\nhi"
    assert gemma3.decode(ids, skip_special_tokens=False) == "<bos><start_of_turn>user\nhi<end_of_turn>"


def test_convert_ids_to_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert smollm2.convert_ids_to_tokens([19556, 905]) == ["Hello", "Ġworld"]
    assert gemma3.convert_ids_to_tokens(1902) == "▁world"
    assert gemma3.convert_tokens_to_ids(["<end_of_turn>", "<0x41>"]) == [106, 238 + 0x41]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_ids_outside_vocab_are_rejected(tokenizers: dict[str, Tokenizer], model: str) -> None:
    tok = tokenizers[model]
    with pytest.raises(ValueError, match=rf"token id {tok.vocab_size} .*vocab_size={tok.vocab_size}"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match=r"token id -1 "):
        tok.decode([-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([10**9])


# ---------------------------------------------------------------------------------------------------------
# Chat templates.
# ---------------------------------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
    {"role": "user", "content": "Why do cats knead blankets?"},
]


def test_smollm2_chat_template_matches_hf(smollm2: Tokenizer) -> None:
    text = smollm2.apply_chat_template(CHAT)
    # Rendered by HF transformers' apply_chat_template from the same GGUF.
    assert text == (
        "<|im_start|>system\nYou are a terse assistant who answers in one sentence.<|im_end|>\n"
        "<|im_start|>user\nWhy do cats knead blankets?<|im_end|>\n<|im_start|>assistant\n"
    )
    default_system = smollm2.apply_chat_template(CHAT[1:], add_generation_prompt=False)
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert not default_system.endswith("assistant\n")
    ids = smollm2.apply_chat_template(CHAT, tokenize=True)
    assert ids == smollm2.encode(text, add_special_tokens=False) and ids[0] == 1 and ids.count(2) == 2


GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_gemma_chat_needs_a_template_and_keeps_one_bos(gemma3: Tokenizer) -> None:
    assert gemma3.chat_template is None  # the GGUF carries none (HF transformers refuses too)
    with pytest.raises(TokenizerError, match="no chat_template"):
        gemma3.apply_chat_template(CHAT[1:])
    text = gemma3.apply_chat_template(CHAT[1:], chat_template=GEMMA_STYLE_TEMPLATE)
    assert text == "<bos><start_of_turn>user\nWhy do cats knead blankets?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma3.apply_chat_template(CHAT[1:], chat_template=GEMMA_STYLE_TEMPLATE, tokenize=True)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1 and ids[-3:] == [105, 4368, 107]
    # A template that writes no BOS still gets exactly one, because the checkpoint adds BOS.
    no_bos = GEMMA_STYLE_TEMPLATE.removeprefix("{{ bos_token }}")
    assert gemma3.apply_chat_template(CHAT[1:], chat_template=no_bos, tokenize=True) == ids


def test_template_environment_matches_hf(smollm2: Tokenizer) -> None:
    template = (
        "{% for m in messages %}\n"
        "  {%- if m['role'] == 'bad' %}{{ raise_exception('bad role: ' + m['role']) }}{% endif %}\n"
        "  {{ m | tojson }}\n"
        "{% endfor %}"
        "{{ strftime_now('%Y') }}|{{ eos_token }}|{{ extra }}"
    )
    messages = [{"role": "user", "content": "café 🙂"}]
    text = smollm2.apply_chat_template(messages, chat_template=template, extra="x")
    # trim_blocks + lstrip_blocks remove the tag lines; tojson keeps non-ASCII characters.
    assert text == '  {"role": "user", "content": "café 🙂"}\n' + f"{time.strftime('%Y')}|<|im_end|>|x"
    with pytest.raises(jinja2.TemplateError, match="bad role: bad"):
        smollm2.apply_chat_template([{"role": "bad", "content": ""}], chat_template=template)
    with pytest.raises(SecurityError):
        smollm2.apply_chat_template(CHAT, chat_template="{% set _ = messages.append(1) %}")


# ---------------------------------------------------------------------------------------------------------
# tokenizer.json / tokenizer.model / HF directories.
# ---------------------------------------------------------------------------------------------------------

PROBES = TEXTS + ["<|im_start|>x<|im_end|>", "<start_of_turn>x<end_of_turn>", "<bos>mid<unk>", "12 345 6789"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_saved_directory_round_trips(tokenizers: dict[str, Tokenizer], model: str, tmp_path: Path) -> None:
    tok = tokenizers[model]
    saved = tok.save(tmp_path / "tok")
    expected_file = "tokenizer.json" if model == "smollm2" else "tokenizer.model"
    assert (saved / expected_file).is_file() and (saved / "tokenizer_config.json").is_file()
    again = load_tokenizer(saved)
    attrs = ("bos_token_id", "eos_token_id", "eos_token_ids", "pad_token_id", "add_bos_token", "all_special_ids")
    for attr in (*attrs, "chat_template"):
        assert getattr(again, attr) == getattr(tok, attr), attr
    for text in PROBES:
        ids = tok.encode(text)
        assert again.encode(text) == ids
        assert again.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_bare_tokenizer_file(tokenizers: dict[str, Tokenizer], model: str, tmp_path: Path) -> None:
    """A lone tokenizer.json / tokenizer.model (no configs next to it) tokenizes exactly like the GGUF."""
    tok = tokenizers[model]
    saved = tok.save(tmp_path / "saved")
    name = "tokenizer.json" if model == "smollm2" else "tokenizer.model"
    bare = tmp_path / "bare" / name
    bare.parent.mkdir()
    shutil.copy(saved / name, bare)
    loaded = load_tokenizer(bare)
    assert loaded.vocab_size == tok.vocab_size
    for text in PROBES:
        assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    if model == "gemma3":  # a SentencePiece model declares its own BOS/EOS/PAD ids and adds BOS
        assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (2, 1, 0)
        assert loaded.add_bos_token and loaded.eos_token_ids == {1, 106}


def test_hf_directory_configs(smollm2: Tokenizer, tmp_path: Path) -> None:
    """tokenizer_config / special_tokens_map / generation_config decide BOS, EOS and the template."""
    saved = smollm2.save(tmp_path / "hf")
    (saved / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": {"content": "<|endoftext|>"}, "chat_template": "{{ 'T' }}"})
    )
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (saved / "special_tokens_map.json").write_text(json.dumps(special_map))
    (saved / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (saved / "chat_template.jinja").write_text("{{ 'J' }}")
    tok = load_tokenizer(saved)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 2, 0)
    assert tok.eos_token_ids == {2, 5} and tok.encode("hi")[0] == 0
    assert tok.apply_chat_template([]) == "J"  # chat_template.jinja wins over tokenizer_config


# ---------------------------------------------------------------------------------------------------------
# Synthetic vocabularies and errors.
# ---------------------------------------------------------------------------------------------------------


def tiny_spm_metadata(add_space_prefix: bool = True) -> dict:
    """A Llama-2 style SentencePiece vocabulary (dummy prefix, byte fallback) small enough to reason about."""
    words = ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "bc", "▁abc", "▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, np.float32),
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_dummy_prefix_only_at_text_start() -> None:
    tok = Tokenizer.from_gguf_metadata(tiny_spm_metadata())
    ab, ab_mid, abc = tok.convert_tokens_to_ids(["▁ab", "ab", "▁abc"])
    assert tok.encode("ab abc") == [1, ab, abc]
    # After a special token there is no dummy prefix (HF's "first" prepend scheme).
    assert tok.encode("</s>ab", add_special_tokens=False) == [2, ab_mid]
    assert tok.decode([ab, abc]) == "ab abc"  # the dummy-prefix space is dropped again
    assert tok.decode([1, ab, 2, ab], skip_special_tokens=False) == "<s> ab</s> ab"
    assert tok.decode(tok.encode("x é")) == "x é"  # byte fallback


def test_unsupported_vocabularies_fail_clearly(smollm2_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 'rwkv' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="no 'tokenizer.ggml.tokens' field"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    meta = dict(read_gguf_metadata(smollm2_path), **{"tokenizer.ggml.pre": "mystery"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'mystery' is not supported"):
        Tokenizer.from_gguf_metadata(meta)
    bad_types = dict(tiny_spm_metadata(), **{"tokenizer.ggml.token_type": np.ones(3, np.int32)})
    with pytest.raises(TokenizerError, match="token_type has 3 entries but the vocabulary has 270"):
        Tokenizer.from_gguf_metadata(bad_types)


def test_load_tokenizer_path_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.model").write_bytes(b"\xff\xff\xff garbage")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        load_tokenizer(tmp_path / "tokenizer.model")


def tiny_bpe_metadata(pre: str) -> dict:
    """A byte-level BPE vocabulary whose merges can build "1234" from its digits."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<|end|>"] + sorted(ByteLevel.alphabet()) + ["12", "123", "1234"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["1 2", "12 3", "123 4"],
        "tokenizer.ggml.token_type": np.array([3] + [1] * (len(tokens) - 1), np.int32),
        "tokenizer.ggml.eos_token_id": 0,
    }


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt2", ["1234"]),  # numbers stay whole
        ("smollm", ["1", "2", "3", "4"]),  # every digit isolated
        ("llama-bpe", ["123", "4"]),  # groups of at most three digits
        ("qwen2", ["1", "2", "3", "4"]),
    ],
)
def test_pre_tokenizer_regex_follows_pre_type(pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata(tiny_bpe_metadata(pre))
    ids = tok.encode("1234")
    assert tok.convert_ids_to_tokens(ids) == pieces and tok.decode(ids) == "1234"
    assert tok.encode("x<|end|>") == [tok.convert_tokens_to_ids("x"), 0] and tok.eos_token_ids == {0}
    assert not tok.add_bos_token and tok.decode(tok.encode("héllo wörld\n")) == "héllo wörld\n"
