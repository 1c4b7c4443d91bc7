"""One artifact against onnxruntime-genai's own builder model of the artifact's source checkpoint (and llama.cpp on
a GGUF source, when llama-cpp-python is installed), timed in alternating rounds; the ratios are the medians'.

The builder is given the same checkpoint the artifact was compiled from (an HF folder, or a GGUF dequantised by
transformers): int4 for an int4 artifact, else fp32 (``--genai`` overrides it). Builder outputs are cached in
``--peer-dir`` (default ``~/.cache/moeforge/peers/<checkpoint>``). Every system gets the same thread count.

Run (from the repository root)::

    python benchmarks/genai_builder.py artifacts/smollm2 --batch 1 --rounds 3 [--save]

It prints a markdown table (``--json``: the whole result) and, with ``--save``, writes
``benchmarks/results/genai_builder_<artifact>_b<B>.json`` (the machine described). The machinery is
``peers.compare_with_genai_builder``, shared with ``genai_compare.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from peers import GENAI_BUILDS, compare_with_genai_builder

from moeforge.cli.bench import write_result
from moeforge.core.errors import MoeforgeError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="artifact directory")
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prefill-len", type=int, default=512, help="prefill prompt tokens")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=None, help="threads per system (default: the usable cores)")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="a second moeforge row at batch 1 with prompt-lookup speculative decoding of K drafts")
    parser.add_argument("--genai", nargs="+", default=None, choices=sorted(GENAI_BUILDS),
                        help="builder precisions (default: int4 for an int4 artifact, else fp32)")
    parser.add_argument("--peer-dir", type=Path, default=None, help="builder outputs (cached)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--save", action="store_true", help="also write benchmarks/results/genai_builder_*.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; 0 on success, 2 with the reason on bad input."""
    args = parse_args(argv)
    try:
        if args.batch < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.rounds < 1 or args.prefill_len < 1:
            raise MoeforgeError("--batch, --prompt-len, --rounds and --prefill-len must be >= 1, --new-tokens >= 2")
        try:
            result = compare_with_genai_builder(args.artifact, batches=[args.batch], rounds=args.rounds,
                                                prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                                prefill_len=args.prefill_len, threads=args.threads, genai=args.genai,
                                                peer_dir=args.peer_dir, log=not args.json,
                                                speculative_tokens=args.speculative_tokens)
        except ValueError as error:  # a source the builder cannot read
            raise MoeforgeError(str(error)) from error
    except MoeforgeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.save:
        write_result(f"benchmarks/results/genai_builder_{args.artifact.resolve().name}_b{args.batch}.json",
                     "bench_compare_genai_builder", result)
    print(json.dumps(result, indent=2) if args.json else result["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
