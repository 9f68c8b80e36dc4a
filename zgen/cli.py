"""The ``zgen`` command: generate text, chat, measure perplexity, and look after zgen's caches.

Every flag is checked before anything loads: a bad value is a usage error naming the flag (exit code
2). Progress goes to stderr (:mod:`zgen.cli_progress`), text and JSON to stdout; a failure after the
checks exits with code 1.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, cast

import jax
import typer
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from zgen.batch import BatchSummary, register_modules, run as run_batch
from zgen.cache.factory import CACHE_KINDS, PAGED_KINDS, CacheOption, cache_kind, kv_dtype, paged_kv, prefix_cache, resolve
from zgen.cache.formats import KV_DTYPES, kv_format
from zgen.cli_progress import CompileClock, Phase, Phases, stderr_console
from zgen.contexts.snapshot import store_dir
from zgen.embeddings import embed, parse_inputs
from zgen.errors import AdapterError, ConfigError, ZgenError
from zgen.evaluation import perplexity, read_text_file
from zgen.generator import Generator, Prompt
from zgen.loading.builtin import BUILTIN_MODELS, DEFAULT_MODEL, builtin_model_path
from zgen.lora import LoraAdapter, load_adapter
from zgen.model import DTYPES, GGUF_WEIGHTS, WEIGHTS_CHOICES, Model, default_cache_dir, load_model, resolve_model
from zgen.runtime.beam import EarlyStopping
from zgen.runtime.grammar import Grammar
from zgen.runtime.sampling import SamplingConfig
from zgen.runtime.step import POOLINGS, Pooling
from zgen.speculative import DraftModel, Jacobi, PromptLookup, Speculator, TreeShape
from zgen.speculative.eagle import Eagle


def _untyped_flags(params: list[Any]) -> list[Any]:
    """Flags without typer's ``<bool>`` label in --help, which reads as if they took a value."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx))


app = typer.Typer(cls=_Group, help="LLM text generation in JAX.", no_args_is_help=True, pretty_exceptions_enable=False)
eval_app = typer.Typer(cls=_Group, help="Evaluate a model.", no_args_is_help=True)
cache_app = typer.Typer(
    cls=_Group, help="List or clear zgen's caches (converted weights, compiled programs, saved contexts).", no_args_is_help=True
)
app.add_typer(eval_app, name="eval")
app.add_typer(cache_app, name="cache")
eagle_app = typer.Typer(cls=_Group, help="Train EAGLE heads (speculative decoding from the model's own features).", no_args_is_help=True)
app.add_typer(eagle_app, name="eagle")

# The sampling knobs a model's generation_config.json may recommend, and each command's defaults when
# it recommends none (SamplingConfig's own defaults fill the rest: no top-k, top-p, min-p or penalty).
SAMPLING_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GENERATE_DEFAULTS: dict[str, float] = {"temperature": 1.0}
CHAT_DEFAULTS: dict[str, float] = {"temperature": 0.7, "top_p": 0.95}


# -- flags ------------------------------------------------------------------------------------------


def _one_of(choices: Sequence[str]) -> Callable[[str | None], str | None]:
    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


def _choice(name: str, choices: Sequence[str], help: str) -> Any:
    return typer.Option(name, metavar=f"[{'|'.join(choices)}]", callback=_one_of(choices), help=help)


def _positive(upper: float | None = None) -> Callable[[float | None], float | None]:
    """A check of a number in (0, upper]: typer's own ``min`` only has closed bounds."""

    def check(value: float | None) -> float | None:
        if value is not None and not (0.0 < value and (upper is None or value <= upper)):
            raise typer.BadParameter(f"{value} is not in (0, {upper}]" if upper is not None else f"{value} is not > 0")
        return value

    return check


def _non_empty(values: list[str] | None) -> list[str] | None:
    if values and not all(values):
        raise typer.BadParameter("a stop string cannot be empty")
    return values


ModelOption = Annotated[
    str, typer.Option("--model", "-m", help=f"Built-in name ({', '.join(BUILTIN_MODELS)}), HF model directory or .gguf file.")
]
DtypeOption = Annotated[str, _choice("--dtype", tuple(DTYPES), "Weight and activation dtype.")]
WeightsOption = Annotated[
    str | None,
    _choice(
        "--weights",
        WEIGHTS_CHOICES,
        "Hold the linear layers' weights quantized: int8 / int4 quantized at load, gguf computes on a GGUF file's own "
        "Q8_0/Q4_0/Q4_1/Q4_K blocks. Default: in --dtype.",
    ),
]
MaxNewOption = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate at most.")]
_MODEL_DEFAULT = "Default: the model's recommendation, else"
TemperatureOption = Annotated[
    float | None,
    typer.Option(min=0.0, help=f"Softmax temperature; 0 = greedy. {_MODEL_DEFAULT} 1.0 (generate), 0.7 (chat)."),
]
TopKOption = Annotated[int | None, typer.Option(min=0, help=f"Keep the k most likely tokens; 0 = off. {_MODEL_DEFAULT} 0.")]
TopPOption = Annotated[
    float | None,
    typer.Option(callback=_positive(1.0), help=f"Nucleus sampling mass in (0, 1]; 1 = off. {_MODEL_DEFAULT} 1 (generate), 0.95 (chat)."),
]
MinPOption = Annotated[
    float | None,
    typer.Option(min=0.0, max=1.0, help=f"Drop tokens below min-p × the top probability; 0 = off. {_MODEL_DEFAULT} 0."),
]
RepetitionOption = Annotated[
    float | None,
    typer.Option(callback=_positive(), help=f"Penalty on tokens already seen, > 0; 1 = off. {_MODEL_DEFAULT} 1."),
]
SeedOption = Annotated[int | None, typer.Option(help="Random seed; the same seed gives the same output.")]
StopOption = Annotated[
    list[str] | None,
    typer.Option(
        "--stop",
        metavar="TEXT",
        callback=_non_empty,
        help="Stop where this text appears (it is left out of the output). Repeat the flag for several: --stop A --stop B.",
    ),
]
IgnoreEosOption = Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the model's end-of-sequence tokens.")]
KVCacheOption = Annotated[
    str | None,
    _choice(
        "--kv-cache",
        CACHE_KINDS,
        "KV cache kind (default: tensor; paged for fp8/q4/q3). compressed is lossy: perplexity several times "
        "higher (5.5× on SmolLM2, docs/kv_quantization.md).",
    ),
]
KVDtypeOption = Annotated[
    str | None,
    _choice(
        "--kv-dtype",
        KV_DTYPES,
        "KV storage format (default: the model dtype). fp8/q4/q3 need pages; on CPU, bf16, fp8, q4 and q3 "
        "pages decode several times slower than fp32 today (docs/kv_quantization.md).",
    ),
]
PrefixCacheOption = Annotated[
    bool,
    typer.Option(
        "--prefix-cache",
        help="Share prompt prefixes across requests, up to 4096 blocks on the device (needs pages: makes the "
        "default cache paged; tiered always has one, unbounded without this flag).",
    ),
]
PromptLookupOption = Annotated[
    bool,
    typer.Option(
        "--prompt-lookup",
        help="Speculative decoding with n-gram drafts from the prompt and the text so far (same output; faster when "
        "the reply repeats its context, e.g. summaries and code edits; drafting pauses while its passes do not pay).",
    ),
]
DraftModelOption = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        metavar="MODEL",
        help="Speculative decoding with this smaller model as the draft (same tokenizer required; same output; "
        "the draft length adapts, and drafting pauses while it is mostly rejected).",
    ),
]
EarlyExitOption = Annotated[
    int | None,
    typer.Option(
        "--early-exit",
        metavar="N",
        min=1,
        help="Speculative decoding drafting with the model's own first N layers, final norm and LM head (a "
        "self-speculative draft, no second model; same output).",
    ),
]
JacobiOption = Annotated[
    bool,
    typer.Option(
        "--jacobi",
        help="Speculative decoding with Jacobi (lookahead) drafts: the model's own predictions from earlier "
        "passes and the n-grams they form, no draft model (same output; drafting pauses while its passes do not pay).",
    ),
]
EagleOption = Annotated[
    Path | None,
    typer.Option(
        "--eagle",
        metavar="DIR",
        file_okay=False,
        help="Speculative decoding with the EAGLE head trained into DIR by `zgen eagle train` for this model (same output).",
    ),
]
DraftTreeOption = Annotated[
    str | None,
    typer.Option(
        "--draft-tree",
        metavar="WIDTHxSIZE",
        help="With --draft-model, --early-exit or --eagle: draft EAGLE-2 token trees instead of chains, expanding the "
        "WIDTH likeliest nodes per depth by their WIDTH likeliest tokens and verifying the SIZE likeliest nodes in "
        "one pass (e.g. 4x16; the depth is --num-draft-tokens; same output).",
    ),
]
TensorParallelOption = Annotated[
    int, typer.Option("--tensor-parallel", min=1, help="Split the model's heads and MLP columns over this many local devices.")
]
NumDraftOption = Annotated[
    int | None,
    typer.Option("--num-draft-tokens", metavar="K", min=1, max=32, help="Tokens drafted per pass at most (default: 8 with --prompt-lookup or --jacobi, else 4)."),
]

