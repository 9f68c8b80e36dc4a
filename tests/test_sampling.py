"""Tests of zgen.runtime.sampling: filters keep exactly the right tokens, distributions are right, runs are
reproducible and independent of the batch, penalties follow their formulas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zgen.errors import ConfigError
from zgen.runtime.sampling import (
    TOP_K_CANDIDATE_LIMIT,
    PenaltyState,
    SamplingConfig,
    SamplingFlags,
    SamplingParams,
    apply_penalties,
    filter_logits,
    host_candidates,
    init_penalty_state,
    make_host_sampler,
    make_row_keys,
    sample,
    update_penalty_state,
)

V = 32  # vocabulary of the property tests (fixed, so each flag set compiles once)
B = 4  # rows per example
STEPS = 24  # draws per row and example

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# no subnormals: XLA:CPU flushes them to zero, numpy does not
logit_values = st.one_of(
    st.floats(-8.0, 8.0, width=32, allow_subnormal=False), st.sampled_from([0.0, 1.0, -1.0, 2.5])
)
logits_strategy = hnp.arrays(np.float32, (B, V), elements=logit_values)


jit_sample = jax.jit(sample, static_argnums=5)
jit_update = jax.jit(update_penalty_state)


def zero_penalties(b: int, vocab: int) -> PenaltyState:
    return init_penalty_state(jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32), vocab)


@functools.lru_cache(maxsize=None)
def _draws_fn(flags: SamplingFlags):
    """jit(vmap over steps) of sample: returns tokens [STEPS, B]."""

    def draws(logits, params, keys):
        steps = jnp.arange(STEPS, dtype=jnp.int32)
        b, v = logits.shape
        penalties = zero_penalties(b, v)
        return jax.vmap(lambda t: sample(logits, params, penalties, keys, t, flags))(steps)

    return jax.jit(draws)


def draw(configs: list[SamplingConfig], logits: np.ndarray, flags: SamplingFlags, seed: int = 0) -> np.ndarray:
    params = SamplingParams.from_configs(configs, logits.shape[-1])
    keys = make_row_keys([c.seed for c in configs], default_seed=seed)
    return np.asarray(_draws_fn(flags)(jnp.asarray(logits), params, keys))


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def full_path(**kw: bool) -> SamplingFlags:
    return SamplingFlags(any_greedy=False, **kw)


def candidate_path(**kw: bool) -> SamplingFlags:
    return SamplingFlags(any_greedy=False, top_k=True, top_k_width=V, candidates=True, **kw)


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "hot"},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"seed": 1.5},
        {"seed": "42"},
        {"max_new_tokens": 0},
        {"max_new_tokens": -5},
        {"stop": ("",)},
        {"stop": ("ok", 3)},
        {"stop_token_ids": (-1,)},
        {"stop_token_ids": (1.0,)},
        {"ignore_eos": "yes"},
    ],
)
def test_invalid_configs_raise_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_config_defaults_and_normalization() -> None:
    c = SamplingConfig()
    assert (c.temperature, c.top_k, c.top_p, c.min_p, c.max_new_tokens) == (1.0, 0, 1.0, 0.0, 256)
    assert not c.greedy and not c.uses_penalties
    assert SamplingConfig(temperature=0).greedy
    c = SamplingConfig(stop="###", stop_token_ids=[5, 6], temperature=1)  # type: ignore[arg-type]
    assert c.stop == ("###",) and c.stop_token_ids == (5, 6) and isinstance(c.temperature, float)
    hash(c)  # frozen and hashable


# --------------------------------------------------------------------------------------------- flags


def test_flags_from_configs() -> None:
    greedy = SamplingConfig(temperature=0.0, top_k=5)
    f = SamplingFlags.from_configs([greedy, greedy], 1000)
    assert f.all_greedy and f.any_greedy and not f.top_k and not f.penalties
    f = SamplingFlags.from_configs([greedy, SamplingConfig(top_k=40, top_p=0.9)], 1000)
    assert not f.all_greedy and f.any_greedy and f.top_k and f.top_p and not f.min_p
    assert f.candidates and f.top_k_width == 64
    f = SamplingFlags.from_configs([SamplingConfig(top_k=40), SamplingConfig(min_p=0.1)], 1000)
    assert not f.candidates and f.top_k_width == 64 and f.min_p  # a row without top-k: whole vocabulary
    f = SamplingFlags.from_configs([SamplingConfig(top_k=TOP_K_CANDIDATE_LIMIT + 1)], 100_000)
    assert not f.candidates and f.top_k and f.top_k_width == 0  # bisection
    f = SamplingFlags.from_configs([SamplingConfig(top_k=5000)], 1000)  # top_k >= V is off
    assert not f.top_k and not f.candidates
    with pytest.raises(ConfigError):
        SamplingFlags(candidates=True)
    f = SamplingFlags.from_configs([SamplingConfig(repetition_penalty=1.2, frequency_penalty=0.5)], 10)
    assert f.repetition_penalty and f.additive_penalties and f.penalties


def test_flags_union_covers_both() -> None:
    a = SamplingFlags.from_configs([SamplingConfig(top_k=20)], 1000)
    b = SamplingFlags.from_configs([SamplingConfig(top_k=300, presence_penalty=0.5)], 1000)
    g = SamplingFlags.from_configs([SamplingConfig(temperature=0)], 1000)
    u = a | b
    assert u.candidates and u.top_k_width == 512 and u.additive_penalties and u.top_k and not u.all_greedy
    assert (a | g) == SamplingFlags(any_greedy=True, top_k=True, top_k_width=32, candidates=True)
    assert (g | g).all_greedy and not (g | g).candidates
    plain = a | SamplingFlags.from_configs([SamplingConfig()], 1000)
    assert not plain.candidates and plain.top_k_width == 32
    big = a | SamplingFlags.from_configs([SamplingConfig(top_k=TOP_K_CANDIDATE_LIMIT + 1)], 10**5)
    assert not big.candidates and big.top_k_width == 0


# --------------------------------------------------------------------------------------------- filters


@SETTINGS
@given(
    logits=logits_strategy,
    ks=st.lists(st.integers(1, V), min_size=B, max_size=B),
    path=st.sampled_from(["candidates", "narrow top-k", "bisection"]),
)
def test_top_k_never_emits_outside_top_k(logits: np.ndarray, ks: list[int], path: str) -> None:
    configs = [SamplingConfig(top_k=k, seed=i) for i, k in enumerate(ks)]
    flags = {
        "candidates": candidate_path(),
        "narrow top-k": SamplingFlags(any_greedy=False, top_k=True, top_k_width=V),
        "bisection": full_path(top_k=True),
    }[path]
    tokens = draw(configs, logits, flags)
    for b, k in enumerate(ks):
        above = (logits[b][None, :] > logits[b][tokens[:, b], None]).sum(-1)  # strictly larger logits
        assert (above < k).all(), (k, logits[b], tokens[:, b])


def _mass_above(p: np.ndarray, i: np.ndarray) -> np.ndarray:
    return np.array([p[p > p[j]].sum() for j in i])


@SETTINGS
@given(
    logits=logits_strategy,
    top_ps=st.lists(st.floats(0.01, 1.0), min_size=B, max_size=B),
    ks=st.lists(st.integers(0, V), min_size=B, max_size=B),
    path=st.sampled_from(["candidates", "narrow top-k", "bisection"]),
)
def test_top_p_only_emits_from_smallest_nucleus(
    logits: np.ndarray, top_ps: list[float], ks: list[int], path: str
) -> None:
    if path == "candidates":  # the candidate path needs top-k on every row; k = V keeps everything
        ks = [k or V - 1 for k in ks]
    configs = [SamplingConfig(top_p=p, top_k=k, seed=10 + i) for i, (p, k) in enumerate(zip(top_ps, ks))]
    flags = {
        "candidates": candidate_path(top_p=True),
        "narrow top-k": SamplingFlags(any_greedy=False, top_k=True, top_p=True, top_k_width=V),
        "bisection": full_path(top_k=True, top_p=True),
    }[path]
    tokens = draw(configs, logits, flags)
    for b in range(B):
        l64 = logits[b].astype(np.float64)
        if 0 < ks[b] < V:  # top-p renormalizes over the top-k set (ties with the k-th included)
            kth = np.sort(l64)[::-1][ks[b] - 1]
            l64 = np.where(l64 >= kth, l64, -np.inf)
        p = softmax64(l64)
        assert (p[tokens[:, b]] > 0).all()
        # a token is in the nucleus iff the mass of the strictly more probable tokens is below top_p
        assert (_mass_above(p, tokens[:, b]) < top_ps[b] + 1e-5).all(), (top_ps[b], p, tokens[:, b])


@SETTINGS
@given(
    logits=logits_strategy,
    min_ps=st.lists(st.floats(0.0, 1.0), min_size=B, max_size=B),
    temperature=st.floats(0.3, 2.0),
    candidates=st.booleans(),
)
def test_min_p_only_emits_tokens_above_min_p_times_max(
    logits: np.ndarray, min_ps: list[float], temperature: float, candidates: bool
) -> None:
    ks = [V - 1 if candidates else 0] * B
    configs = [
        SamplingConfig(min_p=m, top_k=k, temperature=temperature, seed=i) for i, (m, k) in enumerate(zip(min_ps, ks))
    ]
    flags = candidate_path(min_p=True) if candidates else full_path(min_p=True)
    tokens = draw(configs, logits, flags)
    for b in range(B):
        p = softmax64(logits[b].astype(np.float64) / np.float32(temperature))
        assert (p[tokens[:, b]] >= min_ps[b] * p.max() * (1 - 1e-4)).all()


@SETTINGS
@given(logits=hnp.arrays(np.float32, (B, V), elements=logit_values))
def test_greedy_is_argmax(logits: np.ndarray) -> None:
    greedy = [SamplingConfig(temperature=0.0, top_k=3, top_p=0.5)] * B
    expected = np.argmax(logits, axis=-1)
    tokens = draw(greedy, logits, SamplingFlags.from_configs(greedy, V))
    assert (tokens == expected[None]).all()
    mixed = [greedy[0], SamplingConfig(top_k=5, min_p=0.2), greedy[0], SamplingConfig(top_p=0.7)]
    tokens = draw(mixed, logits, SamplingFlags.all_features())
    assert (tokens[:, [0, 2]] == expected[None, [0, 2]]).all()


# --------------------------------------------------------------------------------------------- distributions


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the support was drawn"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def reference_probs(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The next-token distribution a config asks for, in float64: temperature → top-k → top-p → min-p."""
    x = logits.astype(np.float64) / config.temperature
    if 0 < config.top_k < len(x):
        x = np.where(x >= np.sort(x)[::-1][config.top_k - 1], x, -np.inf)
    p = softmax64(x)
    if config.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= config.top_p]] = 0.0
    p = np.where(p >= config.min_p * p.max(), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize(
    ("config", "flags"),
    [
        (SamplingConfig(temperature=0.7), SamplingFlags(any_greedy=False)),
        (SamplingConfig(temperature=1.6), SamplingFlags(any_greedy=False)),
        (SamplingConfig(temperature=0.8, top_k=3), SamplingFlags(top_k=True, top_k_width=16, candidates=True)),
        (SamplingConfig(temperature=0.8, top_k=3), SamplingFlags(top_k=True, top_k_width=4)),
        (SamplingConfig(temperature=0.8, top_k=3), SamplingFlags(any_greedy=False, top_k=True)),
        (SamplingConfig(top_p=0.8), SamplingFlags(any_greedy=False, top_p=True)),  # nucleus: top 4
        (SamplingConfig(top_p=0.8, top_k=6), SamplingFlags(top_k=True, top_p=True, top_k_width=8, candidates=True)),
        (SamplingConfig(top_p=0.8, top_k=6), SamplingFlags(any_greedy=False, top_k=True, top_p=True)),  # top 3
        (SamplingConfig(min_p=0.2, temperature=1.3), SamplingFlags(any_greedy=False, min_p=True)),
        (SamplingConfig(min_p=0.2, top_k=7), SamplingFlags(any_greedy=True, top_k=True, top_p=True, min_p=True)),
    ],
)
def test_sampled_distribution_matches(config: SamplingConfig, flags: SamplingFlags) -> None:
    logits = np.array([2.0, 1.3, 0.9, 0.0, -0.4, -1.0, -2.5, 0.5], np.float32)
    n = 8000
    probs = reference_probs(logits, config)
    params = SamplingParams.from_configs([config], len(logits))
    keys = make_row_keys([1234])
    fn = jax.jit(jax.vmap(lambda s: sample(jnp.asarray(logits)[None], params, None, keys, s, flags)))
    tokens = np.asarray(fn(jnp.arange(n, dtype=jnp.int32)))[:, 0]
    counts = np.bincount(tokens, minlength=len(logits))
    # 7 degrees of freedom at most: P(chi2 > 35) < 1e-5 for a correct sampler (fixed seed: deterministic)
    assert _chi_square(counts, probs) < 35.0, (counts, probs * n)


# --------------------------------------------------------------------------------------------- reproducibility


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    logits[1] = logits[0]
    configs = [SamplingConfig(temperature=1.0, seed=s) for s in (7, 7, 8, 9)]
    flags = SamplingFlags.from_configs(configs, V)
    a = draw(configs, logits, flags, seed=1)
    b = draw(configs, logits, flags, seed=2)  # default_seed only matters for unseeded rows
    assert (a == b).all()
    assert (a[:, 0] == a[:, 1]).all()  # same seed, same logits → same tokens in any row
    assert (a[:, 0] != a[:, 2]).any() and (a[:, 2] != a[:, 3]).any()


def test_unseeded_rows_follow_default_seed() -> None:
    logits = np.random.default_rng(1).normal(size=(B, V)).astype(np.float32)
    configs = [SamplingConfig()] * B
    flags = SamplingFlags.from_configs(configs, V)
    assert (draw(configs, logits, flags, seed=3) == draw(configs, logits, flags, seed=3)).all()
    assert (draw(configs, logits, flags, seed=3) != draw(configs, logits, flags, seed=4)).any()


def test_row_keys_match_jax_keys_and_raw_keys_work() -> None:
    keys = make_row_keys([5, None, 2**40 + 3], default_seed=0)
    data = np.asarray(jax.random.key_data(keys))
    assert (data[0] == np.asarray(jax.random.key_data(jax.random.key(5, impl="threefry2x32")))).all()
    assert (data[2] == [2**8, 3]).all()
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 50)).astype(np.float32))
    params = SamplingParams.from_configs([SamplingConfig()] * 3, 50)
    flags = SamplingFlags(any_greedy=False)
    typed = jit_sample(logits, params, None, keys, jnp.int32(4), flags)
    raw = jit_sample(logits, params, None, jnp.asarray(data), jnp.int32(4), flags)
    per_row = jit_sample(logits, params, None, keys, jnp.array([4, 4, 4]), flags)
    assert (np.asarray(typed) == np.asarray(raw)).all() and (np.asarray(typed) == np.asarray(per_row)).all()


