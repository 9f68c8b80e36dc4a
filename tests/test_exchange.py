"""The device-host mailbox of constrained decode loops (:mod:`zgen.runtime.exchange`).

On this CPU-only machine: the library builds and registers its FFI targets, a channel without a GPU is
a typed error, and a constrained loop's hand-overs lower for CUDA to the exchange's two custom calls
with no Python callback in the loop. On a GPU: a constrained generation gives the same tokens through
the exchange as through host callbacks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from zgen.errors import ExchangeUnavailableError
from zgen import Generator, Grammar, ModelConfig, Request, SamplingConfig
from zgen.model import Model, random_model
from zgen.runtime import exchange
from zgen.runtime.grammar import GrammarLoop
from zgen.tokenizer import Tokenizer

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="the exchange is built with a C++ compiler"
)
EXCHANGE_CALLS = [export.DisabledSafetyCheck.custom_call(name) for name in ("zgen_exchange_send", "zgen_exchange_receive")]


@needs_compiler
def test_the_library_builds_and_a_channel_needs_a_gpu() -> None:
    lib = exchange._library()  # pyright: ignore[reportPrivateUsage]
    assert all(hasattr(lib, name) for name in ("ZgenExchangeSend", "ZgenExchangeReceive", "zgen_exchange_open"))
    if jax.default_backend() == "cpu":
        assert not exchange.available()
        with pytest.raises(ExchangeUnavailableError, match="channel could not be opened"):
            exchange.Channel(4, 4)


@needs_compiler
def test_a_constrained_loop_hands_over_through_the_exchange_inside_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop body's hand-overs lower to a receive after the forward's value and a send after the
    draw, both inside the while loop, and nothing calls back into Python."""
    exchange._library()  # pyright: ignore[reportPrivateUsage] - registers the targets
    width, vocab = 3, 100
    grammar = GrammarLoop(vocab)
    channel = exchange.Channel.__new__(exchange.Channel)  # no GPU here: only its id is traced
    channel.id = 0
    monkeypatch.setitem(grammar.__dict__, "exchanges", True)
    monkeypatch.setitem(grammar._channels, width, channel)  # pyright: ignore[reportPrivateUsage]

    def loop(logits: jax.Array) -> jax.Array:
        def body(step: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            tokens, ticket = carry
            mask, ended = grammar.device_masks(logits + step, ticket, width)
            bits = (mask[:, :, None] >> jnp.arange(32)) & 1
            tokens = jnp.argmax(jnp.where(bits.reshape(width, -1)[:, :vocab] > 0, logits, -jnp.inf), axis=-1)
            ticket = grammar.device_submit(tokens, ~ended, jnp.ones(width, bool), step + 1)
            return tokens.astype(jnp.int32), ticket

        return jax.lax.fori_loop(0, 4, body, (jnp.zeros(width, jnp.int32), grammar.first_ticket()))[0]

    logits = jnp.zeros((width, vocab), jnp.float32)
    module = export.export(jax.jit(loop), platforms=["cuda"], disabled_checks=EXCHANGE_CALLS)(logits).mlir_module()
    body = module[module.index("stablehlo.while") :]
    assert body.index("@zgen_exchange_receive") < body.index("@zgen_exchange_send")
    assert "callback" not in module
    # Ordered by data, with no effect: an effect would take the loop off jax's C++ dispatch.
    assert not jax.make_jaxpr(loop)(logits).effects


def byte_level_model() -> Model:
    """Random weights over a small byte-level BPE vocabulary trained here (a grammar needs one)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(['{"name":"abc","ok":true}', '{"name":"xyz","ok":false}'] * 20, trainer)
    config = ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=backend.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0,
    ))
    return dataclasses.replace(random_model(config, dtype="float32", seed=2), tokenizer=Tokenizer(backend=backend, bos_id=None, eos_ids=(0,)))


def constrained_tokens(model: Model) -> list[list[int]]:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    grammar = Grammar.json_schema(schema, compact=True)
    configs = [SamplingConfig(temperature=t, seed=s, max_new_tokens=40, grammar=grammar) for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    results = Generator(model, max_batch_size=4).batch_generate([Request([5, 6, 7, 8], c) for c in configs])
    for result in results:
        assert set(json.loads(result.text)) == {"name", "ok"}
    return [r.token_ids for r in results]


def test_constrained_generations_of_the_exchange_test_are_valid_json() -> None:
    """The GPU test's model and grammar, through whatever hand-over this machine has."""
    constrained_tokens(byte_level_model())


@pytest.mark.skipif(not exchange.available(), reason="the exchange runs on a CUDA GPU")
def test_constrained_tokens_are_the_same_through_the_exchange_and_through_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    model = byte_level_model()
    through_exchange = constrained_tokens(model)
    monkeypatch.setattr(GrammarLoop, "exchanges", property(lambda self: False))
    assert constrained_tokens(model) == through_exchange


class FakeChannel:
    """A channel in host memory, with this test as the device: it writes a draw into the inbox and
    sends its sequence number, and its receive waits for the ready flag the host thread sets."""

    def __init__(self, inbox_words: int, outbox_words: int) -> None:
        self.inbox = np.zeros(inbox_words, np.int32)
        self.outbox = np.zeros(outbox_words, np.int32)
        self.sent, self.ready, self.woken = 0, False, False
        self.held = False  # sends go unseen until after the next wake (a draw the loop's end overtakes)
        self.changed = threading.Condition()

    def reset(self, sequence: int = 0) -> None:
        with self.changed:
            self.sent, self.woken = sequence, False

    def wait(self, last: int, timeout_s: float) -> int:
        with self.changed:
            self.changed.wait_for(lambda: (self.sent != last and not self.held) or self.woken, timeout=timeout_s)
            if self.woken:  # the wake wins the race: the held send shows only to the next look
                self.woken = self.held = False
                return last
            return last if self.held else self.sent

    def wake(self) -> None:
        with self.changed:
            self.woken = True
            self.changed.notify_all()

    def answer(self) -> None:
        with self.changed:
            self.ready = True
            self.changed.notify_all()

    def send(self, payload: np.ndarray, sequence: int) -> None:  # the device's side
        with self.changed:
            self.inbox[: payload.size] = payload
            self.sent = sequence
            self.changed.notify_all()

    def receive(self) -> np.ndarray:  # the device's: wait for the ready flag, clear it, read the answer
        with self.changed:
            assert self.changed.wait_for(lambda: self.ready, timeout=20), "the host never answered"
            self.ready = False
            return self.outbox.copy()


def fake_exchange(monkeypatch: pytest.MonkeyPatch, model: Model, width: int) -> tuple[GrammarLoop, FakeChannel, int]:
    """A grammar loop whose loops of ``width`` rows hand over through a :class:`FakeChannel`, and the
    mask words per row."""
    from zgen.runtime.grammar import mask_words

    words = mask_words(model.config.vocab_size)
    loop = GrammarLoop(model.config.vocab_size)
    channel = FakeChannel(3 * width, width * (words + 1))
    monkeypatch.setitem(loop.__dict__, "exchanges", True)
    monkeypatch.setitem(loop._channels, width, channel)  # pyright: ignore[reportPrivateUsage]
    return loop, channel, words


def test_the_host_thread_answers_every_draw_and_takes_the_last_one_before_finishing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange's host thread, with this test as the device: each sent draw is answered with the
    masks llguidance gives after it, and ``finish`` returns only once the loop's last draw (which no
    receive waits for) is taken by the grammar."""
    from zgen.runtime.grammar import GrammarMatcher, fill_masks

    model = byte_level_model()
    grammar = Grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, compact=True)
    width = 2
    loop, channel, words = fake_exchange(monkeypatch, model, width)
    matcher, reference = (GrammarMatcher(grammar, model, model.eos_token_ids) for _ in range(2))

    assert loop.start([(matcher, 1)], width) == {}  # row 1 constrained, row 0 free
    for step in range(4):
        answer = channel.receive()
        masks, ended = answer[: width * words].reshape(width, words), answer[width * words :]
        expected = np.full((width, words), -1, np.int32)
        fill_masks([(reference, 1)], expected)
        np.testing.assert_array_equal(masks, expected)
        assert not ended.any()
        bits = (masks[1][:, None] >> np.arange(32)) & 1
        token = int(np.flatnonzero(bits.reshape(-1))[0])  # the first token the grammar allows
        reference.consume(token)
        last = step == 3  # the loop's last draw: no masks wanted, no receive waits for them
        channel.held = last  # ... and the loop ends before the host thread sees it
        channel.send(np.array([7, token, 0, 1, 0, int(not last)], np.int32), step + 1)  # drawn, live, masks wanted
    assert loop.finish() == {}
    after, expected = np.zeros((1, words), np.int32), np.zeros((1, words), np.int32)
    fill_masks([(matcher, 0)], after)
    fill_masks([(reference, 0)], expected)
    np.testing.assert_array_equal(after, expected)  # the grammar took the last draw too


def test_a_failing_host_turn_still_answers_and_finish_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the host's turn must not leave the device waiting: the thread answers (every row ends)
    and ``finish`` raises the error."""
    from zgen.runtime.grammar import GrammarMatcher

    model = byte_level_model()
    width = 1
    loop, channel, words = fake_exchange(monkeypatch, model, width)

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug in the host's turn")

    monkeypatch.setattr(loop, "_advance", broken)
    loop.start([(GrammarMatcher(Grammar.regex("a+"), model, model.eos_token_ids), 0)], width)
    channel.receive()
    channel.send(np.array([5, 1, 1], np.int32), 1)
    answer = channel.receive()
    assert not answer[:words].any() and answer[words:].all()
    with pytest.raises(RuntimeError, match="a bug in the host's turn"):
        loop.finish()


def test_one_host_thread_serves_back_to_back_loops_then_ends_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops in quick succession (a generation's) are served by the same thread, which ends once no
    loop came for ``SERVER_IDLE_S`` seconds (and a later loop starts another)."""
    import zgen.runtime.grammar as grammar_module
    from zgen.runtime.grammar import GrammarMatcher

    model = byte_level_model()
    width = 1
    loop, channel, _ = fake_exchange(monkeypatch, model, width)
    monkeypatch.setattr(grammar_module, "SERVER_IDLE_S", 0.2)

    def one_loop() -> threading.Thread:
        loop.start([(GrammarMatcher(Grammar.regex("a+"), model, model.eos_token_ids), 0)], width)
        channel.receive()
        channel.send(np.array([model.tokenizer.encode("a")[0], 1, 0], np.int32), 1)  # drawn, live, no masks wanted
        server = loop._server  # pyright: ignore[reportPrivateUsage]
        assert loop.finish() == {} and server is not None
        return server

    first = one_loop()
    assert one_loop() is first
    first.join(timeout=20)
    assert not first.is_alive() and loop._server is None  # pyright: ignore[reportPrivateUsage]
    assert one_loop() is not first