# --early-stopping's values, as HF transformers' generate(early_stopping=...) takes them.
EARLY_STOPPING: dict[str, EarlyStopping] = {"true": True, "false": False, "never": "never"}
EarlyStoppingOption = Annotated[
    str | None,
    _choice(
        "--early-stopping",
        tuple(EARLY_STOPPING),
        "When beam search stops (needs --num-beams > 1): true as soon as num-beams beams have finished; false "
        "(default) once the best live beam, scored at its current length, cannot beat the worst finished one; "
        "never once it cannot at the longest length it could reach (HF transformers' early_stopping).",
    ),
]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value


def _lora_specs(values: list[str] | None) -> list[str] | None:
    for value in values or []:
        _split_lora(value)
    return values


def _split_lora(value: str) -> tuple[str, float]:
    """``PATH[:SCALE]`` as (path, scale); a suffix that is not a number belongs to the path."""
    path, _, scale = value.rpartition(":")
    if path and scale:
        try:
            number = float(scale)
        except ValueError:
            return value, 1.0
        if not math.isfinite(number):
            raise typer.BadParameter(f"the scale of {value!r} must be a finite number")
        return path, number
    if not value:
        raise typer.BadParameter("an adapter path cannot be empty")
    return value, 1.0


def _read_adapters(specs: list[str] | None) -> list[tuple[LoraAdapter, float]]:
    return [(load_adapter(path), scale) for path, scale in map(_split_lora, specs or [])]


def _with_adapters(model: Model, adapters: list[tuple[LoraAdapter, float]]) -> Model:
    for adapter, scale in adapters:
        model.push_adapter(adapter, scale)
    return model


def _lora_module_specs(values: list[str] | None) -> list[str] | None:
    names: set[str] = set()
    for value in values or []:
        name = _split_lora_module(value)[0]
        if name in names:
            raise typer.BadParameter(f"the LoRA module name {name!r} is given twice; each name picks one adapter")
        names.add(name)
    return values


def _split_lora_module(value: str) -> tuple[str, str, float]:
    """``NAME=PATH[:SCALE]`` as (name, path, scale)."""
    name, equals, rest = value.partition("=")
    if not equals or not name.strip() or not rest:
        raise typer.BadParameter(f"give NAME=PATH[:SCALE] (e.g. sql=./sql-lora), got {value!r}")
    return (name, *_split_lora(rest))


def _read_lora_modules(specs: list[str] | None, base_name: str) -> dict[str, tuple[LoraAdapter, float]]:
    """The adapters of --lora-modules, read before the model loads (a usage error names the flag)."""
    modules: dict[str, tuple[LoraAdapter, float]] = {}
    for name, path, scale in map(_split_lora_module, specs or []):
        if name == base_name:
            raise typer.BadParameter(
                f"the LoRA module {name!r} has the base model's name (--model / --served-model-name), so requests could not "
                "choose between them; rename it",
                param_hint="'--lora-modules'",
            )
        try:
            modules[name] = (load_adapter(path, name=name), scale)
        except AdapterError as err:
            raise typer.BadParameter(str(err), param_hint="'--lora-modules'") from None
    return modules


LoraOption = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="PATH[:SCALE]",
        callback=_lora_specs,
        help="A PEFT LoRA adapter directory, with an optional scale (default 1). Repeat the flag to stack adapters.",
    ),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr (it is also off when stderr is not a terminal).")]


def _show_version(value: bool) -> None:
    if value:
        print(f"zgen {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print zgen's version and exit.")
    ] = False,
) -> None:
    """LLM text generation in JAX."""


# -- checks before anything loads -------------------------------------------------------------------


def _model_path(model: str, flag: str = "--model") -> Path:
    try:
        return resolve_model(model)
    except ZgenError as err:
        raise typer.BadParameter(str(err), param_hint=f"'{flag}'") from None


