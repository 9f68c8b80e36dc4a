"""Training an EAGLE head on the target's own features (teacher forcing), with optax and orbax.

Data: a ``.txt`` file (its tokens cut into ``seq_len`` pieces) or a ``.jsonl`` file of chats (one per
line: ``{"messages": [...]}`` or a bare list of messages, rendered with the chat template; or
``{"text": ...}``). With ``self_distill=N``, the first N items become prompts (a chat without its last
assistant turn, or a line of text as a user message) and the sequences are the target's own greedy
continuations: the head then learns what the target says, which is what it will draft. As EAGLE's
loss mask, a self-distilled continuation or a chat's final assistant reply is scored, not the prompt
before it (text is scored on every token).

Each step runs the frozen target over a batch to get its features and next-token distributions, and
the head over the same positions; the loss is EAGLE's: a smooth-L1 regression of the predicted feature
on the target's next one plus 0.1 × the cross-entropy of the head's next-token distribution against
the target's. With ``chain_steps > 1`` the head is also trained on its own predicted features over
that many chained steps (EAGLE-3's training-time test, :func:`head_loss`). The held-out acceptance is
the head's top-1 agreement with the target's top-1 on sequences kept out of training, at the first
drafted token and along a chain of :data:`EVAL_STEPS`. Checkpoints (:mod:`.checkpoint`) are written every ``save_every``
steps; training again into the same directory continues from the last one.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.tensor import DenseKVState
from zgen.errors import ConfigError, InputError
from zgen.model import Model
from zgen.runtime.engine import Engine, EngineConfig, ForwardRequest
from zgen.runtime.sampling import SamplingConfig
from zgen.runtime.step import ModelSpec, forward_features
from zgen.runtime.stop import StopCondition
from zgen.speculative.eagle import checkpoint
from zgen.speculative.eagle.head import HEAD_WINDOW, EagleHead, default_feature_layers, draft_step, draft_tree_step, fingerprint, fuse

#: EAGLE's weight of the token cross-entropy against the feature regression.
CLASSIFICATION_WEIGHT = 0.1
#: EAGLE-3's weight of a chained step's loss against the step before it (training-time test).
CHAIN_DECAY = 0.8
#: Chained steps of the held-out acceptance: the default draft length.
EVAL_STEPS = 4


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-4
    self_distill: int = 0  # > 0: train on the target's greedy continuations of this many prompts
    fused: bool = False  # read a low, a middle and a high layer (EAGLE-3) instead of the last
    chain_steps: int = 1  # > 1: EAGLE-3's training-time test over that many chained steps (see head_loss)
    feature_noise: float = 0.1  # uniform noise of this amplitude on the features the head reads, as EAGLE trains
    save_every: int = 200
    eval_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "chain_steps", "save_every", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EAGLE training {name} must be a positive integer, got {value!r}")
        if self.seq_len < 3:
            raise ConfigError(f"EAGLE training seq_len must be at least 3 tokens, got {self.seq_len}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"EAGLE training lr must be a finite positive number, got {self.lr!r}")
        if not (isinstance(self.feature_noise, (int, float)) and math.isfinite(self.feature_noise) and self.feature_noise >= 0):
            raise ConfigError(f"EAGLE training feature_noise must be a finite non-negative number, got {self.feature_noise!r}")
        if isinstance(self.self_distill, bool) or not isinstance(self.self_distill, int) or self.self_distill < 0:
            raise ConfigError(f"EAGLE training self_distill must be a non-negative integer, got {self.self_distill!r}")


@dataclass(frozen=True)
class StepReport:
    """One report: after ``step`` of ``steps``; ``acceptance`` only on evaluation steps."""

    step: int
    steps: int
    loss: float
    acceptance: float | None


@dataclass(frozen=True)
class TrainReport:
    first_step: int  # where this run started (> 0: resumed)
    steps: int
    tokens: int  # target tokens this run trained on
    seconds: float  # wall time of the training steps, compilation included
    loss: float
    generation_seconds: float  # producing the self-distilled sequences
    chain_acceptance: tuple[float, ...]  # held-out top-1 agreement at the end, at each of EVAL_STEPS chained steps

    @property
    def acceptance(self) -> float:
        """The held-out top-1 agreement at the first drafted token."""
        return self.chain_acceptance[0]


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingSequence:
    """Token ids the head trains on; ``drafted_from``: the first token scored (a self-distilled
    sequence's prompt is never drafted, only its continuation after the first generated token)."""

    ids: list[int]
    drafted_from: int = 0


def _read_items(path: Path) -> list[Any]:
    """The file's items: lines of text (.txt) or parsed JSON lines (.jsonl)."""
    if not path.is_file():
        raise InputError(f"EAGLE training data {path} is not a file: give a .txt or .jsonl file")
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    if suffix == ".txt":
        return [text]
    if suffix != ".jsonl":
        raise InputError(f"EAGLE training data must be .txt or .jsonl, got {path.name}")
    items: list[Any] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number} is not JSON ({err.msg}): one chat per line") from err
    return items


