"""Host time to keep a generation's text as it grows, one token at a time, as the server does for every streamed
request and the scheduler for every request with stop strings: decoding all the tokens every step (what they
did before `duo_jax.tokenizer.TextStream`) against the stream. The tokens are real prose (the Paul Graham
essays) through the model's tokenizer; a row is one generation of that many tokens, and the ratio is the
whole decode's time over the stream's.

    python benchmarks/detokenize.py                          # SmolLM2's tokenizer, 1k / 4k / 16k tokens
"""

from __future__ import annotations

import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "detokenize")
    p.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="generated tokens")
    args = p.parse_args(argv)

    import duo_jax
    from duo_jax.tokenizer import TextStream, require

    model = duo_jax.load(args.model)
    tokenizer = require(model.tokenizer, "this benchmark")
    ids = common.text_prompt(model, max(args.lengths))
    rows, data = [], []
    for n in args.lengths:
        t = time.perf_counter()
        for i in range(1, n + 1):
            whole = tokenizer.decode(ids[:i])
        whole_s = time.perf_counter() - t
        t = time.perf_counter()
        stream = TextStream(tokenizer.decode)
        for i in range(n):
            text = stream.extend(ids[i : i + 1])
        stream_s = time.perf_counter() - t
        if text != whole:
            raise AssertionError(f"the stream's text differs from the whole decode at {n} tokens")
        data.append(dict(tokens=n, whole_decode_s=whole_s, stream_s=stream_s))
        rows.append(
            [
                n,
                f"{whole_s:.3f}",
                f"{whole_s / n * 1e3:.3f}",
                f"{stream_s:.4f}",
                f"{stream_s / n * 1e3:.4f}",
                f"{common.ratio(whole_s, stream_s):.0f}x",
            ]
        )
    common.write_result(
        args.out,
        "detokenize",
        title=f"The text of a growing generation, {args.model}'s tokenizer",
        headers=["tokens", "whole decode s", "per token ms", "stream s", "per token ms", "whole / stream"],
        rows=rows,
        data=dict(model=args.model, runs=data),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))
