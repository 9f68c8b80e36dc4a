"""The ``zgen`` command: generate text or chat with a model."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from zgen.cache.factory import CACHE_KINDS, CacheOption, cache_kind, kv_dtype, prefix_cache
from zgen.cache.formats import KV_DTYPES
from zgen.errors import ZgenError
from zgen.evaluation import perplexity
from zgen.generator import Generator
from zgen.loading.builtin import DEFAULT_MODEL
from zgen.model import DTYPES, load_model
from zgen.runtime.sampling import SamplingConfig

app = typer.Typer(help="LLM text generation in JAX.", no_args_is_help=True, pretty_exceptions_enable=False)
err_console = Console(stderr=True)

ModelOption = Annotated[str, typer.Option("--model", "-m", help="Built-in name, HF model directory or .gguf file.")]
DtypeOption = Annotated[str, typer.Option(help=f"Weight and activation dtype: {', '.join(DTYPES)}.")]
MaxNewOption = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")]
TemperatureOption = Annotated[float, typer.Option(help="0 = greedy.")]
TopKOption = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopPOption = Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")]
MinPOption = Annotated[float, typer.Option(help="Drop tokens below min_p × the top probability (0 = off).")]
RepetitionOption = Annotated[float, typer.Option(help="Penalty on tokens already seen (1 = off).")]
SeedOption = Annotated[int | None, typer.Option(help="Random seed; the same seed gives the same output.")]
StopOption = Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
IgnoreEosOption = Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the model's EOS tokens.")]
KVCacheOption = Annotated[
    str | None,
    typer.Option("--kv-cache", help=f"KV cache kind: {', '.join(CACHE_KINDS)} (default: tensor; paged for fp8/q4/q3)."),
]
KVDtypeOption = Annotated[str | None, typer.Option("--kv-dtype", help=f"KV storage dtype: {', '.join(KV_DTYPES)} (default: the model dtype).")]
PrefixCacheOption = Annotated[
    bool,
    typer.Option(
        "--prefix-cache",
        help="Share prompt prefixes across requests, up to 4096 blocks on the device (makes tensor paged; "
        "tiered always has one, unbounded without this flag).",
    ),
]


def _cache_options(kind: str | None, dtype: str | None, prefix: bool) -> list[CacheOption]:
    options: list[CacheOption] = [] if kind is None else [cache_kind(kind)]
    if dtype is not None:
        options.append(kv_dtype(dtype))
    if prefix:
        options.append(prefix_cache(capacity_blocks=4096))
    return options


def _sampling(
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: int | None,
    stop: list[str] | None,
    ignore_eos: bool,
) -> SamplingConfig:
    return SamplingConfig(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )


def _fail(err: ZgenError) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {type(err).__name__}: {err}")
    return typer.Exit(code=2)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")] = "Once upon a time,",
    model: ModelOption = DEFAULT_MODEL,
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user message through the chat template.")] = False,
    max_new_tokens: MaxNewOption = 256,
    temperature: TemperatureOption = 1.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    min_p: MinPOption = 0.0,
    repetition_penalty: RepetitionOption = 1.0,
    seed: SeedOption = None,
    stop: StopOption = None,
    ignore_eos: IgnoreEosOption = False,
    dtype: DtypeOption = "float32",
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    use_prefix_cache: PrefixCacheOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
) -> None:
    """Generate a continuation of a prompt (streamed to stdout)."""
    try:
        loaded = load_model(model, dtype=dtype)
        sampling = _sampling(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, ignore_eos)
        request = [{"role": "user", "content": prompt}] if chat else prompt
        with Generator(loaded, *_cache_options(kv_cache, kv_dtype_name, use_prefix_cache)) as generator:
            if not as_json:
                for piece in generator.generate_stream(request, sampling):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                return
            start = time.perf_counter()
            result = generator.generate(request, sampling)
            total_s = time.perf_counter() - start
    except ZgenError as err:
        raise _fail(err) from None
    decode_tps = result.usage.completion_tokens / result.timings.decode_s if result.timings.decode_s else 0.0
    print(
        json.dumps(
            {
                "text": result.text,
                "token_ids": result.token_ids,
                "prompt_token_ids": result.prompt_token_ids,
                "logprobs": result.logprobs,
                "finish_reason": result.finish_reason,
                "usage": {
                    "prompt_tokens": result.usage.prompt_tokens,
                    "completion_tokens": result.usage.completion_tokens,
                },
                "timings": {
                    "load_s": loaded.load_timings.read_s + loaded.load_timings.to_device_s,
                    "prefill_s": result.timings.prefill_s,
                    "decode_s": result.timings.decode_s,
                    "total_s": total_s,
                    "decode_tokens_per_s": decode_tps,
                },
            },
            ensure_ascii=False,
        )
    )


@app.command()
def chat(
    model: ModelOption = DEFAULT_MODEL,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    max_new_tokens: MaxNewOption = 512,
    temperature: TemperatureOption = 0.7,
    top_k: TopKOption = 0,
    top_p: TopPOption = 0.95,
    min_p: MinPOption = 0.0,
    repetition_penalty: RepetitionOption = 1.0,
    seed: SeedOption = None,
    dtype: DtypeOption = "float32",
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    use_prefix_cache: PrefixCacheOption = False,
) -> None:
    """Chat interactively; an empty line or end of input quits. The conversation's KV cache is reused."""
    try:
        loaded = load_model(model, dtype=dtype)
        generator = Generator(loaded, *_cache_options(kv_cache, kv_dtype_name, use_prefix_cache))
    except ZgenError as err:
        raise _fail(err) from None
    sampling = _sampling(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, None, False)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    console = Console()
    with generator:
        session = generator.new_session()
        while True:
            try:
                line = console.input("[bold green]you>[/] ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            try:
                result = session.generate(messages, sampling)
            except ZgenError as err:
                err_console.print(f"[bold red]error:[/] {err}")
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": result.text})
            console.print(f"[bold blue]zgen>[/] {result.text}")


eval_app = typer.Typer(help="Evaluate a model.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
def eval_ppl(
    text_file: Annotated[Path, typer.Option("--text-file", help="UTF-8 text to score.")],
    model: ModelOption = DEFAULT_MODEL,
    window: Annotated[int, typer.Option(help="Tokens per window; each window starts from an empty cache.")] = 512,
    chunk: Annotated[int, typer.Option(help="Tokens fed per step within a window (1 = pure decode).")] = 64,
    kv_cache: KVCacheOption = None,
    kv_dtype_name: KVDtypeOption = None,
    dtype: DtypeOption = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Perplexity of a text with the chosen KV cache in the loop (no BOS; every token after a window's first is scored)."""
    try:
        text = text_file.read_text(encoding="utf-8")
    except OSError as err:
        err_console.print(f"[bold red]error:[/] cannot read {text_file}: {err}")
        raise typer.Exit(code=2) from None
    try:
        loaded = load_model(model, dtype=dtype)
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        result = perplexity(loaded, ids, *_cache_options(kv_cache, kv_dtype_name, False), window=window, chunk=chunk)
    except ZgenError as err:
        raise _fail(err) from None
    fields = {"ppl": result.ppl, "nll": result.nll, "tokens_scored": result.tokens_scored, "windows": result.windows}
    if as_json:
        print(json.dumps(fields))
    else:
        Console().print(fields)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
