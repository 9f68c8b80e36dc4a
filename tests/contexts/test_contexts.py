"""Contexts and the engine (float32): parity, forks, sharing, persistence, masking, batching.

The model is a two-layer random Llama with SmolLM2's tokenizer and chat template (see tests/conftest.py),
checked against HF's own model of the same weights; the real SmolLM2 ends a chat turn with EOS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import hf_greedy, hf_logits
from zgen import Context, Engine, EngineConfig, Generator, Sampler, SamplingConfig, stop
from zgen.cache.base import LayerKV
from zgen.cache.factory import paged_kv
from zgen.contexts import NgramDrafter, drop_export, gather, import_kv_pages
from zgen.runtime.step import ModelSpec, forward
from zgen.errors import CacheError, ConfigError, InputError, PromptTooLongError, SnapshotError, TokenIdError
from zgen.model import Model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(small_chat: Model) -> Engine:
    return Engine(small_chat, paged_kv(96), config=EngineConfig(steps_per_sync=8))


@pytest.fixture(scope="module")
def hf_small_chat(small_chat_checkpoint: tuple[Path, Any]) -> Any:
    return small_chat_checkpoint[1]


@pytest.fixture(autouse=True)
def store_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path / "store"))
    return tmp_path / "store"


def _context(engine: Engine, text: str = PROMPT, **kw: Any) -> Context:
    ctx = Context(engine, **kw)
    ctx.fill(text)
    return ctx


def test_generate_equals_hf_greedy(engine: Engine, hf_small_chat: Any) -> None:
    ctx = _context(engine)
    prompt = ctx.token_ids
    result = ctx.generate_result(Sampler.greedy(), stop.max_len(16))
    expected, logprobs = hf_greedy(hf_small_chat, prompt, 16, eos=[engine.model.tokenizer.eos_ids[0]])
    assert result.token_ids == expected[: len(result.token_ids)] and len(result.token_ids) == 16
    np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-3)
    assert result.finish_reason == "length"
    assert ctx.token_ids == prompt + result.token_ids and ctx.kv_len == len(ctx.token_ids) - 1


def test_chat_turns_render_the_template_and_generate_like_the_generator(engine: Engine) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    ctx = Context(engine)
    ctx.fill_system(messages[0]["content"])
    ctx.fill_user(messages[1]["content"])
    result = ctx.generate_result(Sampler.greedy(), stop.max_len(12) | stop.ends_with_any(engine.model.eos_token_ids))
    tokenizer = engine.model.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert ctx.token_ids[: len(prompt)] == prompt
    reference = Generator(engine.model).chat(messages, SamplingConfig(temperature=0.0, max_new_tokens=12))
    assert result.token_ids[: len(reference.token_ids)] == reference.token_ids
    assert ctx.messages[-1]["role"] == "assistant"


def test_a_reply_generated_in_pieces_is_one_turn(smollm2: Model) -> None:
    engine = Engine(smollm2, paged_kv(32), config=EngineConfig(steps_per_sync=8))
    ctx = Context(engine)
    ctx.fill_user("Say hi.")
    eos = stop.ends_with_any(engine.model.eos_token_ids)
    first = ctx.generate_result(Sampler.greedy(), stop.max_len(3) | eos)
    rest = ctx.generate_result(Sampler.greedy(), stop.max_len(64) | eos)
    assert first.finish_reason == "length" and rest.finish_reason == "stop"
    assert ctx.messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": first.text + rest.text}]
    ctx.fill_user("Again.")
    tokenizer = engine.model.tokenizer
    rendered = tokenizer.apply_chat_template(ctx.messages, add_generation_prompt=False)
    assert ctx.token_ids == tokenizer.encode(rendered, add_special_tokens=False)  # the context is the chat


def test_fork_generates_what_a_fresh_context_generates(engine: Engine) -> None:
    base = _context(engine, "Once upon a time, in a small village by the sea, there lived")
    base.flush()
    before = base.token_ids
    left, right = base.fork(), base.fork()
    left.fill(" a fisherman")
    out = right.generate_result(Sampler.greedy(), stop.max_len(10))
    fresh = Context(engine)
    fresh.fill_tokens(before)
    assert fresh.generate_result(Sampler.greedy(), stop.max_len(10)).token_ids == out.token_ids
    assert base.token_ids == before and left.token_ids[: len(before)] == before
    assert left.generate_result(Sampler.greedy(), stop.max_len(4)).token_ids  # its own continuation
    assert right.token_ids == before + out.token_ids  # untouched by the sibling's fill and decode


def test_forks_share_the_prefix_pages(engine: Engine) -> None:
    base = _context(engine, " ".join(["alpha beta gamma delta"] * 30))  # > 100 tokens
    base.flush()
    prefix_pages = base.pages_used
    used_before = engine.kv.pool.num_used
    forks = [base.fork() for _ in range(8)]
    for i, fork in enumerate(forks):
        fork.fill(f" {i}")
        fork.generate(Sampler.greedy(), stop.max_len(3))
    grown = engine.kv.pool.num_used - used_before
    assert prefix_pages >= 6
    assert grown <= 2 * len(forks)  # P + O(N): each fork owns only its copied last page and its new one
    assert base.pages_shared >= prefix_pages - 1  # every full page is shared with the forks
    for fork in forks:
        fork.release()
    assert engine.kv.pool.num_used == used_before


_REOPEN = """
import json, sys
from zgen import Context, Sampler, load_model, stop
ctx = Context.open(load_model(sys.argv[1], dtype="float32"), "story")
print(json.dumps(ctx.generate_result(Sampler.greedy(), stop.max_len(8)).token_ids))
"""


def test_save_then_open_in_a_new_process_continues_exactly(engine: Engine, store_dir: Path, small_chat_checkpoint: tuple[Path, Any]) -> None:
    ctx = _context(engine, "A recipe for pancakes: first,")
    ctx.generate(Sampler.greedy(), stop.max_len(4))
    ctx.mask_token_range(1, 3)  # masks travel with the snapshot
    ctx.save("story")
    expected = ctx.generate_result(Sampler.greedy(), stop.max_len(8)).token_ids
    env = {**os.environ, "ZGEN_STORE_DIR": str(store_dir), "PYTHONPATH": str(Path(__file__).parents[2])}
    reopen = [sys.executable, "-c", _REOPEN, str(small_chat_checkpoint[0])]
    out = subprocess.run(reopen, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
    again = Context.open(engine, "story")
    assert again.generate_result(Sampler.greedy(), stop.max_len(8)).token_ids == expected


def test_open_refuses_foreign_missing_and_badly_named_snapshots(engine: Engine, store_dir: Path, tiny_engine: Engine) -> None:
    ctx = _context(engine)
    ctx.save("mine")
    used = tiny_engine.kv.pool.num_used
    with pytest.raises(SnapshotError, match="different model"):
        Context.open(tiny_engine, "mine")
    assert tiny_engine.kv.pool.num_used == used
    with pytest.raises(SnapshotError, match="no snapshot"):
        Context.open(engine, "nothing-here")
    with pytest.raises(InputError):
        ctx.save("../escape")
    (store_dir / "mine" / (store_dir / "mine" / "CURRENT").read_text() / "meta.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="unreadable"):
        Context.open(engine, "mine")


class _ExplicitMaskState:
    """Reference attention: dense K/V of one sequence, softmax over an explicit key mask."""

    def __init__(self, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], visible: jax.Array) -> None:
        self.k, self.v, self.visible = k, v, visible

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> _ExplicitMaskState:
        ks, vs = list(self.k), list(self.v)
        ks[layer] = self.k[layer].at[:, positions[0]].set(k[0])
        vs[layer] = self.v[layer].at[:, positions[0]].set(v[0])
        return _ExplicitMaskState(tuple(ks), tuple(vs), self.visible)

    def attend(self, layer: int, q: jax.Array, positions: jax.Array, *, sliding_window: int | None) -> jax.Array:
        k, v = self.k[layer][0], self.v[layer][0]  # [S, KVH, D]
        t, h, d = q.shape[1:]
        groups = h // k.shape[1]
        kk, vv = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
        scores = jnp.einsum("thd,shd->hts", q[0], kk) / np.sqrt(d)
        slots = jnp.arange(k.shape[0])
        mask = (slots[None, :] <= positions[0][:, None]) & self.visible[None, :]
        weights = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("hts,shd->thd", weights, vv)[None]

    def layer_view(self, layer: int) -> LayerKV:
        return LayerKV(self.k[layer], self.v[layer])


def _reference_logits(model: Model, ids: list[int], phases: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Last-token logits when ``ids`` are fed in phases ``(end, masked)``: the tokens up to ``end`` attend
    with that phase's mask (masks hide keys from later queries; K/V already computed stay as they are)."""
    c = model.config
    shape = (1, len(ids), c.num_kv_heads, c.head_dim)
    zeros = tuple(jnp.zeros(shape) for _ in range(c.num_layers))
    state = _ExplicitMaskState(zeros, zeros, jnp.ones(len(ids), bool))
    start, logits = 0, None
    for end, masked in phases:
        hidden = np.zeros(len(ids), bool)
        hidden[: len(masked)] = masked
        state = _ExplicitMaskState(state.k, state.v, jnp.asarray(~hidden))
        positions = jnp.arange(start, end)[None]
        spec = ModelSpec(model.graph, model.config.sliding_window)
        logits, state = forward(spec, model.params, state, jnp.asarray([ids[start:end]]), positions, jnp.asarray([[end - start - 1]]))
        start = end
    assert logits is not None
    return np.asarray(logits[0, 0])