def _cache_options(kind: str | None, dtype: str | None, prefix: bool) -> list[CacheOption]:
    """The cache the flags describe, or a usage error naming the flags that disagree."""
    if kind is not None and kind not in PAGED_KINDS:
        if dtype is not None and not kv_format(dtype).plain:
            raise typer.BadParameter(
                f"{dtype} stores K/V in pages and the {kind} cache has none; use --kv-cache paged or tiered, "
                "or leave --kv-cache out",
                param_hint="'--kv-dtype'",
            )
        if prefix:
            raise typer.BadParameter(
                f"a prefix cache shares pages and the {kind} cache has none; use --kv-cache paged or tiered, "
                "or leave --kv-cache out",
                param_hint="'--prefix-cache'",
            )
    options: list[CacheOption] = [] if kind is None else [cache_kind(kind)]
    if dtype is not None:
        options.append(kv_dtype(dtype))
    if prefix:
        options.append(prefix_cache(capacity_blocks=4096))
    try:
        resolve(options)
    except ConfigError as err:  # a combination the checks above do not know yet
        raise typer.BadParameter(str(err), param_hint="'--kv-cache' / '--kv-dtype' / '--prefix-cache'") from None
    return options


def recommended_sampling(model_path: Path) -> dict[str, float]:
    """The sampling an HF model directory's ``generation_config.json`` recommends (``do_sample:
    false`` means greedy); empty for GGUF files, which carry none."""
    try:
        raw: object = json.loads((model_path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    config = cast(dict[str, object], raw)
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {
        knob: value
        for knob in SAMPLING_KNOBS
        if isinstance(value := config.get(knob), int | float) and not isinstance(value, bool)
    }


@dataclass(frozen=True)
class _Sampling:
    config: SamplingConfig
    source: str  # where the knobs left out came from, for the progress note


def _sampling(
    model_path: Path,
    command_defaults: dict[str, float],
    chosen: dict[str, float | None],
    *,
    max_new_tokens: int,
    seed: int | None,
    stop: list[str] | None,
    ignore_eos: bool,
) -> _Sampling:
    """Sampling from the flags given, then the model's recommendation, then the command's defaults."""
    recommended = recommended_sampling(model_path)
    values = {**command_defaults, **recommended, **{k: v for k, v in chosen.items() if v is not None}}
    base = SamplingConfig(max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos)
    try:
        config = replace(base, **values)
    except ConfigError as err:  # a recommendation out of range (the flags' own ranges are checked)
        raise typer.BadParameter(str(err), param_hint="the sampling flags or the model's generation_config.json") from None
    source = "the model's generation_config.json" if recommended else "zgen's defaults (the model recommends none)"
    return _Sampling(config, source)


# -- phases -----------------------------------------------------------------------------------------


def _check_weights(weights: str | None, path: Path) -> None:
    """--weights gguf needs a GGUF file: said before anything loads."""
    if weights == GGUF_WEIGHTS and path.is_dir():
        raise typer.BadParameter(
            f"gguf computes on a GGUF file's own quantized tensors and {path} is an HF directory; use --weights int8 or int4",
            param_hint="'--weights'",
        )


def _load(phases: Phases, model: str, path: Path, dtype: str, sampling: _Sampling | None, weights: str | None = None, *, tensor_parallel: int = 1
) -> Model:
    phases.note(f"Model {path}" if model == str(path) else f"Model {model}: {path}")
    if sampling is not None:
        phases.note(f"Sampling: {_describe_sampling(sampling.config)}; knobs left out come from {sampling.source}")
    held = dtype if weights is None else f"{dtype}, {weights} linear weights"
    with phases.phase(f"Loading weights ({held})") as phase:

        def converting(done: int, total: int) -> None:
            if weights == GGUF_WEIGHTS:
                phase.describe("Repacking the GGUF's quantized blocks")
            else:
                phase.describe("Converting GGUF weights to float32 (first load only)" if done < total else "Saving the converted weights")
            phase.measure(done, total)

        loaded = load_model(path, dtype=dtype, progress=converting, weights=weights, tensor_parallel=tensor_parallel)
        outcome = {"gguf": "Converted the GGUF weights and cached them", "converted-cache": "Loaded the converted weights from the cache"}
        phase.describe(f"{outcome.get(loaded.load_timings.source, 'Loaded the weights')} ({held})")
    return loaded


def _describe_sampling(config: SamplingConfig) -> str:
    if config.greedy:
        return "greedy (temperature 0)"
    knobs = [f"temperature {config.temperature:g}"]
    knobs += [f"top-k {config.top_k}"] if config.top_k else []
    knobs += [f"top-p {config.top_p:g}"] if config.top_p < 1.0 else []
    knobs += [f"min-p {config.min_p:g}"] if config.min_p else []
    knobs += [f"repetition penalty {config.repetition_penalty:g}"] if config.repetition_penalty != 1.0 else []
    return ", ".join(knobs)


def _first_piece(pieces: Iterator[str], phases: Phases, waiting: str) -> str:
    """Step ``pieces`` to its first text, showing the compile and prefill phase meanwhile."""
    with phases.phase(waiting) as phase, CompileClock(_compile_status(phase, waiting)) as compiles:
        first = next(pieces, "")
        compiled = f", compiled {compiles.count} programs in {compiles.seconds:.1f} s" if compiles.count else ""
        phase.describe(f"First token{compiled}")
    return first


def _compile_status(phase: Phase, waiting: str) -> Callable[[bool], None]:
    return lambda compiling: phase.describe("Compiling the model's steps (once per shape and process)" if compiling else waiting)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _fail(err: ZgenError) -> typer.Exit:
    stderr_console().print(f"[bold red]error:[/] {escape(str(err))}")
    return typer.Exit(code=1)


# -- commands ---------------------------------------------------------------------------------------


@app.command(cls=_Command)
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")] = "Once upon a time,",
    model: ModelOption = DEFAULT_MODEL,
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user message through the chat template.")] = False,
    max_new_tokens: MaxNewOption = 256,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    min_p: MinPOption = None,
    repetition_penalty: RepetitionOption = None,
    seed: SeedOption = None,
    stop: StopOption = None,
    ignore_eos: IgnoreEosOption = False,
    dtype: DtypeOption = "float32",
    weights: WeightsOption = None,
    tensor_parallel: TensorParallelOption = 1,
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    use_prefix_cache: PrefixCacheOption = False,
    prompt_lookup: PromptLookupOption = False,
    draft_model: DraftModelOption = None,
    early_exit: EarlyExitOption = None,
    jacobi: JacobiOption = False,
    eagle: EagleOption = None,
    num_draft_tokens: NumDraftOption = None,
    draft_tree: DraftTreeOption = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON object (text, ids, log-probs, usage, timings, speculative) instead of streaming text."),
    ] = False,
    lora: LoraOption = None,
    num_beams: Annotated[
        int, typer.Option("--num-beams", min=1, help="Beam search with this many beams (1: sample as the flags say). Prints the best beam; --json gives every beam.")
    ] = 1,
    length_penalty: Annotated[
        float, typer.Option("--length-penalty", callback=_finite, help="Beam scores are summed log-probs / length ** this (> 0 favours longer beams).")
    ] = 1.0,
    early_stopping: EarlyStoppingOption = None,
    quiet: QuietOption = False,
    json_schema: Annotated[Path | None, typer.Option("--json-schema", help="The output is JSON valid under this JSON Schema file.")] = None,
    regex: Annotated[str | None, typer.Option("--regex", help="The output matches this regular expression as a whole.")] = None,
    lark: Annotated[Path | None, typer.Option("--lark", help="The output follows this Lark grammar file (rule 'start').")] = None,
) -> None:
    """Generate a continuation of a prompt, streamed to stdout.

    Sampling flags left out follow the model's recommendation (generation_config.json in an HF
    directory). Otherwise sampling is plain, temperature 1.0 without filtering: the built-in SmolLM2
    GGUF recommends nothing, so pass --temperature 0 for greedy, repeatable text (or e.g.
    --temperature 0.7 --top-p 0.9).

    Speculative decoding (--prompt-lookup, --draft-model, --early-exit, --jacobi, --eagle) drafts tokens cheaply
    and checks them in one forward pass: greedy output is exactly the plain output, sampled output follows
    the same distribution. --tensor-parallel N splits the model over N local devices (speculators included).
    """
    if not (prompt or chat):
        raise typer.BadParameter("the prompt is empty", param_hint="'--prompt'")
    speculating = _check_speculator_flags(prompt_lookup, draft_model, early_exit, jacobi, num_draft_tokens, kv_cache, eagle=eagle)
    tree = _draft_tree(draft_tree, speculating=speculating, prompt_lookup=prompt_lookup, jacobi=jacobi)
    if early_stopping is not None and num_beams < 2:
        raise typer.BadParameter("--early-stopping applies to beam search; add --num-beams N with N > 1", param_hint="'--early-stopping'")
    path = _model_path(model)
    draft_path = _model_path(draft_model, "--draft-model") if draft_model is not None else None
    _check_weights(weights, path)
    chosen = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "repetition_penalty": repetition_penalty}
    sampling = _sampling(path, GENERATE_DEFAULTS, chosen, max_new_tokens=max_new_tokens, seed=seed, stop=stop, ignore_eos=ignore_eos)
    grammar = _grammar(json_schema, regex, lark)
    if grammar is not None:
        sampling = replace(sampling, config=replace(sampling.config, grammar=grammar))
    options = _cache_options(kv_cache, kv_dtype_name, use_prefix_cache)
    request: Prompt = [{"role": "user", "content": prompt}] if chat else prompt
    show = not (quiet or as_json)
    try:
        adapters = _read_adapters(lora)
        with Phases.on_stderr(enabled=show) as phases:
            loaded = _with_adapters(_load(phases, model, path, dtype, sampling, weights, tensor_parallel=tensor_parallel), adapters)
            draft = _load(phases, draft_model, draft_path, dtype, None) if draft_model is not None and draft_path is not None else None
            speculator = _speculator(loaded, prompt_lookup, draft, early_exit, num_draft_tokens, jacobi=jacobi, eagle=eagle, tree=tree)
            generator = Generator(loaded, *options, speculative=speculator)
        with generator:
            if num_beams > 1:
                stopping = EARLY_STOPPING[early_stopping or "false"]
                _print_beams(generator, request, num_beams, length_penalty, max_new_tokens, as_json, stopping)
                return
            if as_json:
                print(json.dumps(_json_result(generator, request, sampling.config), ensure_ascii=False))
                return
            pieces = generator.generate_stream(request, sampling.config)
            with Phases.on_stderr(enabled=show) as phases:
                prompt_tokens = len(generator.encode_prompt(request))
                first = _first_piece(pieces, phases, f"Prefilling {prompt_tokens} prompt tokens")
            _write(first)
            for piece in pieces:
                _write(piece)
            _write("\n")
    except ZgenError as err:
        raise _fail(err) from None


