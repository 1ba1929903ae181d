"""Run every graph role of a bundle on fixed inputs; rank 0 saves the (unpadded) outputs.

    python tests/tp_roles.py BUNDLE OUT.safetensors [TOKENS.json]                       # TP 1
    torchrun --nproc-per-node N tests/tp_roles.py BUNDLE OUT.safetensors [TOKENS.json]  # TP N (SPMD)

With TOKENS.json (a list of token ids) the target graphs also run that sequence the way the runtime
does -- prefill of all but the last K+2 tokens, one verify of K+1, one decode -- saving `seq.*` logits and
aux states per position, to compare with a reference model run over the whole sequence.
"""
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_runtime.bundle import Bundle, call_by_name


def chain_inputs(start: torch.Tensor, T: int) -> dict[str, torch.Tensor]:
    """target_verify's tree inputs for a chain of T tokens from `start`."""
    return {"positions": start[:, None] + torch.arange(T), "start": start,
            "tree_mask": torch.ones(T, T, dtype=torch.bool).tril().repeat(start.shape[0], 1, 1)}


def unpad_aux(aux: torch.Tensor, hu: int, hp: int) -> torch.Tensor:
    return torch.cat([c[..., :hu] for c in aux.split(hp, dim=-1)], dim=-1)


def run_roles(bundle: Bundle) -> dict[str, torch.Tensor]:
    m = bundle.manifest
    lay = m.models["target"].layout
    hu, hp = lay["hidden"], lay["padded_hidden"]
    K, S, b = m.num_speculative_tokens, m.prefill_buckets[0], m.batch_buckets[0]
    g = torch.Generator().manual_seed(0)
    V = m.vocab_size
    n = S - 5
    out = {}
    with torch.inference_mode():
        tokens = torch.randint(0, V, (1, S), generator=g)
        slot, last = torch.tensor([0]), torch.tensor([n - 1])
        logits, aux = bundle.graph("target_prefill", S)(tokens, slot, last)
        out["target_prefill.logits"], out["target_prefill.aux"] = logits, unpad_aux(aux, hu, hp)
        nxt = torch.randint(0, V, (1, S), generator=g)
        tok, _, hid = bundle.graph("draft_prefill", S)(aux, nxt, slot, last)
        out["draft_prefill.token"], out["draft_prefill.hidden"] = tok, hid[..., :hu]
        vt = torch.randint(0, V, (b, K + 1), generator=g)
        start = torch.full((b,), n)
        v = call_by_name(bundle.graph("target_verify", b), {"tokens": vt, **chain_inputs(start, K + 1)})
        out["target_verify.logits"], out["target_verify.aux"] = v["logits"], unpad_aux(v["aux"], hu, hp)
        nt = torch.randint(0, V, (b, K + 1), generator=g)
        tok, _, hid = bundle.graph("draft_catchup", b)(v["aux"], nt, start, torch.full((b,), K))
        out["draft_catchup.token"], out["draft_catchup.hidden"] = tok, hid[..., :hu]
        tok = tok[:, 0]
        if K > 1 and m.unroll_draft:  # a chain's draft steps in one call, from the position after the catch-up
            d = call_by_name(bundle.graph("draft_chain", b), {"hidden": hid, "token": tok, "start": start + K + 1})
            out["draft_chain.tokens"] = d["tokens"]
            tok = d["tokens"][:, -1]
        elif K > 1:  # a chain's first draft step, at the position after the catch-up
            p = (start + K + 1)[:, None]
            mask = torch.zeros(b, 1, K - 1, dtype=torch.bool)
            mask[..., 0] = True
            d = call_by_name(bundle.graph("draft_step", b), {"hidden": hid[:, None], "tokens": tok[:, None],
                                                             "positions": p, "slots": p, "start": p[:, 0],
                                                             "tree_mask": mask})
            tok, hid = d["token"][:, 0, 0], d["hidden"][:, 0]
            out["draft_step.token"], out["draft_step.hidden"] = tok, hid[..., :hu]
        logits, _ = bundle.graph("target_decode", b)(tok, start + K + 1)
        out["target_decode.logits"] = logits
    return {k: v.contiguous() for k, v in out.items()}


def run_sequence(bundle: Bundle, tokens: list[int]) -> dict[str, torch.Tensor]:
    """prefill tokens[:n] -> logits at n-1; verify tokens[n:n+K+1] -> logits at n..n+K; decode
    tokens[n+K+1] -> logits at n+K+1. Aux states (unpadded) for every position of the prefill and verify."""
    m = bundle.manifest
    lay = m.models["target"].layout
    hu, hp = lay["hidden"], lay["padded_hidden"]
    K, b = m.num_speculative_tokens, m.batch_buckets[0]
    n = len(tokens) - K - 2
    S = min(s for s in m.prefill_buckets if s >= n)
    with torch.inference_mode():
        prompt = torch.zeros(1, S, dtype=torch.int64)
        prompt[0, :n] = torch.tensor(tokens[:n])
        logits, aux = bundle.graph("target_prefill", S)(prompt, torch.tensor([0]), torch.tensor([n - 1]))
        out = {"seq.prefill.logits": logits[0], "seq.prefill.aux": unpad_aux(aux, hu, hp)[0, :n]}
        vt = torch.zeros(b, K + 1, dtype=torch.int64)
        vt[0] = torch.tensor(tokens[n:n + K + 1])
        v = call_by_name(bundle.graph("target_verify", b), {"tokens": vt, **chain_inputs(torch.full((b,), n), K + 1)})
        out["seq.verify.logits"], out["seq.verify.aux"] = v["logits"][0], unpad_aux(v["aux"], hu, hp)[0]
        dt = torch.full((b,), tokens[n + K + 1])
        logits, _ = bundle.graph("target_decode", b)(dt, torch.full((b,), n + K + 1))
        out["seq.decode.logits"] = logits[0]
    return out


def main():
    bundle_dir, out_path = sys.argv[1], sys.argv[2]
    tokens = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    bundle = Bundle(bundle_dir, rank=rank)
    outs = run_sequence(bundle, tokens) if tokens is not None else {}
    outs |= run_roles(bundle)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in outs.items()}, out_path)
    if world > 1:
        # every rank reaches teardown together, then leaves without tearing gloo down: destroying the group (or
        # letting interpreter exit destroy it) while a peer closes its end still aborts now and then under load
        # ("terminate called without an active exception", SIGABRT after every output was written)
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
