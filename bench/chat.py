"""`kvdepot bench ttft --turns N`: time to first token of every turn of multi-turn chats.

A chat: turn 1 sends a random prompt of `--prompt-tokens` token ids; turn k+1 sends turn k's
prompt, turn k's answer (its token ids, `return_token_ids`) and `--turn-tokens` new ones, as a
chat client re-sends the conversation. Answers have exactly `--answer-tokens` tokens (greedy,
`ignore_eos` and `min_tokens`). `--requests` chats are run, one after the other.

Up to three servers of the same model, each running its own copy of every chat, turn by turn
interleaved (so they are measured under the same machine load):
  decode_on     `--url`: the connector, saving the answers' chunks (kvdepot_save_decode, default)
  decode_off    `--no-decode-url` (optional): the connector with kvdepot_save_decode false
  no_connector  `--baseline-url` (optional): no connector (and no prefix caching, to compare)
Each connector server's chats carry a cache_salt of their own, so two servers that share one
sidecar never hit each other's chunks. Hit tokens are the delta of the server's
`vllm:external_prefix_cache_hits_total` around each request.

Prints ONE JSON object: per turn and server, TTFT p50 (ms), hit tokens p50 and, with a baseline,
TTFT relative to it in the same turn (`ttft_vs_no_connector_p50`); `answers_identical` says
whether every server gave every chat the same answers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from bench.ttft import OpenAIServer

HITS = "vllm:external_prefix_cache_hits_total"


@dataclass
class _Turn:
    seconds: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)


@dataclass
class _Config:
    name: str
    server: OpenAIServer
    salt: str | None
    turns: list[_Turn] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)  # per chat, all answers concatenated


def _configs(args: argparse.Namespace, run_id: str) -> list[_Config]:
    named = [("decode_on", args.url), ("decode_off", args.no_decode_url), ("no_connector", args.baseline_url)]
    base = args.cache_salt or "bench-chat"
    return [
        _Config(
            name,
            OpenAIServer(url, args.timeout),
            None if name == "no_connector" else f"{base}-{name}-{run_id}",
        )
        for name, url in named
        if url
    ]


def _body(args: argparse.Namespace, model: str, prompt: list[int], salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": args.answer_tokens, "min_tokens": args.answer_tokens,
        "temperature": 0, "logprobs": 1, "stream": True, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _chat(args: argparse.Namespace, model: str, configs: list[_Config], rng: random.Random) -> None:
    """One chat on every server, turn by turn."""
    first = [rng.randint(args.token_low, args.token_high) for _ in range(args.prompt_tokens)]
    prompts = {c.name: list(first) for c in configs}
    answers: dict[str, list[int]] = {c.name: [] for c in configs}
    for turn in range(args.turns):
        new = [rng.randint(args.token_low, args.token_high) for _ in range(args.turn_tokens)]
        for c in configs:
            hits_before = c.server.metric(HITS)
            answer: list[int] = []
            seconds, _ = c.server.ttft(_body(args, model, prompts[c.name], c.salt), answer)
            if len(answer) != args.answer_tokens:
                raise RuntimeError(
                    f"{c.name}: an answer of {len(answer)} tokens, not {args.answer_tokens} (token ids "
                    "missing? the server must support return_token_ids)"
                )
            c.turns[turn].seconds.append(seconds)
            c.turns[turn].hits.append(c.server.metric(HITS) - hits_before)
            answers[c.name] += answer
            prompts[c.name] += answer + new
    for c in configs:
        c.answers.append(answers[c.name])


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def _result(args: argparse.Namespace, configs: list[_Config]) -> dict[str, Any]:
    base = next((c for c in configs if c.name == "no_connector"), None)
    per_turn: list[dict[str, Any]] = []
    for turn in range(args.turns):
        row: dict[str, Any] = {
            "turn": turn + 1,
            "prompt_tokens": args.prompt_tokens + turn * (args.answer_tokens + args.turn_tokens),
        }
        for c in configs:
            t = c.turns[turn]
            figures: dict[str, Any] = {
                "ttft_ms_p50": _ms(t.seconds),
                "hit_tokens_p50": statistics.median(t.hits),
            }
            if base is not None and c is not base:
                ratios = [a / b for a, b in zip(t.seconds, base.turns[turn].seconds, strict=True)]
                figures["ttft_vs_no_connector_p50"] = round(statistics.median(ratios), 3)
            row[c.name] = figures
        per_turn.append(row)
    return {
        "mode": "multi_turn",
        "turns": args.turns,
        "chats": args.requests,
        "first_prompt_tokens": args.prompt_tokens,
        "answer_tokens": args.answer_tokens,
        "turn_tokens": args.turn_tokens,
        "servers": [c.name for c in configs],
        "per_turn": per_turn,
        "answers_identical": all(c.answers == configs[0].answers for c in configs),
    }


def run_chats(args: argparse.Namespace) -> int:
    configs = _configs(args, f"{time.time_ns():x}")
    model = args.model or configs[0].server.first_model()
    for c in configs:
        c.turns = [_Turn() for _ in range(args.turns)]
        c.server.ttft(_body(args, model, [args.token_low] * 16, None) | {"max_tokens": 1, "min_tokens": 0})
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    for _ in range(args.requests):
        _chat(args, model, configs, rng)
    print(json.dumps(_result(args, configs)))
    return 0
