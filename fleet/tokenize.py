"""What the router must know of an OpenAI request to score it: its tokens (or how the engine would
compute them), its model and LoRA adapter, its tenant (`cache_salt`).

Role: pure functions over the parsed JSON body of `/v1/completions` and `/v1/chat/completions`.
The engine is the only one that tokenizes exactly as it does (its tokenizer, its chat template), so
this module never tokenizes: it builds the body of the engine's `POST /tokenize` with every field
that changes the tokens, or takes the token ids a completion request already carries.

- completions: `prompt` a list of ints is used as is; a string is tokenized with the request's
  `add_special_tokens` (vLLM's default for completions: true); a batch (a list of strings or of
  token lists) is scored by its first prompt; `prompt_embeds` cannot be scored.
- chat: `messages` with the chat-template fields (`add_generation_prompt`, `continue_final_message`,
  `add_special_tokens` (default false), `chat_template`, `chat_template_kwargs`, `tools`,
  `mm_processor_kwargs`, `media_io_kwargs`), as vLLM's `TokenizeChatRequest` takes them.
- a prompt of more than MAX_SCORED_TOKENS token ids is not scored (`too_long`), nor checked id by
  id: the engine judges it.

State: none. Any thread.

Primitives: plan_request(path, body) -> RequestPlan | Unscorable; lora_split(model, parents).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT", "COMPLETIONS", "RequestPlan", "Unscorable", "lora_split", "plan_request"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# TokenizeChatRequest's fields that the chat completion request shares and that change the tokens.
CHAT_TOKEN_FIELDS = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs",
)  # fmt: skip
MAX_TOKEN_ID = 2**63 - 1
# Longer prompts are not scored (the directory's own default limit): checking each id costs the
# loop time, and no engine serves such a prompt.
MAX_SCORED_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """How to score one request: `token_ids` when the request carries them, else the body of the
    engine's POST /tokenize (`tokenize_body`). `stream` tells the proxy how to relay the answer."""

    model: str | None
    cache_salt: str | None
    stream: bool
    token_ids: tuple[int, ...] | None = None
    tokenize_body: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Unscorable:
    """A request the router cannot score (routed by load); `why` is a metric label."""

    why: str
    stream: bool


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_SCORED_TOKENS
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)
    )


def plan_request(path: str, body: Mapping[str, Any]) -> RequestPlan | Unscorable:
    """The scoring plan of a parsed request body (a JSON object). Never raises: a shape the router
    does not understand is Unscorable, and the engine answers it with its own validation."""
    stream = body.get("stream") is True
    model = body.get("model")
    model = model if isinstance(model, str) and model else None
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    if path == COMPLETIONS:
        return _plan_completion(body, model, salt, stream)
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return Unscorable("bad_request", stream)
        tok: dict[str, Any] = {"messages": messages}
        if model is not None:
            tok["model"] = model
        for name in CHAT_TOKEN_FIELDS:
            if body.get(name) is not None:
                tok[name] = body[name]
        return RequestPlan(model, salt, stream, tokenize_body=tok)
    return Unscorable("unsupported_path", stream)


def _plan_completion(
    body: Mapping[str, Any], model: str | None, salt: str | None, stream: bool
) -> RequestPlan | Unscorable:
    if body.get("prompt_embeds") is not None:
        return Unscorable("prompt_embeds", stream)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], (str, list))):
        prompt = prompt[0]  # a batch: scored (and routed) by its first prompt
    if isinstance(prompt, list) and len(prompt) > MAX_SCORED_TOKENS:
        return Unscorable("too_long", stream)
    if isinstance(prompt, list) and _is_token_list(prompt):
        return RequestPlan(model, salt, stream, token_ids=tuple(prompt))
    if isinstance(prompt, str) and prompt:
        tok: dict[str, Any] = {"prompt": prompt}
        if model is not None:
            tok["model"] = model
        special = body.get("add_special_tokens")
        if isinstance(special, bool):
            tok["add_special_tokens"] = special
        return RequestPlan(model, salt, stream, tokenize_body=tok)
    return Unscorable("bad_request", stream)


def lora_split(model: str | None, parents: Mapping[str, str | None]) -> tuple[str | None, str | None]:
    """(base model, LoRA adapter name) of a request's `model`: the engines list each adapter in
    /v1/models with its base model as `parent`; a name without a parent is a base model."""
    if model is None:
        return None, None
    parent = parents.get(model)
    if parent is not None and parent != model:
        return parent, model
    return model, None
