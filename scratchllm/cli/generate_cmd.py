"""`scratchllm generate [MODEL] "PROMPT"`: answer one prompt, streaming tokens to the terminal.

Instruct models get their chat template (the prompt becomes the user's message); `--raw`
continues the text as written. The answer goes to stdout as it is produced; timings go to
stderr at the end, so `scratchllm generate ... > answer.txt` keeps only the answer.
"""

import argparse
import sys

from scratchllm.cli import Subparsers
from scratchllm.cli.options import add_speculative_arguments, add_threads_argument, speculative_config
from scratchllm.dtypes import DTYPE_HELP, DTYPES
from scratchllm.errors import ConfigError


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)", description=__doc__)
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="the model, as `scratchllm generate MODEL PROMPT` (same as --model)")
    p.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    p.add_argument("--model", "-m", default=None,
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file or a model folder (default: default)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template: continue the text as is")
    p.add_argument("--system", default=None, help="system message (chat template only)")
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed: the same seed gives the same text")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    add_threads_argument(p)
    p.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    p.add_argument("--quiet", "-q", action="store_true", help="no timing line on stderr")
    add_speculative_arguments(p)
    p.set_defaults(func=run, intermixed_parser=p)


def run(args: argparse.Namespace) -> int:
    from scratchllm.llm import LLM
    from scratchllm.sampling import SamplingParams

    if args.model_arg and args.model and args.model_arg != args.model:
        raise ConfigError(f"two models given: '{args.model_arg}' and --model '{args.model}'")
    model = args.model_arg or args.model or "default"
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(model, threads=args.threads, dtype=args.dtype, speculative_config=speculative_config(args))

    def show(_token_id: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    use_chat = not args.raw and llm.tokenizer.chat_template is not None
    if use_chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        out = llm.chat(messages + [{"role": "user", "content": prompt}], params, on_token=show)
    else:
        out = llm.run(llm.tokenizer.encode(prompt), params, prompt=prompt, on_token=show)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        m = out.metrics.summary() if out.metrics is not None else {}
        decode = f"{m['decode_tok_s']:.1f} tok/s" if m.get("decode_tok_s") else "n/a"
        drafts = f", {m['spec_accepted']} of {m['spec_drafted']} drafted accepted" if m.get("spec_drafted") else ""
        print(f"[{m['prompt_tokens']} prompt tokens, {m['completion_tokens']} generated ({out.finish_reason}); "
              f"load {llm.load_s:.2f} s, prefill {m['prefill_tok_s']:.0f} tok/s, decode {decode}{drafts}"
              f"{'' if use_chat else ', raw prompt'}]", file=sys.stderr)
    return 0
