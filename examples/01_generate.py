"""Plain generation with the bundled stories260K model: text in, token ids and text out.

    python examples/01_generate.py

A generator without a proposer decodes plainly: the baseline every speculative run is compared
against.
"""

from __future__ import annotations

from specdec import Generator, SamplingParams
from specdec.cli import bundled_model_path


def main() -> None:
    gen = Generator.from_pretrained(bundled_model_path(), dtype="float32")

    out = gen.generate("Once upon a time", SamplingParams(max_new_tokens=48, temperature=0.0))
    print("prompt token ids:", out.prompt_token_ids)
    print("output token ids:", out.token_ids)
    print("text:", repr(out.text))
    print("finish reason:", out.finish_reason)

    # Token ids work as prompts too, and decode() turns ids back into text.
    ids = gen.encode("The little dog")
    again = gen.generate(ids, SamplingParams(max_new_tokens=16))
    print(f"\n{ids} -> {again.token_ids} = {gen.decode(again.token_ids)!r}")

    # A list in, a list out: one batch. A seed makes sampled output reproducible.
    prompts = ["Lily and Tom", "Mom said"]
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    for prompt, result in zip(prompts, gen.generate(prompts, sampled)):
        print(f"\n{prompt!r} -> {result.text!r}")

    m = gen.metrics
    print(f"\n{m.num_generated_tokens} tokens, {m.tokens_per_second:.0f} tokens/s")


if __name__ == "__main__":
    main()