def _check_speculator_flags(
    prompt_lookup: bool, draft_model: str | None, early_exit: int | None, jacobi: bool, num_draft_tokens: int | None, kv_cache: str | None,
    *, eagle: Path | None = None,
) -> bool:
    """Refuse contradictory speculative-decoding flags before anything loads; whether one was chosen."""
    chosen = [
        flag
        for flag, on in (
            ("--prompt-lookup", prompt_lookup), ("--draft-model", draft_model), ("--early-exit", early_exit), ("--jacobi", jacobi),
            ("--eagle", eagle is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise typer.BadParameter(f"choose one speculator, got {' and '.join(chosen)}", param_hint="'--prompt-lookup'")
    if num_draft_tokens is not None and not chosen:
        raise typer.BadParameter("--num-draft-tokens needs --prompt-lookup, --draft-model, --early-exit, --jacobi or --eagle", param_hint="'--num-draft-tokens'")
    if chosen and kv_cache == "compressed":
        raise typer.BadParameter("speculative decoding cannot roll back the lossy compressed cache; choose another", param_hint="'--kv-cache'")
    return bool(chosen)


def _draft_tree(spec: str | None, *, speculating: bool, prompt_lookup: bool, jacobi: bool) -> TreeShape | None:
    """--draft-tree WIDTHxSIZE as a tree shape, checked before anything loads."""
    if spec is None:
        return None
    if not speculating or prompt_lookup or jacobi:
        raise typer.BadParameter(
            "token trees are drafted by a model: use --draft-tree with --draft-model, --early-exit or --eagle", param_hint="'--draft-tree'"
        )
    width, sep, size = spec.lower().partition("x")
    if not sep or not width.isdigit() or not size.isdigit():
        raise typer.BadParameter(f"expected WIDTHxSIZE (e.g. 4x16), got {spec!r}", param_hint="'--draft-tree'")
    try:
        return TreeShape(width=int(width), size=int(size))
    except ConfigError as err:
        raise typer.BadParameter(str(err), param_hint="'--draft-tree'") from None


def _speculator(
    model: Model, prompt_lookup: bool, draft: Model | None, early_exit: int | None, num_tokens: int | None, *, jacobi: bool = False,
    eagle: Path | None = None, tree: TreeShape | None = None,
) -> Speculator | None:
    if eagle is not None:
        return Eagle.load(eagle, model, num_tokens or 4, tree=tree)
    if prompt_lookup:
        return PromptLookup(num_tokens=num_tokens or 8)
    if jacobi:
        return Jacobi(num_tokens or 8)
    if draft is not None:
        return DraftModel(draft, num_tokens or 4, tree=tree)
    if early_exit is not None:
        return DraftModel.early_exit(model, layers=early_exit, num_tokens=num_tokens or 4, tree=tree)
    return None


def _print_beams(
    generator: Generator, request: Prompt, num_beams: int, length_penalty: float, max_new: int, as_json: bool,
    early_stopping: EarlyStopping = False,
) -> None:
    beams = generator.beam_search(
        request, num_beams, length_penalty=length_penalty, max_new_tokens=max_new, early_stopping=early_stopping
    )
    if as_json:
        listed = [{"text": b.text, "token_ids": b.token_ids, "score": b.score, "finish_reason": b.finish_reason} for b in beams]
        print(json.dumps({"beams": listed, "prompt_token_ids": generator.encode_prompt(request)}, ensure_ascii=False))
    else:
        _write(beams[0].text + "\n")


def _grammar(json_schema: Path | None, regex: str | None, lark: Path | None) -> Grammar | None:
    """The grammar one of --json-schema / --regex / --lark asks for, checked before anything loads."""
    given = [(flag, value) for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--lark", lark)) if value is not None]
    if len(given) > 1:
        raise typer.BadParameter("give at most one of --json-schema, --regex and --lark", param_hint=f"'{given[1][0]}'")
    if not given:
        return None
    flag, value = given[0]
    try:
        if isinstance(value, Path):
            text = value.read_text(encoding="utf-8")
            return Grammar.json_schema(text) if flag == "--json-schema" else Grammar.lark(text)
        return Grammar.regex(value)
    except (OSError, UnicodeDecodeError) as err:
        raise typer.BadParameter(f"cannot read {value}: {err}", param_hint=f"'{flag}'") from None
    except ZgenError as err:
        raise typer.BadParameter(str(err), param_hint=f"'{flag}'") from None


def _json_result(generator: Generator, request: Prompt, sampling: SamplingConfig) -> dict[str, object]:
    with CompileClock() as compiles:
        start = time.perf_counter()
        result = generator.generate(request, sampling)
        total_s = time.perf_counter() - start
    load = generator.model.load_timings
    decode_s = result.timings.decode_s
    decoded = result.usage.completion_tokens - 1  # the first token comes out of the prefill
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "prompt_token_ids": result.prompt_token_ids,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
        "usage": {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens},
        "timings": {
            "load_s": load.read_s + load.to_device_s,
            "compile_s": compiles.seconds,  # XLA compiling during the request, inside the times below
            "first_token_s": total_s - decode_s,  # the wait for the first token: encode, compile, prefill
            "decode_s": decode_s,
            "total_s": total_s,
            "decode_tokens_per_s": decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0,
        },
        "speculative": None if result.speculative is None else result.speculative.as_dict(),
    }


@app.command(cls=_Command)
def chat(
    model: ModelOption = DEFAULT_MODEL,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    max_new_tokens: MaxNewOption = 512,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    min_p: MinPOption = None,
    repetition_penalty: RepetitionOption = None,
    seed: SeedOption = None,
    dtype: DtypeOption = "float32",
    weights: WeightsOption = None,
    tensor_parallel: TensorParallelOption = 1,
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    use_prefix_cache: PrefixCacheOption = False,
    lora: LoraOption = None,
    quiet: QuietOption = False,
) -> None:
    """Chat interactively, each reply streamed as it is generated.

    The conversation's KV cache is kept between turns. An empty line, end of input or Ctrl-C at the
    prompt quits; Ctrl-C during a reply drops it. Sampling flags left out follow the model's
    recommendation (generation_config.json in an HF directory), else temperature 0.7, top-p 0.95.
    """
    path = _model_path(model)
    _check_weights(weights, path)
    chosen = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "repetition_penalty": repetition_penalty}
    sampling = _sampling(path, CHAT_DEFAULTS, chosen, max_new_tokens=max_new_tokens, seed=seed, stop=None, ignore_eos=False)
    options = _cache_options(kv_cache, kv_dtype_name, use_prefix_cache)
    try:
        adapters = _read_adapters(lora)
        with Phases.on_stderr(enabled=not quiet) as phases:
            loaded = _load(phases, model, path, dtype, sampling, weights, tensor_parallel=tensor_parallel)
            generator = Generator(_with_adapters(loaded, adapters), *options)
    except ZgenError as err:
        raise _fail(err) from None
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    console = Console()
    waiting = "Compiling and prefilling"
    with generator:
        session = generator.new_session()
        while True:
            try:
                line = console.input("[bold green]you>[/] ")
            except (EOFError, KeyboardInterrupt):
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            try:
                reply = _chat_reply(console, session.generate_stream(messages, sampling.config), quiet, waiting)
            except ZgenError as err:
                stderr_console().print(f"[bold red]error:[/] {escape(str(err))}")
                reply = None
            if reply is None:
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})
            waiting = "Prefilling"


