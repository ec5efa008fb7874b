"""Generate text with a duo-jax model from the command line.

    python infer.py --model smollm2-135m --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file holding the prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    import duo_jax
    from duo_jax.model import greedy_reference
    from duo_jax.tokenizer import require

    try:
        text = args.prompt if args.prompt is not None else open(args.prompt_file).read()
        if args.max_new_tokens <= 0:
            raise duo_jax.DuoJaxError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        model = duo_jax.load(args.model)
        tokenizer = require(model.tokenizer, "a text prompt")
        ids = tokenizer.encode(text)
        start = time.perf_counter()
        new = greedy_reference(model.params, model.config, ids, args.max_new_tokens)
        elapsed = time.perf_counter() - start
    except (duo_jax.DuoJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text + tokenizer.decode(new))
    print(f"\n[{len(ids)} prompt tokens, {len(new)} new tokens, {elapsed:.1f} s, uncached greedy reference]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
