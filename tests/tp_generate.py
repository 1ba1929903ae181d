"""Greedy generation of many prompts through the runtime (eagle3_runtime.tp.open_bundle: torchrun for
TP > 1, the driver rank announcing every graph call and KV move to the workers); rank 0 writes JSON.

    python tests/tp_generate.py BUNDLE PROMPTS.json OUT.json MAX_TOKENS                       # TP 1
    torchrun --nproc-per-node N tests/tp_generate.py BUNDLE PROMPTS.json OUT.json MAX_TOKENS  # TP N

PROMPTS.json is a list of token-id lists; OUT.json gets [{"token_ids", "acceptance_length"}, ...].
"""
import json
import os
import sys
from pathlib import Path

import torch

from eagle3_runtime.engine import Engine
from eagle3_runtime.tp import open_bundle, shutdown, stop_workers


def main():
    bundle_dir, prompts, out, n = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]), int(sys.argv[4])
    bundle, ctx = open_bundle(bundle_dir)
    if bundle is not None:  # the driver (workers return here after the driver stops them)
        eng = Engine(bundle)
        with torch.inference_mode():
            gens = [eng.generate(p, n) for p in prompts]
        out.write_text(json.dumps([{"token_ids": g.token_ids, "acceptance_length": g.stats.mean_acceptance_length}
                                   for g in gens]))
        if ctx is not None:
            stop_workers(ctx)
    shutdown(ctx)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