def _chat_reply(console: Console, pieces: Iterator[str], quiet: bool, waiting: str) -> str | None:
    """Stream one reply to stdout; None when Ctrl-C dropped it."""
    text: list[str] = []
    try:
        with Phases.on_stderr(enabled=not quiet, transient=True) as phases:
            text.append(_first_piece(pieces, phases, waiting))
        console.print("[bold blue]zgen>[/] ", end="")
        _write(text[0])
        for piece in pieces:
            text.append(piece)
            _write(piece)
    except KeyboardInterrupt:
        if isinstance(pieces, collections.abc.Generator):
            pieces.close()  # frees the reply's work now; the session forgets the turn
        _write("\n")
        return None
    _write("\n")
    return "".join(text)


@app.command("batch", cls=_Command)
def batch_job(
    input: Annotated[Path, typer.Option("--input", "-i", exists=True, dir_okay=False, readable=True, help="Requests, one OpenAI Batch API line each (/v1/chat/completions or /v1/completions).")],
    output: Annotated[Path, typer.Option("--output", "-o", dir_okay=False, help="Results JSONL; appended to, so running the same command again resumes the job.")],
    model: ModelOption = DEFAULT_MODEL,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", min=1, help="Rows decoding together (more requests queue and take rows as others finish).")] = 64,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", min=1, help="Prompt tokens one request feeds per step.")] = 512,
    refill_rows: Annotated[int | None, typer.Option("--refill-rows", min=1, help="Queued requests take freed rows this many at a time, prefilling together. Default: an eighth of --max-batch-size (half with --padded-steps).")] = None,
    step_tokens: Annotated[int | None, typer.Option("--step-tokens", min=1, help="Prefill steps are streams of exactly this many tokens (at least --max-batch-size), the rows' chunks cut to fill them. Default: streams a power of two wide.")] = None,
    packed_steps: Annotated[bool, typer.Option("--packed-steps/--padded-steps", help="Prefill steps pack their rows' tokens into one stream, a power of two wide (with --step-tokens: that many tokens), or pad each row to the chunk.")] = True,
    data_parallel: Annotated[int, typer.Option("--data-parallel", min=1, help="Model replicas sharing the job, one per local device (or per group of --tensor-parallel devices).")] = 1,
    tensor_parallel: TensorParallelOption = 1,
    dtype: DtypeOption = "float32",
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    use_prefix_cache: PrefixCacheOption = False,
    kv_memory_mb: Annotated[float | None, typer.Option("--kv-memory-mb", callback=_positive(), help="The page pool's budget in MiB (makes the cache paged; default 512). Size it for --max-batch-size rows of your longest request.")] = None,
    summary: Annotated[Path | None, typer.Option("--summary", dir_okay=False, help="Also write the final summary to this file as JSON.")] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--lora-modules", metavar="NAME=PATH[:SCALE]", callback=_lora_module_specs,
            help='A PEFT LoRA adapter requests pick by name: body "model": NAME (or "lora": NAME); others run on the base model. Repeatable.',
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="The base model's name in requests' and results' \"model\" field (default: the --model value).")
    ] = None,
    prompt_lookup: PromptLookupOption = False,
    draft_model: DraftModelOption = None,
    early_exit: EarlyExitOption = None,
    jacobi: JacobiOption = False,
    eagle: EagleOption = None,
    num_draft_tokens: NumDraftOption = None,
    draft_tree: DraftTreeOption = None,
    on_ray: Annotated[bool, typer.Option("--ray", help="Generate on Ray actors (the cluster ray.init() finds, else a local one); needs zgen[ray].")] = False,
    ray_actors: Annotated[int, typer.Option("--ray-actors", min=1, help="With --ray: actors, each loading the model once.")] = 1,
    ray_gpus: Annotated[float, typer.Option("--ray-gpus", min=0.0, help="With --ray: GPUs per actor.")] = 0.0,
    quiet: QuietOption = False,
) -> None:
    """Run a batch file of OpenAI-format requests; each result is appended to --output as it finishes.

    A bad line (not JSON, an unknown url, an invalid parameter, a prompt too long, a duplicate
    custom_id) becomes an error record for its custom_id and the job goes on. Killed at any point, the
    same command continues where it stopped (custom_ids already in --output are skipped; with the same
    --lora-modules). Exit code 0 when every request succeeded, 3 when some failed (the summary says how
    many). Speculative decoding (--prompt-lookup, --draft-model, --early-exit, --jacobi, --eagle) works as
    for `zgen generate`, also with --data-parallel, --tensor-parallel (a draft that is not the split model's
    own early exit is copied whole to each device of a group) and --ray (each Ray actor loads its own draft).
    """
    path = _model_path(model)
    speculating = _check_speculator_flags(prompt_lookup, draft_model, early_exit, jacobi, num_draft_tokens, kv_cache, eagle=eagle)
    tree = _draft_tree(draft_tree, speculating=speculating, prompt_lookup=prompt_lookup, jacobi=jacobi)
    draft_path = _model_path(draft_model, "--draft-model") if draft_model is not None else None
    if output.resolve() == input.resolve():
        raise typer.BadParameter("the output would overwrite the input; choose another file", param_hint="'--output'")
    options = _cache_options(kv_cache, kv_dtype_name, use_prefix_cache)
    if kv_memory_mb is not None:
        if kv_cache is not None and kv_cache not in PAGED_KINDS:
            raise typer.BadParameter(f"the {kv_cache} cache has no page pool; use --kv-cache paged or tiered", param_hint="'--kv-memory-mb'")
        options.append(paged_kv(max_memory_mb=kv_memory_mb))
    if on_ray and (step_tokens is not None or not packed_steps):
        raise typer.BadParameter(
            "Ray actors run the default packed prefill steps; leave out --step-tokens and --padded-steps with --ray",
            param_hint="'--step-tokens' / '--padded-steps'",
        )
    if on_ray and (data_parallel > 1 or tensor_parallel > 1):
        raise typer.BadParameter("Ray places one model per actor; use --ray-actors instead", param_hint="'--data-parallel' / '--tensor-parallel'")
    if lora_modules and (on_ray or tensor_parallel > 1):
        raise typer.BadParameter(
            "LoRA modules run on one device per model; leave out --ray and --tensor-parallel", param_hint="'--lora-modules'"
        )
    base_name = served_model_name or model
    adapters = _read_lora_modules(lora_modules, base_name)
    try:
        if on_ray:
            make_speculator = (
                functools.partial(
                    _actor_speculator, prompt_lookup, None if draft_path is None else str(draft_path), dtype, early_exit,
                    num_draft_tokens, jacobi, eagle, tree,
                )
                if speculating else None
            )
            result = _batch_on_ray(
                model if model in BUILTIN_MODELS else str(path), input, output, options, actors=ray_actors, gpus=ray_gpus, max_batch_size=max_batch_size,
                prefill_chunk=prefill_chunk, dtype=dtype, model_name=base_name, quiet=quiet, summary=summary, speculative=make_speculator,
            )
        else:
            with Phases.on_stderr(enabled=not quiet) as phases:
                split_here = data_parallel == 1  # one split model is loaded split; replicas are split per group
                loaded = _load(phases, model, path, dtype, None, tensor_parallel=tensor_parallel if split_here else 1)
                draft = _load(phases, draft_model, draft_path, dtype, None) if draft_model is not None and draft_path is not None else None
                speculator = _speculator(loaded, prompt_lookup, draft, early_exit, num_draft_tokens, jacobi=jacobi, eagle=eagle, tree=tree)
            try:
                register_modules(adapters, base_name=base_name, config=loaded.config)
            except AdapterError as err:
                raise typer.BadParameter(str(err), param_hint="'--lora-modules'") from None
            result = run_batch(
                loaded, input, output, *options, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk, refill_rows=refill_rows,
                step_tokens=step_tokens, packed_steps=packed_steps,
                data_parallel=data_parallel, tensor_parallel=1 if split_here else tensor_parallel, model_name=base_name,
                progress=not quiet, summary=summary, lora_modules=adapters, speculative=speculator,
            )
    except ZgenError as err:
        raise _fail(err) from None
    if not quiet:
        stderr_console().print(escape(result.describe()), highlight=False, soft_wrap=True)
    if result.failed:
        raise typer.Exit(code=3)


