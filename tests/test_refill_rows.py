"""EngineConfig.refill_rows (queued requests wait for that many free rows and prefill together),
prefill_apart (decoding rows sit out prefill steps) and packed_steps (a step's tokens packed into one
stream): the tokens are the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import save_random_checkpoint, small_configs
from zgen import GenerationResult, Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import paged_kv
from zgen.errors import ConfigError
from zgen.runtime.engine import EngineConfig
from zgen.runtime.runner import runner_for


def record_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every engine step from now on, as ``(rows, tokens per row, width)``."""
    from zgen.runtime.engine import Engine

    steps: list[tuple[int, int, int]] = []
    step_rows = Engine._step_rows

    def recorded(self: Engine, rows: list, tokens: int) -> tuple:  # type: ignore[type-arg]
        out = step_rows(self, rows, tokens)
        steps.append((len(rows), tokens, out[0]))
        return out

    monkeypatch.setattr(Engine, "_step_rows", recorded)
    return steps


def prompts_of_many_lengths(count: int, growth: int, sampled: int) -> list[Request]:
    """``count`` greedy requests whose prompts grow by ``growth`` tokens each, and one sampled request
    with a prompt of ``sampled`` tokens."""
    requests = [
        Request(list(range(3 + i, 6 + i + growth * i)), SamplingConfig(temperature=0.0, max_new_tokens=4 + i % 3, ignore_eos=True))
        for i in range(count)
    ]
    return requests + [Request(list(range(40, 40 + sampled)), SamplingConfig(temperature=0.9, seed=3, max_new_tokens=6, ignore_eos=True))]


def assert_same_results(expected: list[GenerationResult], got: list[GenerationResult]) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for a, b in zip(expected, got, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_grouped_refills_give_the_same_tokens_in_fewer_steps(tmp_path: Path) -> None:
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    requests = [
        Request(list(range(5 + i, 9 + 2 * i)), SamplingConfig(temperature=0.0, max_new_tokens=3 + 4 * (i % 3), ignore_eos=True))
        for i in range(10)
    ]
    outputs, steps = [], []
    for refill in (1, 4):
        generator = Generator(model, max_batch_size=4, refill_rows=refill)
        outputs.append([r.token_ids for r in generator.batch_generate(requests)])
        steps.append(generator.engine.stats.steps)
    assert outputs[0] == outputs[1]
    assert steps[1] < steps[0]
    rows = []
    for apart in (False, True):  # decoding rows sit out the prefill steps of a paged cache
        paged = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=4, refill_rows=2, prefill_apart=apart)
        assert [r.token_ids for r in paged.batch_generate(requests)] == outputs[0]
        rows.append(paged.engine.stats.rows)
    assert rows[1] < rows[0]


@pytest.mark.parametrize("cache", ["tensor", "paged"])
def test_packed_steps_give_the_same_tokens_and_logprobs(tmp_path: Path, cache: str) -> None:
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path, dtype="float32")
    # Prompts of many lengths (chunks of 8 tokens: several steps each), admitted one at a time while
    # others decode, so packed steps mix prefill chunks of every size with decoding rows' single tokens;
    # one request samples.
    requests = prompts_of_many_lengths(7, growth=5, sampled=21)
    options = [paged_kv(max_memory_mb=4)] if cache == "paged" else []
    results = []
    for packed in (False, True):
        generator = Generator(model, *options, max_batch_size=4, prefill_chunk=8, sync_interval=2, packed_steps=packed)
        results.append(generator.batch_generate(requests))
    assert_same_results(*results)


def test_decoding_rows_beside_long_chunks_attend_in_pieces_with_the_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a paged cache a packed step where decoding rows ride along beside long prompt chunks lays
    attention out in pieces (each reading its row's pages), not rows padded to the longest chunk; the
    tokens and log-probs are the padded steps'."""
    import zgen.runtime.engine as engine_module
    from zgen.runtime.step import Packing

    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path, dtype="float32")
    requests = prompts_of_many_lengths(10, growth=9, sampled=50)
    padded = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=8, prefill_chunk=32).batch_generate(requests)
    monkeypatch.setattr(engine_module, "PACKED_PIECE", 4)
    layouts: list[tuple[int, ...]] = []
    packed_of = Packing.of

    def recorded(*args: object, **kwargs: object) -> tuple:  # type: ignore[type-arg]
        out = packed_of(*args, **kwargs)  # type: ignore[arg-type]
        layouts.append(tuple(out[3].rows.shape) if out[3].owners is not None else ())
        return out

    monkeypatch.setattr(Packing, "of", staticmethod(recorded))
    generator = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=8, prefill_chunk=32, packed_steps=True)
    pieces = generator.batch_generate(requests)
    assert any(shape and shape[1] == 4 for shape in layouts), layouts  # some steps attended in pieces of 4
    assert_same_results(padded, pieces)