def test_row_tokens_independent_of_batch_and_path() -> None:
    """A seeded request gives the same tokens alone (candidate path) and in a mixed batch (full path)."""
    vocab = 300
    rng = np.random.default_rng(3)
    target = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=77)
    others = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.2, seed=1),
        SamplingConfig(min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingConfig(top_p=0.5, frequency_penalty=0.2, seed=77),
    ]
    batch = [others[0], others[1], target, others[2], others[3]]
    steps = 10
    logits = rng.normal(scale=3.0, size=(steps, vocab)).astype(np.float32)

    def run(configs: list[SamplingConfig], row: int, flags: SamplingFlags) -> list[int]:
        params = SamplingParams.from_configs(configs, vocab)
        keys = make_row_keys([c.seed for c in configs], default_seed=5)
        n = len(configs)
        state = init_penalty_state(jnp.zeros((n, 1), jnp.int32), jnp.ones((n,), jnp.int32), vocab)
        out = []
        for t in range(steps):
            noise = rng.normal(size=(n, vocab)).astype(np.float32) * (np.arange(n) != row)[:, None]
            batch_logits = jnp.asarray(np.stack([logits[t]] * n) + noise)  # other rows: other logits
            tok = jit_sample(batch_logits, params, state, keys, jnp.int32(t), flags)
            state = jit_update(state, tok, jnp.ones((n,), bool))
            out.append(int(tok[row]))
        return out

    alone_flags = SamplingFlags.from_configs([target], vocab)
    assert alone_flags.candidates
    batch_flags = SamplingFlags.from_configs(batch, vocab)
    assert not batch_flags.candidates and batch_flags.penalties
    alone = run([target], 0, alone_flags)
    assert run(batch, 2, batch_flags) == alone  # whole-vocabulary path, top-p by threshold search


