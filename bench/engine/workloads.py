"""Workloads of `kvdepot bench engine`: the token streams KV caches are judged by.

Role: turn the command's options and a seed into passes of requests whose prompts are lists of
token ids (no tokenizer needed). Every stream is a function of (seed, workload options) alone:
each component draws from its own `random.Random` seeded by a string naming it, so adding a
request to one pass never shifts the tokens of another.

State: a workload owns its generators; `RequestSpec.output_ids` is filled in by the sender when a
request finishes (multi-round-chat reads it to build the next round). Touched only by the
benchmark's event loop.

Primitives, in call order:
  `Reuse.parse("zipf:1.1")`         how pooled workloads pick a pool entry (uniform or Zipf);
  `build(options)`                   the workload named by `options.workload`;
  `workload.passes()`                a generator of `PassSpec`: the next pass is built only when the
                                     runner asks for it, i.e. after the previous pass has finished;
  `pass_spec.requests`               an iterator of `RequestSpec` (endless for pooled workloads when
                                     the run is bounded by `--duration`).

Workloads:
  long-doc-qa           D documents of L tokens; warm-up pass (each document once, with a question
                        of its own), then the measured pass: each document asked Q times, a new
                        question each time, in order tile (d0..dn, d0..dn), interleave (d0, d0, d1,
                        d1, ...) or random (a seeded shuffle);
  multi-round-chat      U users, R rounds, one pass per round; every prompt starts with one shared
                        system prompt, each round sends the previous prompt, the previous answer's
                        token ids (as generated) and a new user message;
  shared-system-prompt  K long system prompts (default 1), each followed by a short question;
                        warm-up pass (each system prompt once), then N requests picking a system
                        prompt by `--reuse`;
  prefix-suffix-tuner   requests of exactly `context_tokens`: a prefix from a pool, a fixed short
                        breaker, a unique suffix; the pool is sized as a multiple of a tier's
                        capacity; warm pass (every prefix once, pool order), then N requests
                        picking a prefix by `--reuse`;
  random-prefill        N prompts of random tokens: no reuse at all (what a connector costs).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

WORKLOADS = (
    "long-doc-qa", "multi-round-chat", "shared-system-prompt", "prefix-suffix-tuner", "random-prefill",
)  # fmt: skip
ORDERS = ("tile", "interleave", "random")


class WorkloadError(ValueError):
    """Options that do not make a workload (reported as a usage error)."""


@dataclass
class RequestSpec:
    """One request: its prompt, how many tokens to generate, the pool entry it reuses."""

    pass_name: str
    index: int
    prompt: list[int]
    max_tokens: int
    group: str
    """The reused unit this prompt starts with (`doc3`, `prefix12`, `user2`, `system0`, `unique`)."""
    want_ids: bool = False
    """The next pass needs this answer's token ids."""
    output_ids: list[int] = field(default_factory=list)
    ok: bool = False


@dataclass
class PassSpec:
    name: str
    measured: bool
    requests: Iterator[RequestSpec]
    total: int | None
    """How many requests the pass has (None: endless, bounded by the run's duration)."""


@dataclass(frozen=True)
class Options:
    """What the workloads read from the command line (see cli.add_arguments for each meaning)."""

    workload: str
    seed: int = 0
    token_low: int = 100
    token_high: int = 7999
    max_tokens: int = 16
    requests: int | None = 32
    reuse: str = "uniform"
    documents: int = 8
    document_tokens: int = 2048
    questions: int = 2
    question_tokens: int = 16
    order: str = "tile"
    users: int = 4
    rounds: int = 3
    system_tokens: int = 1024
    system_prompts: int = 1
    user_tokens: int = 64
    context_tokens: int = 2048
    suffix_tokens: int = 128
    breaker_tokens: int = 8
    pool_size: int | None = None
    pool_multiple: float = 1.05
    capacity_tokens: int | None = None
    prompt_tokens: int = 2048