def test_a_packed_steps_compiled_shape_follows_from_the_steps_shape() -> None:
    """Steps of one ``[rows, chunk]`` shape pack into one compiled shape whatever tokens they hold: the
    stream is at least an eighth of the padded step and the pieces' layout has room for the most pieces
    that stream can hold, so a job's warm-up meets the shapes its steps use; the stream then grows by
    powers of two."""
    import numpy as np

    from zgen.runtime.step import Packing

    rows, chunk, piece = 16, 512, 32

    def packed_shapes(counts: list[int], with_pieces: bool = True) -> tuple[tuple[int, ...], ...]:
        counts = counts + [0] * (rows - len(counts))
        positions = np.where(np.arange(chunk)[None] < np.array(counts)[:, None], np.arange(chunk)[None], -1)
        tokens, stream_positions, read_rows, packing = Packing.of(
            np.ones((rows, chunk), np.int32), positions.astype(np.int32), np.zeros((rows, 1), np.int32), counts,
            piece=piece if with_pieces else None,
        )
        assert sorted(stream_positions[0][stream_positions[0] >= 0]) == sorted(positions[positions >= 0])  # every token packed
        return tokens.shape, packing.rows.shape, () if packing.owners is None else packing.owners.shape

    eighth = [[512, 512], [300, 7, 1, 1, 1], [1], [33] * 16]  # 2 to 48 pieces, 1 to 1,024 tokens
    assert {packed_shapes(counts) for counts in eighth} == {((1, 1024), (64, 32), (64,))}
    assert {packed_shapes(counts, with_pieces=False) for counts in eighth} == {((1, 1024), (rows, chunk), ())}
    assert {packed_shapes(counts) for counts in ([512] * 3, [100] * 16, [512, 512, 1])} == {((1, 2048), (128, 32), (128,))}
    assert packed_shapes([512] * 16) == ((1, 8192), (rows, chunk), ())  # pieces would not halve the layout


def test_a_token_budget_fills_packed_steps_and_gives_the_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``step_tokens`` every packed prefill step is one stream of exactly that width, rows' chunks
    are cut to fill it (a cut row goes on in the next step), and the tokens are the padded steps'."""
    from zgen.runtime.engine import Engine
    from zgen.runtime.step import Packing

    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path, dtype="float32")
    requests = [
        Request(list(range(3 + i, 3 + i + 5 + 7 * i)), SamplingConfig(temperature=0.0, max_new_tokens=3 + i % 4, ignore_eos=True))
        for i in range(9)
    ]
    want = [r.token_ids for r in Generator(model, paged_kv(max_memory_mb=4), max_batch_size=4, prefill_chunk=16).batch_generate(requests)]
    streams: list[tuple[int, int]] = []  # (stream width, tokens in it)
    of = Packing.of

    def recorded(*args: object) -> tuple:  # type: ignore[type-arg]
        out = of(*args)  # type: ignore[arg-type]
        streams.append((out[0].shape[1], sum(args[3])))  # type: ignore[arg-type]
        return out

    monkeypatch.setattr(Packing, "of", staticmethod(recorded))
    steps = []
    for budget in (None, 24):
        generator = Generator(
            model, paged_kv(max_memory_mb=4), max_batch_size=4, prefill_chunk=16, refill_rows=2, prefill_apart=True,
            packed_steps=True, step_tokens=budget,
        )
        assert [r.token_ids for r in generator.batch_generate(requests)] == want
        steps.append(list(streams))
        streams.clear()
    unbudgeted, budgeted = steps
    assert {width for width, _ in budgeted} == {24}
    assert any(tokens == 24 for _, tokens in budgeted)  # full steps: chunks were cut to fill them
    assert sum(t for _, t in budgeted) == sum(t for _, t in unbudgeted)  # the same prompt tokens fed