@pytest.mark.parametrize(
    "configs",
    [
        [SamplingConfig(top_k=5, seed=1), SamplingConfig(top_k=17, top_p=0.9, temperature=1.5, seed=2)] * 2,
        [SamplingConfig(top_k=1), SamplingConfig(top_p=0.3, seed=3), SamplingConfig(temperature=0), SamplingConfig()],
        [SamplingConfig(min_p=0.1, temperature=0.5), SamplingConfig(top_k=40, min_p=0.1, seed=4)] * 2,
    ],
)
def test_minimal_flags_and_all_features_agree(configs: list[SamplingConfig]) -> None:
    """Every code path (candidates, narrow top-k, threshold search) picks the same tokens."""
    vocab = 40
    params = SamplingParams.from_configs(configs, vocab)
    keys = make_row_keys([c.seed for c in configs], default_seed=0)
    penalties = zero_penalties(len(configs), vocab)
    minimal = SamplingFlags.from_configs(configs, vocab)
    for seed in range(4):
        logits = jnp.asarray(np.random.default_rng(seed).normal(scale=2.0, size=(len(configs), vocab)), jnp.float32)
        for step in range(2):
            a = jit_sample(logits, params, None, keys, jnp.int32(step), minimal)
            b = jit_sample(logits, params, penalties, keys, jnp.int32(step), SamplingFlags.all_features())
            assert (np.asarray(a) == np.asarray(b)).all()