class Reuse:
    """Which pool entry a request reuses: uniform, or Zipf with exponent S over a seeded ranking
    (popularity is not tied to pool order, so the warm pass's insertion order favours none)."""

    def __init__(self, kind: str, exponent: float) -> None:
        self.kind = kind
        self.exponent = exponent

    @staticmethod
    def parse(text: str) -> Reuse:
        if text == "uniform":
            return Reuse("uniform", 0.0)
        if text.startswith("zipf:"):
            try:
                s = float(text[5:])
            except ValueError:
                s = -1.0
            if s > 0 and math.isfinite(s):
                return Reuse("zipf", s)
        raise WorkloadError(f"--reuse must be 'uniform' or 'zipf:S' with S > 0, not {text!r}")

    def sampler(self, pool: int, rng: random.Random) -> Iterator[int]:
        """Endless pool indexes drawn from `rng`."""
        if self.kind == "uniform":
            while True:
                yield rng.randrange(pool)
        ranking = list(range(pool))
        rng.shuffle(ranking)
        cum = list(itertools.accumulate(1.0 / (rank + 1) ** self.exponent for rank in range(pool)))
        while True:
            yield ranking[min(pool - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))]


class Workload:
    """Shared helpers: seeded token streams per named component."""

    def __init__(self, options: Options) -> None:
        self.o = options
        if options.token_low < 0 or options.token_high < options.token_low:
            raise WorkloadError("token ids: need 0 <= --token-low <= --token-high")
        if options.max_tokens < 1:
            raise WorkloadError("--max-tokens must be at least 1")
        self.reuse = Reuse.parse(options.reuse)  # checked for every workload: a typo is an error

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.o.seed}/{self.o.workload}/{name}")

    def tokens(self, name: str, n: int) -> list[int]:
        rng = self.rng(name)
        return [rng.randint(self.o.token_low, self.o.token_high) for _ in range(n)]

    def count(self) -> int | None:
        """Requests of a pooled measured pass (None: endless, the run has a duration)."""
        return self.o.requests

    def passes(self) -> Iterator[PassSpec]:
        raise NotImplementedError


def _positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise WorkloadError(f"--{name.replace('_', '-')} must be at least 1")


class LongDocQA(Workload):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        o = options
        _positive(documents=o.documents, document_tokens=o.document_tokens, questions=o.questions,
                  question_tokens=o.question_tokens)  # fmt: skip
        if o.order not in ORDERS:
            raise WorkloadError(f"--order must be one of {', '.join(ORDERS)}")
        self.docs = [self.tokens(f"doc{d}", o.document_tokens) for d in range(o.documents)]

    def order(self) -> list[tuple[int, int]]:
        """(document, ask) of the measured pass."""
        d, q = self.o.documents, self.o.questions
        if self.o.order == "interleave":
            return [(doc, ask) for doc in range(d) for ask in range(q)]
        out = [(doc, ask) for ask in range(q) for doc in range(d)]
        if self.o.order == "random":
            self.rng("order").shuffle(out)
        return out

    def _ask(self, name: str, index: int, doc: int, tag: str) -> RequestSpec:
        question = self.tokens(f"question/{tag}", self.o.question_tokens)
        return RequestSpec(name, index, self.docs[doc] + question, self.o.max_tokens, f"doc{doc}")

    def passes(self) -> Iterator[PassSpec]:
        d = self.o.documents
        warm = (self._ask("warmup", i, i, f"warm{i}") for i in range(d))
        yield PassSpec("warmup", False, warm, d)
        order = self.order()
        measured = (self._ask("measured", i, doc, f"{doc}/{ask}") for i, (doc, ask) in enumerate(order))
        yield PassSpec("measured", True, measured, len(order))


class MultiRoundChat(Workload):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        o = options
        _positive(users=o.users, rounds=o.rounds, system_tokens=o.system_tokens, user_tokens=o.user_tokens)
        self.system = self.tokens("system", o.system_tokens)

    def passes(self) -> Iterator[PassSpec]:
        o = self.o
        history: dict[int, list[int]] = {u: list(self.system) for u in range(o.users)}
        for r in range(o.rounds):
            name = f"round{r + 1}"
            specs: list[RequestSpec] = []
            for u in sorted(history):
                prompt = history[u] + self.tokens(f"user{u}/round{r}", o.user_tokens)
                specs.append(RequestSpec(name, len(specs), prompt, o.max_tokens, f"user{u}", want_ids=True))
            yield PassSpec(name, r > 0, iter(specs), len(specs))
            # Built after the round has finished: a user whose answer failed leaves the chat.
            history = {int(s.group[4:]): s.prompt + s.output_ids for s in specs if s.ok and s.output_ids}
            if not history:
                return


