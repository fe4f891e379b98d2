"""`conveyor generate`: offline generation from prompts on the command line.

Engine flags are the same as `conveyor serve`'s (engine/args.py); sampling flags map onto
`SamplingParams` (`--seed` is the engine's: it seeds sampling, as in vLLM). Each completion is printed after all have finished, with its finish reason.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.engine.args import add_engine_arguments, engine_config_from_args
from conveyor.sampling_params import SamplingParams

DEFAULT_PROMPT = "The three primary colors are"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help=f"a prompt (repeatable; default: {DEFAULT_PROMPT!r})")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    sampling.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_arguments(parser)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; a bad value exits through parser.error naming the flag."""
    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        )
    except ValueError as error:
        flag = "--" + str(error).split(" ", 1)[0].replace("_", "-")
        args.engine_args_parser.error(f"{flag}: {error}")
        raise


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args)
    from conveyor.engine.llm import LLM

    llm = LLM(engine_config=config)
    prompts = args.prompts or [DEFAULT_PROMPT]
    if args.chat:
        template = llm.tokenizer.apply_chat_template  # type: ignore[attr-defined]
        prompts = [template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    results = llm.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        print(f"--- prompt: {prompt!r}")
        print(result.text)
        print(f"--- {len(result.output_token_ids)} tokens, finish_reason={result.finish_reason.value}")
    summary = llm.last_run
    rate = summary.num_generation_tokens / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    print(f"{summary.num_steps} steps, {summary.num_generation_tokens} tokens in {summary.elapsed_s:.2f}s "
          f"({rate:.1f} tok/s)", file=sys.stderr)
    return 0