def _batch_on_ray(
    model: str, input: Path, output: Path, options: list[CacheOption], *, actors: int, gpus: float, max_batch_size: int,
    prefill_chunk: int, dtype: str, model_name: str, quiet: bool, summary: Path | None, speculative: Callable[[Model], Speculator] | None,
) -> BatchSummary:
    from zgen.integrations.ray import run_on_ray  # Ray loads only for --ray

    return run_on_ray(
        model, input, output, *options, actors=actors, gpus_per_actor=gpus, max_batch_size=max_batch_size,
        prefill_chunk=prefill_chunk, dtype=dtype, model_name=model_name, progress=not quiet, summary=summary, speculative=speculative,
    )


def _actor_speculator(
    prompt_lookup: bool, draft_path: str | None, dtype: str, early_exit: int | None, num_tokens: int | None, jacobi: bool,
    eagle: Path | None, tree: TreeShape | None, model: Model,
) -> Speculator:
    """The speculator the flags ask for, made inside a Ray actor for its loaded ``model`` (the draft
    model, if any, loaded there too)."""
    draft = load_model(draft_path, dtype=dtype) if draft_path is not None else None
    speculator = _speculator(model, prompt_lookup, draft, early_exit, num_tokens, jacobi=jacobi, eagle=eagle, tree=tree)
    assert speculator is not None, "the flags were checked to ask for a speculator"
    return speculator


