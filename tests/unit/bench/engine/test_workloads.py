"""The workloads' token streams: reuse structure, determinism per seed, Zipf skew."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from bench.engine.workloads import (
    Options,
    PassSpec,
    PrefixSuffixTuner,
    RequestSpec,
    Reuse,
    WorkloadError,
    build,
)


def materialize(options: Options) -> list[tuple[PassSpec, list[RequestSpec]]]:
    out = []
    for spec in build(options).passes():
        reqs = list(spec.requests)
        for r in reqs:  # as the sender does: every answer ok, a function of the prompt
            r.output_ids = [len(r.prompt) % 1000 + i for i in range(r.max_tokens)]
            r.ok = True
        out.append((spec, reqs))
    return out


def prompts(options: Options) -> list[list[int]]:
    return [r.prompt for _, reqs in materialize(options) for r in reqs]


def test_long_doc_qa_tile_warms_each_document_then_asks_each_q_times() -> None:
    o = Options("long-doc-qa", seed=3, documents=3, document_tokens=40, questions=2, question_tokens=5)
    (warm, wreqs), (meas, mreqs) = materialize(o)
    assert (warm.name, warm.measured, warm.total) == ("warmup", False, 3)
    assert (meas.name, meas.measured, meas.total) == ("measured", True, 6)
    docs = [r.prompt[:40] for r in wreqs]
    assert len({tuple(d) for d in docs}) == 3
    assert [r.group for r in mreqs] == ["doc0", "doc1", "doc2", "doc0", "doc1", "doc2"]
    for r in mreqs:
        assert len(r.prompt) == 45
        assert r.prompt[:40] == docs[int(r.group[3:])]
    questions = [tuple(r.prompt[40:]) for r in wreqs + mreqs]
    assert len(set(questions)) == len(questions)  # every ask has its own question
    assert all(100 <= t <= 7999 for p in prompts(o) for t in p)


def test_long_doc_qa_orders() -> None:
    base = {"documents": 4, "document_tokens": 16, "questions": 3, "question_tokens": 2}
    inter = materialize(Options("long-doc-qa", order="interleave", **base))[1][1]  # type: ignore[arg-type]
    assert [r.group for r in inter] == [f"doc{d}" for d in range(4) for _ in range(3)]
    rand = materialize(Options("long-doc-qa", order="random", **base))[1][1]  # type: ignore[arg-type]
    groups = [r.group for r in rand]
    assert Counter(groups) == Counter(f"doc{d}" for d in range(4) for _ in range(3))
    assert groups != [f"doc{d}" for _ in range(3) for d in range(4)]
    with pytest.raises(WorkloadError):
        build(Options("long-doc-qa", order="sideways"))


@pytest.mark.parametrize(
    "options",
    [
        Options("long-doc-qa", documents=2, document_tokens=30, questions=2),
        Options("multi-round-chat", users=2, rounds=2, system_tokens=20, user_tokens=5, max_tokens=3),
        Options("shared-system-prompt", system_tokens=20, question_tokens=4, requests=5, reuse="zipf:1.2"),
        Options("prefix-suffix-tuner", context_tokens=50, suffix_tokens=10, pool_size=3, requests=6),
        Options("random-prefill", prompt_tokens=30, requests=4),
    ],
    ids=lambda o: o.workload,
)
def test_every_workload_is_a_function_of_its_seed(options: Options) -> None:
    import dataclasses

    same = prompts(options)
    assert same == prompts(dataclasses.replace(options))
    other = prompts(dataclasses.replace(options, seed=options.seed + 1))
    assert len(other) == len(same) and other != same


def test_multi_round_chat_history_grows_by_each_real_answer() -> None:
    o = Options("multi-round-chat", users=3, rounds=3, system_tokens=12, user_tokens=4, max_tokens=2)
    passes = materialize(o)
    names = [(p.name, p.measured) for p, _ in passes]
    assert names == [("round1", False), ("round2", True), ("round3", True)]
    system = passes[0][1][0].prompt[:12]
    for _, reqs in passes:
        assert all(r.prompt[:12] == system and r.want_ids for r in reqs)
    for (_, prev), (_, cur) in itertools.pairwise(passes):
        for a, b in zip(prev, cur, strict=True):
            assert a.group == b.group
            assert b.prompt[: len(a.prompt) + 2] == a.prompt + a.output_ids
            assert len(b.prompt) == len(a.prompt) + 2 + 4


def test_multi_round_chat_user_with_failed_answer_leaves() -> None:
    o = Options("multi-round-chat", users=3, rounds=2, system_tokens=8, user_tokens=2, max_tokens=1)
    gen = build(o).passes()
    first = list(next(gen).requests)
    for r in first:
        r.ok, r.output_ids = r.group != "user1", [5]
    second = list(next(gen).requests)
    assert [r.group for r in second] == ["user0", "user2"]


def test_prefix_suffix_tuner_structure_and_pool_from_capacity() -> None:
    o = Options(
        "prefix-suffix-tuner", context_tokens=64, suffix_tokens=8, breaker_tokens=4,
        capacity_tokens=1000, pool_multiple=1.05, requests=40,
    )  # fmt: skip
    tuner = build(o)
    assert isinstance(tuner, PrefixSuffixTuner)
    assert tuner.prefix_tokens == 52
    assert tuner.pool == math.ceil(1.05 * 1000 / 52) == 21
    (warm, wreqs), (_, mreqs) = materialize(o)
    assert warm.total == 21 and [r.group for r in wreqs] == [f"prefix{p}" for p in range(21)]
    prefixes = {r.group: r.prompt[:52] for r in wreqs}
    breaker = wreqs[0].prompt[52:56]
    suffixes = set()
    for r in wreqs + mreqs:
        assert len(r.prompt) == 64
        assert r.prompt[:52] == prefixes[r.group]
        assert r.prompt[52:56] == breaker
        suffixes.add(tuple(r.prompt[56:]))
    assert len(suffixes) == 61  # every request's suffix is its own
    assert len(mreqs) == 40
    with pytest.raises(WorkloadError, match="pool-size"):
        build(Options("prefix-suffix-tuner"))
    with pytest.raises(WorkloadError, match="context-tokens"):
        build(
            Options("prefix-suffix-tuner", context_tokens=10, suffix_tokens=8, breaker_tokens=2, pool_size=1)
        )


def test_zipf_reuse_is_skewed_and_uniform_is_flat() -> None:
    n, draws = 20, 20000
    rng = random.Random(1)
    zipf = Counter(x for x, _ in zip(Reuse.parse("zipf:1.1").sampler(n, rng), range(draws), strict=False))
    flat = Counter(x for x, _ in zip(Reuse.parse("uniform").sampler(n, rng), range(draws), strict=False))
    harmonic = sum(1 / k**1.1 for k in range(1, n + 1))
    ranked = [c for _, c in zipf.most_common()]
    # The most popular entry gets 1/H(n, 1.1) of the draws; the k-th about 1/k^1.1 of that.
    assert abs(ranked[0] / draws - 1 / harmonic) < 0.02
    assert abs(ranked[1] / ranked[0] - 2**-1.1) < 0.06
    assert ranked[0] > 8 * ranked[-1]
    assert max(flat.values()) < 1.25 * draws / n and min(flat.values()) > 0.75 * draws / n
    # Popularity is a seeded ranking, not pool order.
    assert zipf.most_common(1)[0][0] != 0 or zipf.most_common(2)[1][0] != 1


def test_shared_system_prompt_picks_system_prompts_by_reuse() -> None:
    o = Options(
        "shared-system-prompt", system_tokens=30, system_prompts=4, question_tokens=3, requests=400,
        reuse="zipf:1.5",
    )  # fmt: skip
    (_, wreqs), (_, mreqs) = materialize(o)
    systems = {r.group: r.prompt[:30] for r in wreqs}
    assert len(systems) == 4 and len({tuple(s) for s in systems.values()}) == 4
    for r in mreqs:
        assert r.prompt[:30] == systems[r.group] and len(r.prompt) == 33
    counts = Counter(r.group for r in mreqs).most_common()
    assert counts[0][1] > 2 * counts[-1][1]


def test_random_prefill_shares_nothing() -> None:
    reqs = materialize(Options("random-prefill", prompt_tokens=64, requests=10))[0][1]
    assert len(reqs) == 10
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 10


def test_duration_makes_pooled_passes_endless() -> None:
    spec = next(build(Options("random-prefill", prompt_tokens=4, requests=None)).passes())
    assert spec.total is None
    assert len([r for r, _ in zip(spec.requests, range(500), strict=False)]) == 500


@pytest.mark.parametrize("text", ["zipf", "zipf:0", "zipf:-1", "zipf:x", "zipf:nan", "gauss"])
def test_bad_reuse_is_a_clear_error(text: str) -> None:
    with pytest.raises(WorkloadError, match="reuse"):
        Reuse.parse(text)


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(WorkloadError, match="documents"):
        build(Options("long-doc-qa", documents=0))
    with pytest.raises(WorkloadError, match="token"):
        build(Options("random-prefill", token_low=10, token_high=5))
    with pytest.raises(WorkloadError, match="unknown workload"):
        build(Options("nope"))