# --------------------------------------------------------------------------------------------- penalties


def _reference_penalties(logits, prompt_mask, counts, rep, pres, freq):
    x = logits.astype(np.float64).copy()
    seen = prompt_mask | (counts > 0)
    rep = rep[:, None]
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - freq[:, None] * counts - pres[:, None] * (counts > 0)


jit_init = jax.jit(init_penalty_state, static_argnums=2)
jit_penalties = jax.jit(apply_penalties, static_argnums=3)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_penalties_match_numpy_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b, t, vocab = 3, 7, 20
    prompt = rng.integers(-2, vocab + 2, size=(b, t))  # out-of-range ids are ignored
    lengths = rng.integers(0, t + 1, size=(b,))
    configs = [
        SamplingConfig(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
        )
        for _ in range(b)
    ]
    params = SamplingParams.from_configs(configs, vocab)
    flags = SamplingFlags.from_configs(configs, vocab)
    state = jit_init(jnp.asarray(prompt), jnp.asarray(lengths), vocab)
    prompt_mask = np.zeros((b, vocab), bool)
    for r in range(b):
        ids = prompt[r, : lengths[r]]
        prompt_mask[r, ids[(ids >= 0) & (ids < vocab)]] = True
    counts = np.zeros((b, vocab), np.int64)
    for _ in range(6):
        tokens = rng.integers(0, vocab, size=(b,))
        active = rng.random(b) < 0.7
        state = jit_update(state, jnp.asarray(tokens), jnp.asarray(active))
        counts[np.arange(b)[active], tokens[active]] += 1
    assert (np.asarray(state.prompt_mask) == prompt_mask).all()
    assert (np.asarray(state.output_counts) == counts).all()
    logits = rng.normal(scale=4.0, size=(b, vocab)).astype(np.float32)
    got = np.asarray(jit_penalties(jnp.asarray(logits), params, state, flags))
    rep = np.array([c.repetition_penalty for c in configs])
    pres = np.array([c.presence_penalty for c in configs])
    freq = np.array([c.frequency_penalty for c in configs])
    want = _reference_penalties(logits, prompt_mask, counts, rep, pres, freq)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_penalties_steer_greedy_and_require_state() -> None:
    logits = jnp.asarray([[3.0, 2.9, -1.0]])
    config = SamplingConfig(temperature=0.0, repetition_penalty=2.0)
    params = SamplingParams.from_configs([config], 3)
    flags = SamplingFlags.from_configs([config], 3)
    state = init_penalty_state(jnp.asarray([[0]]), jnp.asarray([1]), 3)  # token 0 is in the prompt
    assert int(sample(logits, params, state, make_row_keys([0]), jnp.int32(0), flags)[0]) == 1
    with pytest.raises(ConfigError, match="PenaltyState"):
        sample(logits, params, None, make_row_keys([0]), jnp.int32(0), flags)


