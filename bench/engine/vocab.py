"""The token range of `kvdepot bench engine`: which prompt ids the served model accepts.

Role: bound the largest prompt token id, and say where the bound came from: `--vocab-size`,
`--tokenizer DIR` (`vocab_size` of DIR/config.json), or the server itself. vLLM's OpenAI server
reports no vocabulary size (`/v1/models` gives `root` and `max_model_len`; `/tokenize` and
`/detokenize` do not check ids), but it refuses a prompt holding an id above max(the tokenizer's
largest id, the model's vocab_size - 1) with a 400 "Token id N is out of vocabulary", before the
request reaches the engine. So the server is asked: a one-token prompt of `--token-high`
(`max_tokens` 1); when it is refused as out of vocabulary, a bisection finds the largest id the
server accepts (about log2(token_high) one-token requests, all before the first pass, so no pass's
counters see them). Any other answer (another status, a refusal that does not speak of the
vocabulary, no answer at all) leaves the default range, with a note saying what the server answered.

State: none. Touched by the benchmark's event loop (`probe` awaits the server's answers).

Primitives, in call order: `from_options(vocab_size, tokenizer)` -> `TokenRange | None`;
`await probe(client, model, token_high)` -> `TokenRange`; `narrowest(ranges)`; `TokenRange.as_json()`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.engine.sender import server_message
from bench.engine.workloads import WorkloadError


@dataclass(frozen=True, slots=True)
class TokenRange:
    """The largest id prompts may hold, and where that came from."""

    largest_id: int | None
    """None: unknown (the defaults stand)."""
    source: str
    """`--vocab-size`, `--tokenizer`, `server` or `default`."""
    note: str

    def as_json(self) -> dict[str, Any]:
        return {"largest_id": self.largest_id, "source": self.source, "note": self.note}


class Inconclusive(Exception):
    """The server's answer to a probe says nothing about its vocabulary."""


def from_options(vocab_size: int | None, tokenizer: Path | None) -> TokenRange | None:
    """The range the options state (`--vocab-size` first, then `--tokenizer`); None when neither
    is given. Raises WorkloadError for a model folder without `vocab_size`."""
    if vocab_size is not None:
        return TokenRange(vocab_size - 1, "--vocab-size", f"--vocab-size {vocab_size}")
    if tokenizer is None:
        return None
    path = tokenizer / "config.json"
    try:
        size = int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"--tokenizer: no vocab_size in {path} ({exc})") from exc
    return TokenRange(size - 1, "--tokenizer", f"vocab_size {size} in {path}")


async def _accepts(client: httpx.AsyncClient, model: str, token: int) -> tuple[bool, str]:
    """Whether the server takes a prompt of `token` alone; and the refusal's message."""
    body = {"model": model, "prompt": [token], "max_tokens": 1, "temperature": 0}
    try:
        resp = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise Inconclusive(f"id {token}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code == 200:
        return True, ""
    message = server_message(resp.content)
    if 400 <= resp.status_code < 500 and "vocabulary" in message.lower():
        return False, message
    raise Inconclusive(f"id {token}: HTTP {resp.status_code}: {message}")


async def probe(client: httpx.AsyncClient, model: str, token_high: int) -> TokenRange:
    """Ask the server at `client` which ids `model` accepts (see the module's docstring)."""
    try:
        accepted, refusal = await _accepts(client, model, token_high)
        if accepted:
            return TokenRange(None, "default", f"the server accepts id {token_high} (--token-high)")
        lo, hi = -1, token_high  # the largest id known accepted, the smallest known refused
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok, message = await _accepts(client, model, mid)
            lo, hi, refusal = (mid, hi, refusal) if ok else (lo, mid, message)
    except Inconclusive as exc:
        return TokenRange(None, "default", f"the server's answer says nothing of its vocabulary: {exc}")
    if lo < 0:
        return TokenRange(None, "default", f"the server refuses every id, 0 too: {refusal}")
    return TokenRange(lo, "server", f"the server accepts id {lo} and refuses {hi}: {refusal}")


def narrowest(ranges: Sequence[TokenRange]) -> TokenRange:
    """Of the servers' ranges (target, baseline), the one with the smallest known largest id."""
    known = [r for r in ranges if r.largest_id is not None]
    return min(known, key=lambda r: r.largest_id or 0) if known else ranges[0]