def test_masked_tokens_are_ignored_and_dropped_pages_return(engine: Engine) -> None:
    ctx = _context(engine, " ".join(f"item{i}" for i in range(40)) + " and the last item is")
    ctx.flush()
    unmasked = np.zeros(ctx.num_tokens, bool)
    phases = [(ctx.kv_len, unmasked)]
    ctx.mask_token_range(5, 21)  # cuts through pages: token-level masks
    got = ctx.forward().output_logits([0]).execute().logits[0]
    phases.append((ctx.num_tokens, ctx.masked_flags))
    np.testing.assert_allclose(got, _reference_logits(engine.model, ctx.token_ids, phases), atol=2e-4, rtol=1e-4)

    ctx.mask_token_range(0, 48)  # three whole pages (0-47), then drop them
    free_before = engine.kv.pool.num_free
    assert ctx.drop_masked_kv_pages() == 3
    assert engine.kv.pool.num_free == free_before + 3
    with pytest.raises(CacheError, match="dropped"):
        ctx.mask_token_range(0, 4, masked=False)
    ctx.fill(" number")
    dist = ctx.decode_step_dist()  # over dropped and masked pages
    phases.append((ctx.num_tokens, ctx.masked_flags))
    expected = _reference_logits(engine.model, ctx.token_ids, phases)
    probs = np.exp(expected - expected.max())
    probs /= probs.sum()
    np.testing.assert_allclose(dist.probs[:20], probs[dist.ids[:20]], atol=1e-5)


