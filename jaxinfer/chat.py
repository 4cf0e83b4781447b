"""Chat prompts and the HF-style tokenizer that `LLM.get_tokenizer()` returns.

`render_chat` checks a conversation (jaxinfer.inputs), renders it with the checkpoint's (or the given)
Jinja template in the sandbox, and encodes it the way HF's `apply_chat_template(tokenize=True)` does.
`continue_final_message` renders without a generation prompt and cuts the text right after the last
message's content, so the model continues that message instead of starting a new turn (HF's rule).
Template errors (a `raise_exception` in the template, an undefined variable, a sandbox violation) become
`InvalidInput` naming the messages or the template, never a Jinja traceback.

`HFStyleTokenizer` wraps jaxinfer's `Tokenizer` with transformers' signatures and defaults
(`decode(ids, skip_special_tokens=False)`, `apply_chat_template(..., add_generation_prompt=False,
tokenize=True)`, `__call__` -> {"input_ids": ...}), for code written against vLLM's `llm.get_tokenizer()`.
`llm.tokenizer` stays jaxinfer's own, with its own defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.inputs import check_conversation, split_conversations


def _template_vars(chat_template_kwargs: Any, tools: Any, documents: Any) -> dict[str, Any]:
    if chat_template_kwargs is not None and (
        not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs)
    ):
        raise InvalidInputType.of("", "chat_template_kwargs", chat_template_kwargs, "None or a dict with string keys")
    extra = dict(chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt"):
        if reserved in extra:
            raise InvalidInput.of("", f"chat_template_kwargs[{reserved!r}]", extra[reserved],
                                  "absent (it is set by jaxinfer)")
    if tools is not None:
        if not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools):
            raise InvalidInputType.of("", "tools", tools, "None or a list of tool definitions (dicts)")
        extra["tools"] = [dict(t) for t in tools]
    if documents is not None:
        extra["documents"] = documents
    return extra


def render_chat_text(
    tokenizer: Any, messages: Any, *, chat_template: str | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None, documents: Any = None, field: str = "messages",
) -> str:
    """One conversation -> the prompt text the template renders."""
    if tokenizer is None:
        raise InvalidInput("chat needs a tokenizer with a chat template; this model has none.", field=field)
    conversation = check_conversation(messages, field)
    if add_generation_prompt and continue_final_message:
        raise InvalidInput("add_generation_prompt and continue_final_message cannot both be True: the first "
                           "starts a new turn, the second continues the last one.", field="continue_final_message",
                           value=True, accepted="False when add_generation_prompt=True")
    source = chat_template if chat_template is not None else tokenizer.chat_template
    if source is None:
        raise InvalidInput("this tokenizer has no chat template; pass chat_template=... (a Jinja string).",
                           field="chat_template", value=None, accepted="a Jinja template string")
    if not isinstance(source, str):
        raise InvalidInputType.of("", "chat_template", source, "None or a Jinja template string")
    variables = _template_vars(chat_template_kwargs, tools, documents)
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, chat_template=source, **variables)
    except Exception as e:  # noqa: BLE001 - raise_exception, undefined names, None + str, a sandbox violation
        raise InvalidInput(f"{field}: the chat template refused this conversation ({type(e).__name__}: {e}).",
                           field=field, value=None, accepted="a conversation the chat template renders") from None
    return _cut_after_final_message(text, conversation[-1], field) if continue_final_message else text


def _cut_after_final_message(text: str, final: Mapping[str, Any], field: str) -> str:
    content = final.get("content") or ""
    core = content.strip()
    at = text.rfind(core) if core else -1
    if at < 0:
        raise InvalidInput(f"{field}: continue_final_message needs the last message's content in the rendered "
                           "prompt, and the chat template does not show it.", field="continue_final_message",
                           value=True, accepted="a final message with content the template renders")
    end = at + len(core)
    trailing = content[len(content.rstrip()):]  # whitespace the caller left at the end, kept when rendered too
    return text[: end + len(trailing)] if text[end : end + len(trailing)] == trailing else text[:end]


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat: the template wrote the special tokens; BOS is added only when the
    checkpoint adds BOS and the template did not (what HF's tokenize=True gives)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.add_bos_token and ids[:1] != [tokenizer.bos_token_id]:
        ids.insert(0, tokenizer.bos_token_id)
    return ids


def chat_prompts(tokenizer: Any, messages: Any, **options: Any) -> list[dict[str, Any]]:
    """One conversation or a list of them -> TokensPrompt dicts carrying the rendered text."""
    conversations, batch = split_conversations(messages)
    prompts = []
    for i, conversation in enumerate(conversations):
        field = f"messages[{i}]" if batch else "messages"
        text = render_chat_text(tokenizer, conversation, field=field, **options)
        prompts.append({"prompt_token_ids": encode_rendered(tokenizer, text), "prompt": text})
    return prompts


class HFStyleTokenizer:
    """jaxinfer's Tokenizer behind transformers' method names, signatures and defaults (see module doc)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:  # bos/eos/pad ids and tokens, all_special_ids, chat_template, ...
        return getattr(self._tok, name)

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    def __len__(self) -> int:
        return self._tok.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidInputType.of("", "text", text, "a string")
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def get_vocab(self) -> dict[str, int]:
        return {self._tok.convert_ids_to_tokens(i): i for i in range(self._tok.vocab_size)}

    def apply_chat_template(
        self, conversation: Any, tools: Sequence[Mapping[str, Any]] | None = None, documents: Any = None,
        chat_template: str | None = None, add_generation_prompt: bool = False, continue_final_message: bool = False,
        tokenize: bool = True, return_dict: bool = False, **kwargs: Any,
    ) -> Any:
        """HF's signature; a list of conversations gives a list of results."""
        conversations, batch = split_conversations(conversation)
        results = []
        for c in conversations:
            text = render_chat_text(self._tok, c, chat_template=chat_template, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs,
                                    continue_final_message=continue_final_message, field="conversation")
            if not tokenize:
                results.append(text)
                continue
            ids = encode_rendered(self._tok, text)
            results.append({"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids)
        return results if batch else results[0]
