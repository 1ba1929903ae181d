"""eagle3-run BUNDLE --prompt TEXT [--max-tokens N] [--chat] [--speculation auto|always|none] [--json] [--threads N]: one generation
from a bundle, printed with its speed and acceptance (torchrun --nproc-per-node N -m eagle3_runtime.cli for TP)."""
from __future__ import annotations

if __name__ == "__main__":  # (python -m, torchrun -m: the pages set before torch is imported, as the console entry does)
    from eagle3_runtime.launch import use_huge_pages

    use_huge_pages()

import json
import os
import sys

from .adaptive import add_speculation_arg, speculation_mode
from .bundle import BundleError
from .engine import Engine, describe_error
from .errors import ArgumentParser, Eagle3Error, enable_debug, print_cause, whole_number
from .launch import stop_line
from .tokenizer import BundleTokenizer
from .tp import add_threads_arg, open_bundle, set_threads, shutdown, stop_workers
from .trust import add_trust_args


def _prompt_ids(tok: BundleTokenizer, template, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tok.encode(prompt)
    if template is None:
        raise BundleError("--chat: this bundle's tokenizer has no chat template; drop --chat")
    return tok.encode(template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="eagle3-run", description="Generate from an eagle3-build bundle.")
    ap.add_argument("bundle", help="bundle directory (artifacts/<pair name>) or hf://org/repo@rev, file:///dir@rev")
    ap.add_argument("--prompt", required=True, help="prompt text (tokenized as the target's tokenizer does)")
    ap.add_argument("--max-tokens", type=whole_number(1, 1 << 24), default=64)
    ap.add_argument("--chat", action="store_true",
                    help="wrap the prompt as one user message in the bundle's chat template (instruct models)")
    add_speculation_arg(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--debug", action="store_true", help="on an error, also print its traceback with the causes")
    add_threads_arg(ap)
    add_trust_args(ap)
    args = ap.parse_args(argv)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        print(f"error: --prompt is not valid UTF-8 (at character {e.start}); pass UTF-8 text", file=sys.stderr)
        return 2
    if args.debug:
        enable_debug()
    ctx = None
    try:
        set_threads(args.threads)
        mode = speculation_mode(args, os.environ)
        bundle, ctx = open_bundle(args.bundle, args.expect_digest, args.verify_signature, args.trust_remote_code)
        if bundle is None:  # a TP worker rank: the driver has finished
            return 0
        tok, template = bundle.text
        engine = Engine(bundle, tokenizer=tok, speculation=mode)
        if not args.json:
            print("\n".join(engine.speculation_report()), file=sys.stderr)
        try:
            prompt_ids = _prompt_ids(tok, template, args.prompt, args.chat)
            gen = engine.generate(prompt_ids, args.max_tokens)
        finally:
            if template is not None:
                template.close()
            if ctx is not None:
                stop_workers(ctx)
    except Eagle3Error as e:  # the bundle, the prompt, the chat template: one line naming the fix
        print_cause(e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        line, code = stop_line()
        print(line, file=sys.stderr)
        return code
    except Exception as e:  # noqa: BLE001 (a failure of ours: one line, the traceback with --debug)
        print_cause(e)
        print(f"error: generation failed ({describe_error(e)}); --debug prints the traceback", file=sys.stderr)
        return 1
    finally:
        shutdown(ctx)
    text = gen.text
    n = len(gen.token_ids)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_token_ids": gen.prompt_ids, "token_ids": gen.token_ids,
                          "text": text, "finish_reason": gen.finish_reason, "speculative": engine.speculative,
                          "speculation": engine.speculation_report(),
                          "num_speculative_tokens": engine.K, "target_passes": gen.target_passes,
                          "seconds": gen.seconds, "tokens_per_second": n / gen.seconds if gen.seconds else 0.0,
                          "spec_decoding": gen.stats.to_dict()}))
    else:
        print(text)
        print(f"\n[{n} tokens in {gen.seconds:.2f}s, {n / gen.seconds:.1f} tok/s, {gen.target_passes} target passes, "
              f"finish_reason={gen.finish_reason}]", file=sys.stderr)
        if engine.speculative:
            print(gen.stats.format(), file=sys.stderr)
    return 0


if __name__ == "__main__":  # (python -m eagle3_runtime.cli: the console entry point's path, its signal handling too)
    from eagle3_runtime.launch import run as _run

    _run()