def test_attention_mask_override_equals_the_explicit_reference(engine: Engine) -> None:
    ctx = _context(engine, "red green blue")
    n = ctx.kv_len
    extra = engine.model.tokenizer.encode(" yellow purple", add_special_tokens=False)
    total = ctx.num_tokens + len(extra)
    fed = total - n
    mask = np.tril(np.ones((fed, total), bool), k=n)
    mask[:, 1] = False  # every fed token ignores token 1
    out = ctx.forward().input_tokens(extra).attention_mask(mask).output_logits([fed - 1]).execute()
    hidden = np.zeros(total, bool)
    hidden[1] = True
    reference = _reference_logits(engine.model, ctx.token_ids, [(n, np.zeros(total, bool)), (total, hidden)])
    np.testing.assert_allclose(out.logits[fed - 1], reference, atol=2e-4, rtol=1e-4)


def test_concurrent_contexts_match_sequential_runs_with_fewer_forward_passes(engine: Engine) -> None:
    prompts = ["The sky is", "My favourite food is", "In 1969, humans", "def fibonacci(n):"]
    sampler, limit = Sampler.greedy(), stop.max_len(12)
    start = engine.stats.forward_passes
    sequential = [_context(engine, p).generate_result(sampler, limit).token_ids for p in prompts]
    sequential_passes = engine.stats.forward_passes - start
    contexts = [_context(engine, p) for p in prompts]
    start = engine.stats.forward_passes
    results = gather(*(c.generate_result_async(sampler, limit) for c in contexts))
    batched_passes = engine.stats.forward_passes - start
    assert [r.token_ids for r in results] == sequential
    assert batched_passes * 2 <= sequential_passes


def test_decode_step_dist_is_the_next_token_distribution(engine: Engine) -> None:
    ctx = _context(engine)
    before = ctx.token_ids
    dist = ctx.decode_step_dist()
    assert dist.ids.shape == (engine.model.config.vocab_size,)
    assert np.all(np.diff(dist.probs) <= 0) and abs(dist.probs.sum() - 1) < 1e-6
    assert ctx.token_ids == before and ctx.kv_len == len(before) - 1
    assert int(dist.ids[0]) == ctx.generate_result(Sampler.greedy(), stop.max_len(1)).token_ids[0]