def test_paged_steps_are_never_narrower_than_a_refill_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step width is a compiled shape: a group of refills and a smaller remainder share one, and
    the first admission of a full batch prefills a group at a time (the same tokens)."""
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    requests = [
        Request(list(range(5, 12 + 3 * i)), SamplingConfig(temperature=0.0, max_new_tokens=3 + i, ignore_eos=True)) for i in range(10)
    ]
    want = [r.token_ids for r in Generator(load_model(tmp_path), paged_kv(max_memory_mb=4), max_batch_size=8).batch_generate(requests)]
    steps = record_steps(monkeypatch)
    generator = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=8, refill_rows=4, prefill_apart=True)
    assert [r.token_ids for r in generator.batch_generate(requests)] == want
    assert steps and min(width for _, _, width in steps) >= 4  # 10 requests: the last 2 are admitted at a group's width
    # The first 8 prompts too: a group at a time, one compiled prefill width.
    assert {width for _, tokens, width in steps if tokens > 1} == {4}


def test_paged_steps_are_never_wider_than_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are padded to a power of two, but not past ``max_batch_size``: 3 rows step 3 wide, not 4."""
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    requests = [Request(list(range(5, 9 + 2 * i)), SamplingConfig(temperature=0.0, max_new_tokens=3 + i, ignore_eos=True)) for i in range(5)]
    want = [r.token_ids for r in Generator(model, max_batch_size=3).batch_generate(requests)]
    steps = record_steps(monkeypatch)
    generator = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=3, refill_rows=2)
    assert [r.token_ids for r in generator.batch_generate(requests)] == want
    widths = {width for _, _, width in steps}
    assert max(widths) == 3 and widths <= {2, 3}


def test_generating_rows_that_step_are_not_split_into_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only prompts prefill a group at a time: rows that draw on the host (a choice function) step
    all together, one step per token."""
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    steps = record_steps(monkeypatch)
    config = SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True, choose=lambda ids, probs: int(ids[0]))
    generator = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=8, refill_rows=4, prefill_apart=True)
    generator.batch_generate([Request(list(range(5, 9 + i)), config) for i in range(8)])
    # The first group's rows ride along with the second group's prefill, then all 8 step together
    # until the first group is done (each row's first token comes with its prompt's last step).
    assert [rows for rows, tokens, _ in steps if tokens == 1] == [8, 8, 4]


def test_refill_rows_is_checked() -> None:
    with pytest.raises(ConfigError, match="refill_rows"):
        EngineConfig(refill_rows=0)
    with pytest.raises(ConfigError, match="packed_steps"):
        EngineConfig(packed_steps=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="packed_steps=True"):
        EngineConfig(step_tokens=64)
    with pytest.raises(ConfigError, match="step_tokens"):
        EngineConfig(max_batch=8, packed_steps=True, step_tokens=4)


def test_decode_loops_never_narrow_their_output(tmp_path: Path) -> None:
    """A short answer after a long one runs the long one's compiled decode loop (its output columns
    never narrow; its draws are bounded by a traced step count) and gives the tokens it gives alone."""
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    prompt = list(range(5, 12))
    short = SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    alone = Generator(load_model(tmp_path)).generate(prompt, short).token_ids
    model = load_model(tmp_path)
    generator = Generator(model)
    generator.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    loops = {key for key in runner_for(model)._executables if key[0] == "decode"}
    assert generator.generate(prompt, short).token_ids == alone
    assert Generator(model).generate(prompt, short).token_ids == alone  # another engine of the model: the same loop
    assert {key for key in runner_for(model)._executables if key[0] == "decode"} == loops


def test_paged_tables_take_a_generations_final_width_at_once(tmp_path: Path) -> None:
    """A generation that outgrows its prompt's block-table width runs its prefill and its decode loop
    at the width it ends with (one compiled shape each), with the dense cache's tokens."""
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    prompt = list(range(5, 12))  # one page of 16; with 150 new tokens, 10 pages: a table of 16
    config = SamplingConfig(temperature=0.0, max_new_tokens=150, ignore_eos=True)
    want = Generator(load_model(tmp_path)).generate(prompt, config).token_ids
    assert Generator(model, paged_kv(max_memory_mb=4, page_size=16)).generate(prompt, config).token_ids == want
    steps = [key for key in runner_for(model)._executables if key[0] in ("mixed", "decode")]
    widths = {shape[1] for key in steps for shape, _ in key[1][1] if len(shape) == 2}  # the kv state's block tables
    assert {key[0] for key in steps} == {"mixed", "decode"} and widths == {16}