class SharedSystemPrompt(Workload):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        o = options
        _positive(system_tokens=o.system_tokens, system_prompts=o.system_prompts,
                  question_tokens=o.question_tokens, requests=o.requests)  # fmt: skip
        self.systems = [self.tokens(f"system{k}", o.system_tokens) for k in range(o.system_prompts)]

    def _ask(self, name: str, index: int, k: int) -> RequestSpec:
        question = self.tokens(f"question/{name}{index}", self.o.question_tokens)
        return RequestSpec(name, index, self.systems[k] + question, self.o.max_tokens, f"system{k}")

    def passes(self) -> Iterator[PassSpec]:
        k = len(self.systems)
        yield PassSpec("warmup", False, (self._ask("warmup", i, i) for i in range(k)), k)
        picks = self.reuse.sampler(k, self.rng("picks"))
        n = self.count()
        indexes = range(n) if n is not None else itertools.count()
        yield PassSpec("measured", True, (self._ask("measured", i, next(picks)) for i in indexes), n)


class PrefixSuffixTuner(Workload):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        o = options
        _positive(context_tokens=o.context_tokens, suffix_tokens=o.suffix_tokens, requests=o.requests)
        if o.breaker_tokens < 0:
            raise WorkloadError("--breaker-tokens must be at least 0")
        self.prefix_tokens = o.context_tokens - o.breaker_tokens - o.suffix_tokens
        if self.prefix_tokens < 1:
            raise WorkloadError("--context-tokens must exceed --breaker-tokens + --suffix-tokens")
        self.pool = self.pool_size(o, self.prefix_tokens)
        self.breaker = self.tokens("breaker", o.breaker_tokens)
        self._prefixes: dict[int, list[int]] = {}

    @staticmethod
    def pool_size(o: Options, prefix_tokens: int) -> int:
        if o.pool_size is not None:
            _positive(pool_size=o.pool_size)
            return o.pool_size
        if o.capacity_tokens is None:
            raise WorkloadError(
                "prefix-suffix-tuner needs --pool-size, or a tier capacity: --capacity-tokens or "
                "--sidecar-url"
            )
        if not (o.pool_multiple > 0 and math.isfinite(o.pool_multiple)):
            raise WorkloadError("--pool-multiple must be above 0")
        return max(1, math.ceil(o.pool_multiple * o.capacity_tokens / prefix_tokens))

    def prefix(self, p: int) -> list[int]:
        if p not in self._prefixes:
            self._prefixes[p] = self.tokens(f"prefix{p}", self.prefix_tokens)
        return self._prefixes[p]

    def _request(self, name: str, index: int, p: int) -> RequestSpec:
        suffix = self.tokens(f"suffix/{name}{index}", self.o.suffix_tokens)
        prompt = self.prefix(p) + self.breaker + suffix
        return RequestSpec(name, index, prompt, self.o.max_tokens, f"prefix{p}")

    def passes(self) -> Iterator[PassSpec]:
        yield PassSpec("warm", False, (self._request("warm", p, p) for p in range(self.pool)), self.pool)
        picks = self.reuse.sampler(self.pool, self.rng("picks"))
        n = self.count()
        indexes = range(n) if n is not None else itertools.count()
        yield PassSpec("measured", True, (self._request("measured", i, next(picks)) for i in indexes), n)


class RandomPrefill(Workload):
    def __init__(self, options: Options) -> None:
        super().__init__(options)
        _positive(prompt_tokens=options.prompt_tokens, requests=options.requests)

    def passes(self) -> Iterator[PassSpec]:
        n = self.count()
        indexes = range(n) if n is not None else itertools.count()
        o = self.o
        specs = (
            RequestSpec("measured", i, self.tokens(f"prompt{i}", o.prompt_tokens), o.max_tokens, "unique")
            for i in indexes
        )
        yield PassSpec("measured", True, specs, n)


def build(options: Options) -> Workload:
    kinds: dict[str, type[Workload]] = {
        "long-doc-qa": LongDocQA,
        "multi-round-chat": MultiRoundChat,
        "shared-system-prompt": SharedSystemPrompt,
        "prefix-suffix-tuner": PrefixSuffixTuner,
        "random-prefill": RandomPrefill,
    }
    if options.workload not in kinds:
        raise WorkloadError(f"unknown workload {options.workload!r}; one of {', '.join(WORKLOADS)}")
    return kinds[options.workload](options)