# --------------------------------------------------------------------------------------------- integration


def test_sample_inside_while_loop() -> None:
    vocab, n, steps = 64, 3, 10
    configs = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(top_k=8, seed=1),
        SamplingConfig(frequency_penalty=1.0, seed=2),
    ]
    params = SamplingParams.from_configs(configs, vocab)
    flags = SamplingFlags.from_configs(configs, vocab)
    table = jax.random.normal(jax.random.key(0), (vocab, vocab))  # a toy "model": next logits = table[token]

    @jax.jit
    def generate(params: SamplingParams, keys: jax.Array, penalties: PenaltyState) -> jax.Array:
        def body(carry):
            step, token, penalties, out = carry
            nxt = sample(table[token], params, penalties, keys, step, flags)
            penalties = update_penalty_state(penalties, nxt, jnp.ones((n,), bool))
            return step + 1, nxt, penalties, out.at[:, step].set(nxt)

        init = (jnp.int32(0), jnp.zeros((n,), jnp.int32), penalties, jnp.zeros((n, steps), jnp.int32))
        return jax.lax.while_loop(lambda c: c[0] < steps, body, init)[3]

    penalties = init_penalty_state(jnp.zeros((n, 1), jnp.int32), jnp.ones((n,), jnp.int32), vocab)
    out = np.asarray(generate(params, make_row_keys([c.seed for c in configs], 0), penalties))
    again = np.asarray(generate(params, make_row_keys([c.seed for c in configs], 0), penalties))
    assert (out == again).all()
    greedy, token = [], 0
    for _ in range(steps):
        token = int(np.argmax(np.asarray(table[token])))
        greedy.append(token)
    assert out[0].tolist() == greedy


