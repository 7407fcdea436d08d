"""fleet/tokenize.py: what the router sends to the engine's /tokenize, and what it cannot score."""

from __future__ import annotations

from fleet.tokenize import (
    CHAT,
    COMPLETIONS,
    MAX_SCORED_TOKENS,
    RequestPlan,
    Unscorable,
    lora_split,
    plan_request,
)


def test_token_ids_are_used_as_they_are() -> None:
    plan = plan_request(COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "cache_salt": "t", "stream": True})
    assert plan == RequestPlan("m", "t", True, token_ids=(1, 2, 3))
    batch = plan_request(COMPLETIONS, {"prompt": [[4, 5], [6]]})
    assert isinstance(batch, RequestPlan) and batch.token_ids == (4, 5)


def test_a_text_prompt_is_tokenized_with_its_special_tokens_choice() -> None:
    plan = plan_request(COMPLETIONS, {"model": "m", "prompt": "hi", "add_special_tokens": False})
    assert isinstance(plan, RequestPlan)
    assert plan.tokenize_body == {"model": "m", "prompt": "hi", "add_special_tokens": False}
    plan = plan_request(COMPLETIONS, {"prompt": ["first", "second"]})
    assert isinstance(plan, RequestPlan) and plan.tokenize_body == {"prompt": "first"}


def test_a_chat_carries_every_field_that_changes_its_tokens() -> None:
    messages = [{"role": "user", "content": "x"}]
    body = {
        "model": "m", "messages": messages, "add_generation_prompt": False, "tools": [{"type": "function"}],
        "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.2, "max_tokens": 9,
    }  # fmt: skip
    plan = plan_request(CHAT, body)
    assert isinstance(plan, RequestPlan)
    assert plan.tokenize_body == {
        "model": "m", "messages": messages, "add_generation_prompt": False, "tools": [{"type": "function"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }  # fmt: skip


def test_what_cannot_be_scored_says_why() -> None:
    for path, body, why in (
        (COMPLETIONS, {"prompt_embeds": "abc"}, "prompt_embeds"),
        (COMPLETIONS, {"prompt": []}, "bad_request"),
        (COMPLETIONS, {"prompt": [1, -2]}, "bad_request"),
        (COMPLETIONS, {"prompt": [1, True]}, "bad_request"),
        (COMPLETIONS, {"prompt": {"a": 1}}, "bad_request"),
        (CHAT, {"messages": "hi"}, "bad_request"),
        ("/v1/embeddings", {"input": "x"}, "unsupported_path"),
        (COMPLETIONS, {"prompt": [1] * (MAX_SCORED_TOKENS + 1)}, "too_long"),
    ):
        plan = plan_request(path, body)
        assert isinstance(plan, Unscorable) and plan.why == why


def test_a_lora_adapter_is_scored_under_its_base_model() -> None:
    parents = {"base": None, "ad": "base"}
    assert lora_split("ad", parents) == ("base", "ad")
    assert lora_split("base", parents) == ("base", None)
    assert lora_split("unknown", parents) == ("unknown", None)
    assert lora_split(None, parents) == (None, None)
