"""Request bodies of the OpenAI endpoints (pydantic, validated by FastAPI).

Field names, types and defaults are OpenAI's, plus vLLM's extra sampling fields (sent by the `openai`
client through `extra_body`). Unknown fields are refused by name (a typo must not be silently ignored), except
the OpenAI fields listed in `IGNORED` that cannot change what this server returns (user, metadata, ...).
Ranges are not checked here: SamplingParams checks them, and its error names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Accepted and ignored: bookkeeping fields of OpenAI's API that do not change a completion here.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities", "audio",
           "reasoning_effort", "web_search_options", "safety_identifier", "prompt_cache_key")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class _Sampling(_Body):
    """Sampling fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # structured output (vLLM's names): one of these, or response_format
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    request_id: str | None = None
    priority: int = 0


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ... reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