def test_filter_logits_and_host_sampler() -> None:
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, 0.5]])
    config = SamplingConfig(top_k=3)
    params = SamplingParams.from_configs([config], 5)
    flags = SamplingFlags.from_configs([config], 5)
    filtered = np.asarray(filter_logits(logits, params, None, flags))
    assert np.isinf(filtered[0, [2, 3]]).all() and np.isfinite(filtered[0, [0, 1, 4]]).all()
    ids, probs = host_candidates(jnp.asarray(filtered), 4)
    assert np.asarray(ids)[0, :3].tolist() == [0, 1, 4] and abs(float(probs[0].sum()) - 1) < 1e-6
    host = make_host_sampler(0)
    picks = {host(np.asarray(ids[0]), np.asarray(probs[0])) for _ in range(200)}
    assert picks == {0, 1, 4}


@pytest.mark.parametrize("ways", [2, 4, 16])
def test_threshold_search_is_exact(ways: int) -> None:
    from zgen.runtime.sampling import _search_ways

    rng = np.random.default_rng(ways)
    target = rng.integers(0, 2**32 - 1, size=64, dtype=np.uint64).astype(np.uint32)
    target[:4] = [0, 1, 2**32 - 2, 2**31]
    lo = jnp.zeros(64, jnp.uint32)
    hi = jnp.full(64, 2**32 - 1, jnp.uint32)
    got = jax.jit(lambda lo, hi, t: _search_ways(ways, lo, hi, lambda m: m <= t[:, None]))(lo, hi, jnp.asarray(target))
    assert (np.asarray(got) == target).all()