@eval_app.command("ppl", cls=_Command)
def eval_ppl(
    text_file: Annotated[Path, typer.Option("--text-file", exists=True, dir_okay=False, readable=True, help="UTF-8 text to score.")],
    model: ModelOption = DEFAULT_MODEL,
    window: Annotated[int, typer.Option(min=2, help="Tokens per window; each window starts from an empty cache.")] = 512,
    chunk: Annotated[
        int | None, typer.Option(min=1, help="Tokens fed per step within a window (1 = pure decode). Default: 64, or the window if shorter.")
    ] = None,
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    dtype: DtypeOption = "float32",
    weights: WeightsOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    quiet: QuietOption = False,
) -> None:
    """Perplexity of a text with the chosen KV cache in the loop (no BOS; every token after a window's first is scored)."""
    if chunk is not None and chunk > window:
        raise typer.BadParameter(f"{chunk} is larger than --window {window}; a window is fed at most whole", param_hint="'--chunk'")
    path = _model_path(model)
    _check_weights(weights, path)
    options = _cache_options(kv_cache, kv_dtype_name, False)
    try:
        text = read_text_file(text_file)
    except ZgenError as err:
        raise typer.BadParameter(str(err), param_hint="'--text-file'") from None
    try:
        with Phases.on_stderr(enabled=not (quiet or as_json)) as phases:
            loaded = _load(phases, model, path, dtype, None, weights)
            ids = loaded.tokenizer.encode(text, add_special_tokens=False)
            scoring = f"Scoring {len(ids)} tokens in windows of {window}"
            with phases.phase(scoring) as phase, CompileClock(_compile_status(phase, scoring)):
                result = perplexity(loaded, ids, *options, window=window, chunk=min(64, window) if chunk is None else chunk)
    except ZgenError as err:
        raise _fail(err) from None
    fields = {"ppl": result.ppl, "nll": result.nll, "tokens_scored": result.tokens_scored, "windows": result.windows}
    if as_json:
        print(json.dumps(fields))
    else:
        Console().print(fields)


@app.command("embed", cls=_Command)
def embed_command(
    input_file: Annotated[
        Path, typer.Option("--input", "-i", exists=True, dir_okay=False, readable=True, help="Texts: a .txt file (one per line) or .jsonl ({\"text\": ..., \"id\": ...} per line).")
    ],
    output_file: Annotated[Path, typer.Option("--output", "-o", dir_okay=False, help="Where to write one JSON object per text (index, id, embedding).")],
    model: ModelOption = DEFAULT_MODEL,
    pooling: Annotated[str, _choice("--pooling", POOLINGS, "How each text's last hidden states become one vector.")] = "mean",
    normalize: Annotated[bool, typer.Option("--normalize/--no-normalize", help="Scale every embedding to unit length.")] = True,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Texts per step.")] = 32,
    dtype: DtypeOption = "float32",
    lora: LoraOption = None,
    quiet: QuietOption = False,
) -> None:
    """Embed texts: the model's last hidden states (after the final norm) pooled per text."""
    try:
        items = parse_inputs(read_text_file(input_file), jsonl=input_file.suffix == ".jsonl", source=str(input_file))
    except ZgenError as err:
        raise typer.BadParameter(str(err), param_hint="'--input'") from None
    path = _model_path(model)
    try:
        adapters = _read_adapters(lora)
        with Phases.on_stderr(enabled=not quiet) as phases:
            loaded = _with_adapters(_load(phases, model, path, dtype, None), adapters)
            with phases.phase(f"Embedding {len(items)} texts"):
                vectors = embed(loaded, [text for text, _ in items], pooling=cast(Pooling, pooling), normalize=normalize, batch_size=batch_size)
    except ZgenError as err:
        raise _fail(err) from None
    partial = output_file.with_name(f".{output_file.name}.partial")
    with open(partial, "w", encoding="utf-8") as out:
        for index, ((_, key), vector) in enumerate(zip(items, vectors.tolist(), strict=True)):
            row: dict[str, object] = {"index": index, "embedding": vector}
            if key is not None:
                row["id"] = key
            out.write(json.dumps(row) + "\n")
    os.replace(partial, output_file)


# -- information and caches -------------------------------------------------------------------------


def _version() -> str:
    try:
        return importlib.metadata.version("zgen")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


@dataclass(frozen=True)
class CacheDir:
    name: str
    holds: str
    path: Path