def test_forward_pass_samples_at_chosen_indices(engine: Engine, hf_small_chat: Any) -> None:
    ctx = _context(engine, "One, two, three,")
    continuation = engine.model.tokenizer.encode(" four, five", add_special_tokens=False)
    prompt = ctx.token_ids
    last = len(ctx.pending_ids) - 1  # indices count over the fed tokens: pending ones, then inputs
    out = ctx.forward().input_tokens(continuation).sample(range(last, last + len(continuation) + 1), Sampler.greedy()).execute()
    hf_choices = hf_logits(hf_small_chat, prompt + continuation)[len(prompt) - 1 :].argmax(-1)
    assert out.tokens == hf_choices.tolist()
    assert ctx.token_ids == prompt + continuation and ctx.kv_len == len(ctx.token_ids)
    with pytest.raises(InputError, match="outside"):
        ctx.forward().input_tokens([5]).sample([3], Sampler.greedy()).execute()
    assert ctx.token_ids == prompt + continuation  # the failed pass left nothing behind


def test_ngram_drafter_gives_plain_generate_output_in_fewer_passes(engine: Engine) -> None:
    text = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    limit = stop.max_len(24)
    start = engine.stats.forward_passes
    plain = _context(engine, text).generate_result(Sampler.greedy(), limit)
    plain_passes = engine.stats.forward_passes - start
    ctx = _context(engine, text)
    start = engine.stats.forward_passes
    drafted = ctx.generate_with_drafter(NgramDrafter(max_draft=6), Sampler.greedy(), limit)
    assert drafted.token_ids == plain.token_ids
    assert engine.stats.forward_passes - start < plain_passes
    assert ctx.kv_len == len(ctx.token_ids) - 1
    sampled = Sampler.top_k(0.9, 20)
    a = _context(engine, text, seed=3).generate_result(sampled, limit)
    b = _context(engine, text, seed=3).generate_with_drafter(NgramDrafter(), sampled, limit)
    assert a.token_ids == b.token_ids  # same draws per position: sampling is exact too


def test_multi_token_stop_rolls_back_exactly(engine: Engine) -> None:
    free = _context(engine).generate_result(Sampler.greedy(), stop.max_len(16)).token_ids
    sequence = free[5:7]
    ctx = _context(engine)
    prompt = ctx.token_ids
    out = ctx.generate_result(Sampler.greedy(), stop.max_len(16) | stop.ends_with(sequence))
    assert out.token_ids == free[:7] and out.finish_reason == "stop"
    assert out.text == engine.model.tokenizer.decode(free[:5])
    assert ctx.token_ids == prompt + free[:7] and ctx.kv_len == len(ctx.token_ids) - 1
    assert ctx.generate_result(Sampler.greedy(), stop.max_len(4)).token_ids == free[7:11]


def test_samplers(engine: Engine) -> None:
    a = _context(engine, seed=11).generate_result(Sampler.reasoning(), stop.max_len(8)).token_ids
    b = _context(engine, seed=11).generate_result(Sampler.reasoning(), stop.max_len(8)).token_ids
    assert a == b
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def second_choice(ids: np.ndarray, probs: np.ndarray) -> int:
        seen.append((ids, probs))
        return int(ids[1])

    out = _context(engine).generate_result(Sampler.custom(second_choice, temperature=1.0), stop.max_len(3))
    assert len(seen) == 3 and out.token_ids == [int(ids[1]) for ids, _ in seen]
    assert np.all(np.diff(seen[0][1]) <= 0)
    with pytest.raises(ConfigError):
        Sampler.top_p(0.7, 1.5)
    with pytest.raises(ConfigError):
        stop.max_len(0)


def test_export_and_import_share_pages(engine: Engine) -> None:
    ctx = _context(engine, "Shared system prompt: be brief and kind.")
    ctx.flush()
    ctx.export_kv_pages("sys")
    expected = ctx.fork().generate_result(Sampler.greedy(), stop.max_len(6)).token_ids
    ctx.release()
    imported = Context.from_imported_state(engine, import_kv_pages(engine, "sys"))
    assert imported.pages_shared == imported.pages_used
    assert imported.generate_result(Sampler.greedy(), stop.max_len(6)).token_ids == expected
    drop_export(engine, "sys")
    with pytest.raises(InputError, match="nothing was exported"):
        import_kv_pages(engine, "sys")


def test_bad_input_is_typed_and_changes_nothing(engine: Engine) -> None:
    ctx = _context(engine)
    before = ctx.token_ids
    with pytest.raises(TokenIdError):
        ctx.fill_tokens([engine.model.config.vocab_size])
    with pytest.raises(PromptTooLongError):
        ctx.fill_tokens([1] * engine.max_len)
    with pytest.raises(InputError):
        ctx.mask_token_range(3, 1)
    assert ctx.token_ids == before
    with pytest.raises(InputError, match="empty"):
        Context(engine).generate()
    ctx.release()
    with pytest.raises(CacheError, match="released"):
        ctx.generate()