def test_accelerator_search_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 16-ary threshold search (GPU/TPU) picks the same tokens as the binary one (CPU)."""
    import zgen.runtime.sampling as zs

    vocab = 100
    configs = [SamplingConfig(top_p=0.7, seed=1), SamplingConfig(top_k=30, top_p=0.95, seed=2), SamplingConfig(top_k=3)]
    logits = jnp.asarray(np.random.default_rng(0).normal(scale=2.0, size=(3, vocab)).astype(np.float32))
    params = SamplingParams.from_configs(configs, vocab)
    keys = make_row_keys([c.seed for c in configs], default_seed=0)
    flags = SamplingFlags(top_k=True, top_p=True)  # threshold searches for both top-k and top-p
    steps = jnp.arange(8, dtype=jnp.int32)

    def tokens() -> np.ndarray:  # a fresh function, so a fresh trace
        return np.asarray(jax.jit(lambda s: jax.vmap(lambda t: sample(logits, params, None, keys, t, flags))(s))(steps))

    binary = tokens()
    monkeypatch.setattr(zs, "_SEARCH_WAYS_CPU", 16)
    assert (tokens() == binary).all()


def test_step_key_is_jax_fold_in() -> None:
    from zgen.runtime.sampling import _step_words

    keys = make_row_keys([3, 2**33 + 5, None], default_seed=1)
    steps = jnp.asarray([0, 7, 2**31 + 9], jnp.uint32)
    want = jax.vmap(lambda k, t: jax.random.key_data(jax.random.fold_in(k, t)))(keys, steps)
    assert (np.asarray(_step_words(keys, steps)) == np.asarray(want)).all()
    assert (np.asarray(_step_words(jax.random.key_data(keys), steps)) == np.asarray(want)).all()


def test_threefry_matches_jax() -> None:
    from jax.extend.random import threefry_2x32

    from zgen.runtime.sampling import _threefry2x32

    rng = np.random.default_rng(0)
    key = rng.integers(0, 2**32, size=2, dtype=np.uint64).astype(np.uint32)
    x = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    want = np.asarray(threefry_2x32(jnp.asarray(key), jnp.asarray(x)))
    o0, o1 = _threefry2x32(jnp.uint32(key[0]), jnp.uint32(key[1]), jnp.asarray(x[:32]), jnp.asarray(x[32:]))
    assert (np.concatenate([np.asarray(o0), np.asarray(o1)]) == want).all()