def cache_dirs() -> list[CacheDir]:
    """zgen's caches on disk, as the environment places them now."""
    # The directory zgen.runtime.runner.enable_persistent_compilation_cache gives jax (GPU and TPU).
    xla = os.environ.get("ZGEN_XLA_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen" / "xla"
    return [
        CacheDir("weights", "GGUF weights converted to float32 ($ZGEN_CACHE_DIR)", default_cache_dir() / "converted"),
        CacheDir("xla", "compiled programs, GPU and TPU only ($ZGEN_XLA_CACHE_DIR)", Path(xla)),
        CacheDir("contexts", "saved contexts, Context.save ($ZGEN_STORE_DIR)", store_dir()),
    ]


def _entries(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else []


def _size(path: Path) -> int:
    """Bytes under ``path`` (a file or a directory tree; links are not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum((Path(root) / name).lstat().st_size for root, _, names in os.walk(path) for name in names)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _dependencies() -> list[str]:
    """zgen's own requirements (no extras), and the packages that ship the built-in models."""
    try:
        requirements = importlib.metadata.requires("zgen") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    names = [m.group(0) for r in requirements if "extra ==" not in r and (m := re.match(r"[A-Za-z0-9._-]+", r))]
    return names + [entry.package for entry in BUILTIN_MODELS.values()]


def _devices() -> list[str]:
    devices = cast(list[Any], jax.devices())  # pyright: ignore[reportUnknownMemberType]
    return [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]


def _builtin_model(name: str) -> str:
    try:
        return str(builtin_model_path(name))
    except ZgenError as err:
        return str(err)


@app.command(cls=_Command)
def info(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Versions, platform, devices, built-in models and cache locations: what a bug report needs."""
    python = f"{platform.python_version()} ({sys.executable})"
    packages = {name: _installed(name) for name in _dependencies()}
    models = {name: _builtin_model(name) for name in BUILTIN_MODELS}
    caches = [(c, _size(c.path), len(_entries(c.path))) for c in cache_dirs()]
    if as_json:
        report = {
            "zgen": _version(),
            "python": python,
            "platform": platform.platform(),
            "packages": packages,
            "devices": _devices(),
            "models": models,
            "caches": {c.name: {"path": str(c.path), "bytes": size, "entries": count} for c, size, count in caches},
        }
        print(json.dumps(report))
        return
    lines = {
        "zgen": [_version()],
        "python": [python],
        "platform": [platform.platform()],
        "packages": [f"{name} {version}" for name, version in packages.items()],
        "devices": _devices(),
        "models": [f"{name}: {where}" for name, where in models.items()],
        "caches": [f"{c.name}: {decimal(size)} in {_count(count, 'entry', 'entries')}, {c.path}" for c, size, count in caches],
    }
    table = Table.grid(padding=(0, 2))
    for key, values in lines.items():
        table.add_row(f"[bold]{key}[/]", escape("\n".join(values)))
    Console().print(table)


@cache_app.command("ls", cls=_Command)
def cache_ls() -> None:
    """Each cache's location and size, and what the weights and contexts caches hold."""
    table = Table("cache", "holds", "size", "entries", "location / entry")
    for cache in cache_dirs():
        entries = _entries(cache.path)
        table.add_row(cache.name, cache.holds, decimal(_size(cache.path)), str(len(entries)), escape(str(cache.path)))
        if cache.name != "xla":  # the XLA cache holds a file per program: too many to list
            for entry in entries:
                table.add_row("", "", decimal(_size(entry)), "", escape(f"  {entry.name}"))
    Console().print(table)


@cache_app.command("clear", cls=_Command)
def cache_clear(
    weights: Annotated[bool, typer.Option("--weights", help="Converted GGUF weights (a model converts again on its next load).")] = False,
    xla: Annotated[bool, typer.Option("--xla", help="Compiled programs (they compile again).")] = False,
    contexts: Annotated[bool, typer.Option("--contexts", help="Saved contexts (gone for good).")] = False,
) -> None:
    """Delete what zgen's caches hold: those the flags name, or all three without a flag (saved
    contexts included)."""
    named = {"weights": weights, "xla": xla, "contexts": contexts}
    for cache in cache_dirs():
        if any(named.values()) and not named[cache.name]:
            continue
        if cache.path in (Path.home(), Path(cache.path.anchor)):  # a misdirected variable must not empty a home
            raise _fail(ConfigError(f"refusing to empty {cache.path}, the {cache.name} cache: give it a directory of its own"))
        entries = _entries(cache.path)
        freed = _size(cache.path)
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        print(f"{cache.name}: removed {_count(len(entries), 'entry', 'entries')}, {decimal(freed)} ({cache.path})")


# -- zgen eagle -------------------------------------------------------------------------------------


@eagle_app.command("train", cls=_Command)
def eagle_train(
    data: Annotated[Path, typer.Option("--data", exists=True, dir_okay=False, readable=True, help="Training text: a .txt file, or .jsonl chats (one {\"messages\": [...]} per line).")],
    out: Annotated[Path, typer.Option("--out", file_okay=False, help="The head's directory; training again into it continues from its last saved step.")],
    model: ModelOption = DEFAULT_MODEL,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Train up to this step.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=3, help="Tokens per sequence at most.")] = 512,
    lr: Annotated[float, typer.Option("--lr", callback=_positive(), help="Peak learning rate (AdamW, warmup then cosine decay).")] = 3e-4,
    self_distill: Annotated[
        int, typer.Option("--self-distill", metavar="N", min=0, help="Train on the model's own greedy continuations of the data's first N prompts (0: on the data itself).")
    ] = 0,
    fused: Annotated[bool, typer.Option("--fused", help="Read a low, a middle and a high layer's features (EAGLE-3) instead of the last layer's.")] = False,
    chain_steps: Annotated[
        int, typer.Option("--chain-steps", min=1, help="Also train on the head's own predicted features over this many chained steps (EAGLE-3's training-time test; 1: off).")
    ] = 1,
    save_every: Annotated[int, typer.Option("--save-every", min=1, help="Save a checkpoint every this many steps.")] = 200,
    dtype: DtypeOption = "float32",
    quiet: QuietOption = False,
) -> None:
    """Train an EAGLE head for a model on its own features; use it with `zgen generate --eagle DIR`."""
    from zgen.speculative.eagle.train import StepReport, TrainConfig, train  # optax loads only for training

    path = _model_path(model)
    try:
        config = TrainConfig(
            steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, self_distill=self_distill, fused=fused, chain_steps=chain_steps,
            save_every=save_every,
        )
        with Phases.on_stderr(enabled=not quiet) as phases:
            loaded = _load(phases, model, path, dtype, None)
        console = stderr_console()
        columns = (TextColumn("Training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn())
        with Progress(*columns, console=console, disable=quiet or not console.is_terminal, redirect_stdout=False) as bar:
            task = bar.add_task("train", total=steps, status="")
            seen: dict[str, float] = {}

            def show(progress: StepReport) -> None:
                if progress.acceptance is not None:
                    seen["acceptance"] = progress.acceptance
                held = f"  held-out acceptance {seen['acceptance']:.1%}" if "acceptance" in seen else ""
                bar.update(task, completed=progress.step, status=f"loss {progress.loss:.4f}{held}")

            report = train(loaded, data, out, config, show)
    except ZgenError as err:
        raise _fail(err) from None
    if not quiet:
        console.print(
            f"{out}: step {report.steps} (from {report.first_step}), {report.tokens} tokens in {report.seconds:.1f} s, "
            f"loss {report.loss:.4f}, held-out acceptance {report.acceptance:.1%} "
            f"(along a chain: {' / '.join(f'{a:.0%}' for a in report.chain_acceptance)})",
            highlight=False, soft_wrap=True,
        )


if __name__ == "__main__":
    app()