def _messages(item: Any, where: str) -> list[dict[str, str]] | None:
    """A chat's messages (``None``: a plain text item)."""
    messages = item.get("messages") if isinstance(item, dict) else item
    if isinstance(item, dict) and "messages" not in item:
        if isinstance(item.get("text"), str):
            return None
        raise InputError(f"{where}: expected {{\"messages\": [...]}}, a list of messages or {{\"text\": ...}}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InputError(f"{where}: a chat is a list of {{\"role\", \"content\"}} messages")
    return messages


def _chat_ids(model: Model, messages: list[dict[str, str]], *, prompt: bool) -> list[int]:
    """A chat's ids through the chat template (``prompt``: ending where the assistant's turn starts); a
    model without a template reads the messages' contents, one per line."""
    tok = model.tokenizer
    if tok.chat_template is None:
        return tok.encode("\n".join(str(m.get("content", "")) for m in messages))
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=prompt), add_special_tokens=False)


def training_sequences(model: Model, path: Path, seq_len: int) -> list[TrainingSequence]:
    """Token sequences of at most ``seq_len`` ids from ``path`` (see the module docstring): text scored
    on every token, a chat ending in an assistant turn on that reply (from its second token)."""
    tok = model.tokenizer
    sequences: list[TrainingSequence] = []
    for n, item in enumerate(_read_items(path)):
        if isinstance(item, str):  # a .txt file: its tokens in pieces
            ids = tok.encode(item)
            sequences += [TrainingSequence(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
            continue
        messages = _messages(item, f"{path}:{n + 1}")
        if messages is None:
            sequences.append(TrainingSequence(tok.encode(item["text"])[:seq_len]))
            continue
        ids = _chat_ids(model, messages, prompt=False)[:seq_len]
        sequences.append(TrainingSequence(ids, _reply_start(model, messages, ids)))
    kept = [sequence for sequence in sequences if len(sequence.ids) >= 3]
    if not kept:
        raise InputError(f"{path} holds no text of 3 tokens or more to train on")
    return kept


def _reply_start(model: Model, messages: list[dict[str, str]], ids: list[int]) -> int:
    """The first token a head would draft of a chat's last turn, the assistant's reply (the one after
    its first token, which the target's prefill gives); 0 (every token) for a chat ending otherwise or
    a template whose prompt is not a prefix of the whole chat."""
    if not messages or messages[-1].get("role") != "assistant" or model.tokenizer.chat_template is None:
        return 0
    prompt = _chat_ids(model, messages[:-1], prompt=True)
    return len(prompt) + 1 if ids[: len(prompt)] == prompt else 0


def distill_prompts(model: Model, path: Path, count: int) -> list[list[int]]:
    """The first ``count`` prompts of ``path`` as token ids: chats without their last assistant turn,
    lines of a text file as user messages (plain text where the model has no chat template)."""
    prompts: list[list[int]] = []
    for n, item in enumerate(_read_items(path)):
        if isinstance(item, str):
            chats: list[list[dict[str, str]] | str] = [line.strip() for line in item.splitlines() if line.strip()]
        else:
            messages = _messages(item, f"{path}:{n + 1}")
            chats = [item["text"] if messages is None else messages]
        for chat in chats:
            if isinstance(chat, str):
                chat = [{"role": "user", "content": chat}]
            turns = chat[:-1] if chat and chat[-1].get("role") == "assistant" else chat
            prompts.append(_chat_ids(model, turns, prompt=True))
            if len(prompts) >= count:
                return prompts
    if not prompts:
        raise InputError(f"{path} holds no prompts for self-distillation")
    return prompts


def self_distilled(model: Model, prompts: Sequence[list[int]], seq_len: int) -> list[TrainingSequence]:
    """Each prompt followed by the target's greedy continuation, ``seq_len`` tokens at most, scored
    from the second generated token on: the first is the prefill's, the rest what a head drafts."""
    engine = Engine(model, config=EngineConfig(max_batch=min(len(prompts), 32)), default_kind="tensor")
    jobs = []
    try:
        for prompt in prompts:
            ids = prompt[: seq_len - 2]
            config = SamplingConfig(temperature=0.0, max_new_tokens=seq_len - len(ids))
            stop = StopCondition.from_sampling(config, model.eos_token_ids)
            request = ForwardRequest(end=len(ids), sample_at=(len(ids) - 1,), sampling=config, generate=stop)
            jobs.append((ids, engine.submit(engine.new_sequence(ids), request)))
        return [TrainingSequence(ids + engine.wait(job).tokens, len(ids) + 1) for ids, job in jobs]
    finally:
        engine.close()


def _batch(sequences: Sequence[TrainingSequence], picks: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, lengths and the first scored token of the picked sequences."""
    tokens = np.zeros((len(picks), seq_len), np.int32)
    lengths = np.zeros(len(picks), np.int32)
    drafted_from = np.zeros(len(picks), np.int32)
    for row, i in enumerate(picks):
        sequence = sequences[int(i)]
        ids = sequence.ids[:seq_len]
        tokens[row, : len(ids)] = ids
        lengths[row] = len(ids)
        drafted_from[row] = sequence.drafted_from
    return tokens, lengths, drafted_from


# ---------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------


def target_outputs(
    spec: ModelSpec, model: Model, params: Any, layers: tuple[int, ...], tokens: Int[Array, "B T"], lengths: Int[Array, " B"]
) -> tuple[Float[Array, "B T V"], Float[Array, "B T F"]]:
    """The target's logits and features at every position of each row (a forward over a scratch cache)."""
    b, t = tokens.shape
    c = model.config
    slots = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    positions = jnp.where(slots < lengths[:, None], slots, -1)
    kv = DenseKVState.zeros(c.num_layers, b, t, c.num_kv_heads, c.head_dim, model.dtype)
    logits, features, _ = forward_features(spec, params, kv, tokens, positions, slots, layers)
    return logits, features


def chain_visibility(rows: int, step: int, steps: int) -> Bool[Array, "T S"]:
    """What head row ``j`` sees at chained step ``step`` (1-based) of the training-time test, over
    ``steps`` blocks of ``rows`` slots (block ``r`` holds step ``r + 1``'s rows): as when it drafts the
    ``step``-th token after the last true row ``j - step + 1``, the true rows up to that one (within
    :data:`~.head.HEAD_WINDOW`) and the chain's rows after it, one from each earlier step, and its own."""
    query = jnp.arange(rows)[:, None]
    slot = jnp.arange(steps * rows)[None, :]
    block, row = slot // rows, slot % rows
    last_true = query - (step - 1)
    true_rows = (block == 0) & (row <= last_true) & (query - row < HEAD_WINDOW)
    chain_rows = (block >= 1) & (block < step) & (row == last_true + block)
    return true_rows | chain_rows


def chained_outputs(
    head: EagleHead, params: dict[str, Array], target_params: Any, tokens: Int[Array, "B T"], lengths: Int[Array, " B"],
    features: Float[Array, "B T F"], noise: Float[Array, "B T1 F"] | None = None, *, steps: int = 1,
) -> list[tuple[Float[Array, "B T1 H"], Float[Array, "B T1 V"]]]:
    """The head's predicted features and logits at every row ``j`` (reading the token at ``j + 1``), at
    each of ``steps`` chained steps. Step 1 reads the target's true features (plus ``noise``); step
    ``s`` feeds row ``j`` the feature step ``s - 1`` predicted for position ``j`` (its row ``j - 1``'s
    output), attending as a drafted chain does (:func:`chain_visibility`): EAGLE-3's training-time test."""
    b, t = tokens.shape
    width = t - 1
    rows = jnp.broadcast_to(jnp.arange(width)[None, :], (b, width))
    valid = rows < (lengths - 1)[:, None]
    # einsum attention and float32 buffers: differentiable everywhere (CPU keeps bfloat16 buffers as integers)
    kv = head.new_kv(b, steps * width, attention="einsum", dtype=jnp.dtype(jnp.float32))
    read = features[:, :-1] if noise is None else features[:, :-1] + noise.astype(features.dtype)
    joined = head.joined(params, target_params)
    after = tokens[:, 1:]
    predicted, logits, kv = draft_step(head.graph, joined, kv, fuse(params, read).astype(head.model.dtype), after, jnp.where(valid, rows, -1), rows)
    outputs = [(predicted, logits)]
    for step in range(2, steps + 1):
        fed = jnp.concatenate([jnp.zeros_like(predicted[:, :1]), predicted[:, :-1]], axis=1)
        visible = jnp.broadcast_to(chain_visibility(width, step, steps)[None], (b, width, steps * width))
        predicted, logits, kv = draft_tree_step(head.graph, joined, kv, fed, after, rows, rows + (step - 1) * width, visible, rows)
        outputs.append((predicted, logits))
    return outputs


def head_loss(
    head: EagleHead, params: dict[str, Array], target_params: Any, tokens: Int[Array, "B T"], lengths: Int[Array, " B"],
    logits: Float[Array, "B T V"], features: Float[Array, "B T F"], noise: Float[Array, "B T1 F"] | None = None, *, steps: int = 1,
    drafted_from: Int[Array, " B"] | None = None,
) -> tuple[Array, Float[Array, " steps"]]:
    """EAGLE's loss over every row ``j`` with a known next token, and the top-1 agreement with the
    target at each of ``steps`` chained steps (:func:`chained_outputs`; row ``j`` counts at steps up to
    ``j + 1``, where a chain from a true row can reach it); step ``s``'s loss weighs ``0.8 ** (s - 1)`` (EAGLE-3).
    With ``drafted_from``, only rows predicting a token at or past it count (EAGLE's loss mask: a
    self-distilled sequence's continuation, not its prompt)."""
    b, t = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(t - 1)[None, :], (b, t - 1))
    valid = rows < (lengths - 1)[:, None]  # row j reads the token at j + 1
    if drafted_from is not None:
        valid &= rows + 2 >= drafted_from[:, None]  # row j predicts the token at j + 2
    target_next = jax.lax.stop_gradient(fuse(params, features[:, 1:]).astype(jnp.float32))
    target_probs = jax.nn.softmax(logits[:, 1:], axis=-1)
    target_top = jnp.argmax(logits[:, 1:], axis=-1)
    loss = jnp.zeros((), jnp.float32)
    agreements = []
    for step, (predicted, head_logits) in enumerate(chained_outputs(head, params, target_params, tokens, lengths, features, noise, steps=steps), 1):
        weight = (valid & (rows >= step - 1)).astype(jnp.float32)
        total = jnp.maximum(jnp.sum(weight), 1.0)
        regression = jnp.mean(optax.huber_loss(predicted.astype(jnp.float32), target_next, delta=1.0), axis=-1)
        cross_entropy = -jnp.sum(target_probs * jax.nn.log_softmax(head_logits, axis=-1), axis=-1)
        loss = loss + CHAIN_DECAY ** (step - 1) * jnp.sum((regression + CLASSIFICATION_WEIGHT * cross_entropy) * weight) / total
        agreements.append(jnp.sum((jnp.argmax(head_logits, axis=-1) == target_top).astype(jnp.float32) * weight) / total)
    return loss, jnp.stack(agreements)


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def train(
    model: Model, data: Path, out: Path, config: TrainConfig = TrainConfig(), on_progress: Callable[[StepReport], None] | None = None
) -> TrainReport:
    """Train (or go on training) the EAGLE head in ``out`` for ``model`` on ``data``, up to ``config.steps``."""
    out = Path(out)
    meta = checkpoint.read_meta(out)
    layers = default_feature_layers(model.config, fused=config.fused)
    if meta is not None:
        checkpoint.check_target(meta, model, out)
        if meta.feature_layers != layers:
            raise ConfigError(
                f"the head in {out} reads layers {list(meta.feature_layers)}, not {list(layers)}: train it with the "
                "same fused setting it was started with, or into another directory"
            )
    generation_started = time.perf_counter()
    if config.self_distill:
        sequences = self_distilled(model, distill_prompts(model, Path(data), config.self_distill), config.seq_len)
    else:
        sequences = training_sequences(model, Path(data), config.seq_len)
    generation_seconds = time.perf_counter() - generation_started if config.self_distill else 0.0
    sequences = [sequences[i] for i in np.random.default_rng(config.seed).permutation(len(sequences))]
    held = max(1, len(sequences) // 10) if len(sequences) > 1 else 0
    held_out, train_set = sequences[:held] or sequences, sequences[held:]

    fresh = EagleHead.init(model, jax.random.PRNGKey(config.seed), feature_layers=layers)
    params = {name: value.astype(jnp.float32) for name, value in fresh.params.items()}
    warmup = max(1, min(100, config.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(config.steps, warmup + 1), config.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0))
    opt_state = optimizer.init(params)
    first = 0
    if meta is not None:
        params, opt_state = checkpoint.restore(out, meta, params, opt_state)
        first = meta.step
    head = EagleHead(model, {name: value.astype(model.dtype) for name, value in params.items()}, layers)
    spec = ModelSpec(model.graph, model.config.sliding_window)
    target_params = model.params

    @jax.jit
    def targets(target_params: Any, tokens: Array, lengths: Array) -> tuple[Array, Array]:
        return target_outputs(spec, model, target_params, layers, tokens, lengths)

    @jax.jit
    def update(
        params: Any, opt_state: Any, target_params: Any, tokens: Array, lengths: Array, drafted_from: Array, key: Array
    ) -> tuple[Any, Any, Array]:
        logits, features = targets(target_params, tokens, lengths)
        amplitude = config.feature_noise
        noise = jax.random.uniform(key, features[:, 1:].shape, jnp.float32, -amplitude, amplitude)

        def loss_fn(params: Any) -> tuple[Array, Array]:
            return head_loss(
                head, params, target_params, tokens, lengths, logits, features, noise, steps=config.chain_steps, drafted_from=drafted_from
            )

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def evaluate(params: Any, target_params: Any, tokens: Array, lengths: Array, drafted_from: Array) -> Array:
        logits, features = targets(target_params, tokens, lengths)
        return head_loss(head, params, target_params, tokens, lengths, logits, features, steps=EVAL_STEPS, drafted_from=drafted_from)[1]

    eval_picks = np.arange(min(len(held_out), config.batch_size))
    held_batch = _batch(held_out, eval_picks, config.seq_len)

    def chain_acceptance(params: Any) -> tuple[float, ...]:
        return tuple(float(a) for a in np.asarray(evaluate(params, target_params, *held_batch)))

    record = checkpoint.HeadMeta(fingerprint(model), str(model.source or "a model built in memory"), layers, first)
    started = time.perf_counter()
    tokens_seen = 0
    loss = float("nan")
    pool = train_set or held_out
    for step in range(first + 1, config.steps + 1):
        picks = np.random.default_rng((config.seed, step)).integers(0, len(pool), config.batch_size)
        tokens, lengths, drafted_from = _batch(pool, picks, config.seq_len)
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed), step)
        params, opt_state, loss_value = update(params, opt_state, target_params, tokens, lengths, drafted_from, key)
        tokens_seen += int(lengths.sum())
        evaluating = step % config.eval_every == 0 or step == config.steps
        loss = float(loss_value)
        if on_progress is not None:
            on_progress(StepReport(step, config.steps, loss, chain_acceptance(params)[0] if evaluating else None))
        if step % config.save_every == 0 or step == config.steps:
            record = checkpoint.HeadMeta(record.fingerprint, record.target, layers, step)
            checkpoint.save(out, record, params, opt_state)
    seconds = time.perf_counter() - started
    return TrainReport(first, config.steps, tokens_seen, seconds, loss, generation_seconds, chain_acceptance(params))
