"""Backend `neuron`, the models it compiles: SPMD NEFFs through NxD's ModelBuilder, the API NxDI builds with.

One `neuronx_distributed.trace.model_builder.ModelBuilder` per model (target, draft):
  * keys = the model's graph roles plus `kv_move` (the KV-row move of continuous batching) and, on
    the target of a bundle that speculates with token trees, `kv_compact` (the accepted path's KV
    slots moved into place after a verify; chains never move KV), one example tuple per bucket. NxD routes a call to its key and bucket by the list of input shapes
    alone, so every key takes the model's `arity` inputs (zero-size int32 placeholders pad the
    shorter roles, as NxDI passes torch.empty(0)) and returns its `n_out` outputs, because NxD packs
    every key's outputs with key #1's packer [confirmed: model_builder.py build_nxd_model; the fixed
    arity is inferred from its torch.jit.trace'd NxDModelExecutor];
  * every key gets a fresh module (`NeuronKey` over its own `DeviceModel`: weight Parameters, a KV-cache
    state Parameter and an int32 rank weight, named alike in every key), built by the key's model
    instance when ModelBuilder loads it, as NxDI's DecoderModelInstance does: NxD shards with key #1's
    module and shares weights and states across keys by name [confirmed: spmd.py, model_builder.py
    shard_checkpoint], and ModelBuilder traces a key with a single bucket with `preserve_parameters=False`
    ("throw away weights if only one bucket is used") [confirmed: model_builder.py _generate_hlo], so no
    Parameter object may be shared between keys. The cache is updated functionally
    and returned as the output aliased to the state, `input_output_aliases={kv: n_out}` [confirmed:
    BaseModelInstance, NxDI DecoderModelInstance.get]; the rank is `rank_util.rank` ([r] on rank r,
    NxD's SPMDRank pattern) [confirmed: parallel_layers/layers.py SPMDRank];
  * collectives go through NxD's parallel_layers.mappings (xm.all_reduce / all_gather over the TP
    mesh) [confirmed: mappings.py, comm.py];
  * token, position and index inputs are int32, as NxDI's input_generator makes them [confirmed];
  * `trace(initialize_model_weights=False)` -> torch.jit.save to graphs/<model>.pt [confirmed: NxDI
    application_base.py]; the NEFFs from the compiler workdir (<key>/_tp0_bk<i>/graph.neff) are
    kept as graphs/<graph>.neff and hashed in the manifest.
eagle3-build shards the weights itself, into weights/<model>/tp<r>_sharded_checkpoint.safetensors keyed
by the traced parameter names plus `rank_util.rank` — what `nxd_model.initialize` takes [confirmed:
NxDI load_weights]. Compiler flags are chosen per role (NxDI's context-encoding / token-generation
defaults, then the recipe's `compiler_args` and `role_compiler_args`). ModelBuilder lowers on CPU
(`generate_hlo(..., cpu_backend=True)`) [confirmed], so a CPU-only build host needs only `--target` in
the flags (always there) and NEURON_PLATFORM_TARGET_OVERRIDE [inferred]. `NEURON_CC_FLAGS` is refused
unless `backend_options.fold_env_flags: true` folds it into the recorded flags.
Facts and their sources: docs/neuron-sdk-facts.md. Verified here through a stand-in SDK that enforces
that contract (tests/neuron_standin.py); the NEFF compile itself runs only where the SDK is installed.
"""
from __future__ import annotations

import copy
import glob
import math
import mmap
import os
import shlex
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from eagle3_runtime.backends import neuron_sdk
from eagle3_runtime.backends.facts import NeuronFacts
from eagle3_runtime.backends.neuron import (KV_COMPACT, KV_MOVE, PLACEHOLDER_DTYPE, compact_pairs,
                                            kv_compact_inputs, kv_move_inputs, nxd_key, routing_signature)
from eagle3_runtime.graph_contract import PREFILL_ROLES, ROLES
from eagle3_runtime.manifest import torch_dtype

from ...errors import UserError
from ...graphs import GraphSpec, role_module
from ...models.llama import KVCache
from .releases import integer_flags
from .sdk import NEURON_INSTALL_HINT, NEURON_SDK, check_sdk

NAME = NeuronFacts.name
SUFFIX = ".pt"
INDEX_DTYPE = torch_dtype(NeuronFacts.index_dtype)  # token / position / index inputs

COMMON_ARGS = ["--target", "trn2", "--lnc", "2", "--model-type", "transformer", "--auto-cast", "none"]
# NxDI's per-model defaults (neuronx-distributed-inference models/model_wrapper.py, docs/neuron-sdk-facts.md §6):
# context encoding (our prefill graphs) -O1 with the modular flow; token generation and fused speculation
# (decode, verify, draft steps and catch-up) -O2 with pipeline tiling factor 1
ROLE_ARGS = {
    "context": ["-O1", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 "
                       "--vectorize-strided-dma",
                "--internal-hlo2tensorizer-options=--modular-flow-mac-threshold=10 --verify-hlo=true"],
    "token": ["-O2", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=1 "
                     "--vectorize-strided-dma",
              "--internal-hlo2tensorizer-options=--verify-hlo=true"],
}


def role_kind(role: str) -> str:
    return "context" if role in PREFILL_ROLES else "token"  # (kv_move, kv_compact: token)


# ------------------------------------------------------------------ flags

def _flag_map(args: list[str]) -> list[tuple[str, str | None]]:
    """['--target','trn2','-O1','--lnc=2'] -> [('--target','trn2'), ('-O1', None), ('--lnc','2')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if "=" in a and a.startswith("--"):
            k, v = a.split("=", 1)
            out.append((k, v))
        elif a.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            out.append((a, args[i + 1]))
            i += 1
        else:
            out.append((a, None))
        i += 1
    return out


def _args(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def compiler_args(backend_options: dict, role: str, environ: dict | None = None, neuronx_cc: str | None = None
                  ) -> list[str]:
    """One graph's neuronx-cc flags: NxDI's defaults for its role, the integer flags of this compiler
    version (`neuronx_cc`; releases.integer_flags), then the recipe's `compiler_args` (every role), then
    `role_compiler_args[role]`; a flag replaces the one of the same name, any -O level the other.
    NEURON_CC_FLAGS is never applied silently."""
    environ = os.environ if environ is None else environ
    per_role = backend_options.get("role_compiler_args") or {}
    unknown = sorted(set(per_role) - set(ROLES) - {KV_MOVE, KV_COMPACT})
    if unknown:
        raise UserError(f"backend_options.role_compiler_args: unknown role(s) {', '.join(unknown)}; the roles are "
                        f"{', '.join([*ROLES, KV_MOVE, KV_COMPACT])}")
    env_flags = shlex.split(environ.get("NEURON_CC_FLAGS", ""))
    if env_flags and not backend_options.get("fold_env_flags", False):
        raise UserError(f"NEURON_CC_FLAGS is set ({' '.join(env_flags)!r}) and would change the compiled graphs "
                        "without being recorded; unset it, or put the flags under backend_options.compiler_args, "
                        "or set backend_options.fold_env_flags: true to record them in the manifest")
    merged: dict[str, str | None] = {}
    layers = (COMMON_ARGS + ROLE_ARGS[role_kind(role)] + (integer_flags(neuronx_cc) if neuronx_cc else []),
              _args(backend_options.get("compiler_args")),
              _args(per_role.get(role)), env_flags)
    for k, v in (kv for layer in layers for kv in _flag_map(layer)):
        if k.startswith("-O") and not k.startswith("--"):
            merged = {kk: vv for kk, vv in merged.items() if not (kk.startswith("-O") and not kk.startswith("--"))}
        merged[k] = v
    out = []
    for k, v in merged.items():
        if v is None:
            out.append(k)
        elif " " in v or v.startswith("-"):  # one argument: the value holds spaces or looks like a flag
            out.append(f"{k}={v}")
        else:
            out += [k, v]
    return out


def flag_value(args: list[str], name: str) -> str | None:
    return dict(_flag_map(args)).get(name)


def neuronx_cc_command(name: str, args: list[str]) -> str:
    """The neuronx-cc invocation for one graph's HLO (as the plan prints it; ModelBuilder.trace adds
    --logfile / --verbose and, for the priority bucket, --enable-internal-neff-wrapper)."""
    return shlex.join(["neuronx-cc", "compile", "--framework", "XLA", f"{name}.hlo.pb", "--output", f"{name}.neff",
                       *args])


# ------------------------------------------------------------------ SDK

def neuron_devices() -> list[str]:
    """This host's Neuron devices (none on a CPU-only build host)."""
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def sdk_versions() -> dict[str, str]:
    """pip name -> installed version of each Neuron SDK package (and NxD Inference where installed), from
    the distributions' metadata; UserError naming what is missing, a placeholder, or fails to import."""
    check_sdk()
    for mod, dist in NEURON_SDK.items():
        why = neuron_sdk.import_failure(mod)
        if why:
            raise UserError(f"backend neuron needs {dist}, which is installed but broken: `import {mod}` raised {why}; "
                            f"reinstall it, and the Neuron runtime libraries it loads (aws-neuronx-runtime-lib for "
                            f"libnrt): {NEURON_INSTALL_HINT}")
    return neuron_sdk.installed_versions()




# ------------------------------------------------------------------ the neuron variant of the model seam

WEIGHT_PREFIX = "model."  # a weight's name in the traced module and in the NxD checkpoint: model.<canonical>
RANK_WEIGHT = "rank_util.rank"  # int32 [1], holds r on rank r (NxDI: state_dict["rank_util.rank"] = arange(tp))
STATE_NAME = "kv"
# ModelBuilder optimises the weight layout for the priority key's HLO and transforms only the weights that HLO
# reads; a weight it does not read keeps its checkpoint layout in every graph. So the priority key is a
# token-generation key that reads every weight (as NxDI's token generation does): the target's verify, the
# draft's catch-up (its step never reads fc or the fc norm). `priority_key` checks the rule on the model.
PRIORITY_ROLES = {"target": ("target_verify", "target_decode"),
                  "draft": ("draft_catchup", "draft_chain", "draft_step")}


def spec_key(spec) -> str:
    """The ModelBuilder key a graph spec is traced under (eagle3_runtime.backends.neuron.nxd_key)."""
    return nxd_key(spec.role, spec.variant, spec.context)


def key_role(key: str) -> str:
    return key.partition(".")[0]


def shard_file(rank: int) -> str:
    """NxD's per-rank checkpoint name (model_builder.py shard_weights_with_cache)."""
    return f"tp{rank}_sharded_checkpoint.safetensors"


def weight_key(name: str) -> str:
    return WEIGHT_PREFIX + name


def rank_weights(rank: int) -> dict[str, torch.Tensor]:
    return {RANK_WEIGHT: torch.tensor([rank], dtype=torch.int32)}


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """Integer weights (d2t) are int32 on Neuron; float weights keep the bundle dtype."""
    return dtype if dtype.is_floating_point else INDEX_DTYPE


@dataclass
class ModelGraphs:
    """What one ModelBuilder compiles: a model's graphs (role, bucket, step inputs after the rank)."""

    name: str  # target | draft
    model: nn.Module  # rank-local, on the meta device
    weights: dict[str, tuple[list[int], torch.dtype]]  # every tensor the graphs read: per-rank shape, dtype
    state: tuple[list[int], torch.dtype]  # the KV cache
    graphs: list[tuple[GraphSpec, list[tuple[str, list[int], torch.dtype]]]]
    n_out: int  # outputs of every key (the most any role returns)

    @property
    def arity(self) -> int:
        return max(len(inputs) for _, inputs in self.graphs)

    @property
    def compact_pairs(self) -> int | None:
        """The target's kv_compact pairs where any batch bucket speculates with a token tree (T of the
        deepest shape); None: no kv_compact key (the draft, or chains only)."""
        return compact_pairs(spec.shape for spec, _ in self.graphs) if self.name == "target" else None

    def keys(self) -> list[str]:
        return (list(dict.fromkeys(spec_key(spec) for spec, _ in self.graphs)) + [KV_MOVE]
                + ([KV_COMPACT] if self.compact_pairs else []))

    def key_spec(self, key: str) -> tuple[GraphSpec | None, int]:
        """A key's graph spec (its first bucket's; None for kv_move / kv_compact) and its role's input count."""
        if key in (KV_MOVE, KV_COMPACT):
            return None, 1
        spec, inputs = next((sp, ins) for sp, ins in self.graphs if spec_key(sp) == key)
        return spec, len(inputs)

    def examples(self, key: str) -> list[tuple[torch.Tensor, ...]]:
        """One example tuple per bucket of `key`, padded to the model's arity."""
        if key == KV_MOVE:
            return [kv_move_inputs(0, 0, self.arity)]
        if key == KV_COMPACT:
            return [kv_compact_inputs(0, [], [], self.compact_pairs, self.arity)]
        out = []
        for spec, inputs in self.graphs:
            if spec_key(spec) == key:
                xs = [torch.zeros(shape, dtype=dtype) for _, shape, dtype in inputs]
                out.append(tuple(xs + [torch.zeros(0, dtype=PLACEHOLDER_DTYPE)] * (self.arity - len(xs))))
        return out

    def check_routing(self) -> None:
        """NxD routes by input shapes only, and a second bucket with the same shapes silently replaces the
        first: refuse that here, naming both graphs."""
        if any(s.context is not None for s, _ in self.graphs):
            raise UserError("backend neuron: buckets.context is not available yet: a context bucket's graphs take "
                            "the same inputs as the whole-cache ones, and NxD routes a call by input shapes alone "
                            "(NxDI's token-generation buckets differ in their attention-mask input); remove "
                            "buckets.context from the recipe for this backend")
        seen: dict[str, str] = {}
        for key in self.keys():
            topks = {s.shape.topk for s, _ in self.graphs if spec_key(s) == key}
            if len(topks) > 1:
                raise UserError(f"backend neuron: the {key} graphs of the {self.name} need one topk for every batch "
                                f"bucket (one NxD key traces one module), got {sorted(topks)}; use the same "
                                "speculation.tree.topk in every speculation.per_batch_bucket entry")
            names = [s.name for s, _ in self.graphs if spec_key(s) == key] or [key]
            for name, example in zip(names, self.examples(key)):
                sig = routing_signature(example)
                if sig in seen:
                    raise UserError(f"backend neuron: graphs {seen[sig]} and {name} of the {self.name} take inputs of "
                                    f"the same shapes {sig}, and NxD routes a call by input shapes alone; choose "
                                    "buckets.prefill values other than num_speculative_tokens + 1, and speculation "
                                    "shapes of one batch bucket (speculation.menu) with different node counts")
                seen[sig] = name


class RankWeight(nn.Module):
    """The per-rank int32 weight that tells an SPMD graph its rank (NxD's SPMDRank: every input is the
    same on every rank, and any Python-level rank is 0 while tracing)."""

    def __init__(self, rank: torch.Tensor):
        super().__init__()
        self.rank = nn.Parameter(rank, requires_grad=False)


class NxDCollectives:
    """Comm ops for Neuron: NxD's parallel-region functions, which reduce and gather with
    xm.all_reduce / xm.all_gather over the TP mesh replica groups."""

    def __init__(self):
        from neuronx_distributed.parallel_layers import mappings

        self.mappings = mappings

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.mappings.reduce_from_tensor_model_parallel_region(x)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return self.mappings.gather_from_tensor_model_parallel_region(x)


def untouched_zeros(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor that costs no memory until written: a private anonymous mapping, whose pages the kernel
    backs on the first write (a read sees its shared zero page). What NxD's own layers get from torch.empty
    under set_aot_mode(True) (parallel_layers/layers.py), with defined values: a stand-in that runs the key,
    and the aliasing check's torch.equal on the state, see zeros instead of whatever was in the heap."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class DeviceModel:
    """One key's tensors, named as in every other key of the builder: the weights (Parameters holding
    untouched zeros: the real ones are bound by `nxd_model.initialize`), the KV-cache state and the rank
    weight. `device="meta"` (and `comm`, collectives that need no SDK): shapes only, for `weights_read`."""

    def __init__(self, mg: ModelGraphs, device: str = "cpu", comm=None):
        def tensor(shape, dtype):
            return torch.empty(shape, dtype=dtype, device="meta") if device == "meta" else untouched_zeros(shape, dtype)

        model = copy.deepcopy(mg.model)
        for name, (shape, dtype) in mg.weights.items():
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner)
            mod._buffers.pop(leaf, None)  # a persistent buffer (d2t) is a weight like any other
            mod._parameters[leaf] = nn.Parameter(tensor(shape, dtype), requires_grad=False)
        if device == "meta":  # (non-weight buffers, RoPE's inv_freq, are real even in a meta-built model)
            for mod in model.modules():
                mod._buffers.update({n: b.to("meta") for n, b in mod._buffers.items() if b is not None})
        model.comm.ops = comm or NxDCollectives()
        self.model = model
        self.kv = nn.Parameter(tensor(mg.state[0], mg.state[1]), requires_grad=False)
        self.rank_util = RankWeight(tensor([1], torch.int32))


class NeuronKey(nn.Module):
    """One ModelBuilder key: `role` over its own weights, state and rank weight (`tensors`, a DeviceModel);
    returns the role's outputs, zeros[1] up to n_out, then the new KV cache (aliased to the state)."""

    def __init__(self, role: str, tensors: DeviceModel, n_role_inputs: int, n_out: int,
                 spec: GraphSpec | None = None):
        super().__init__()
        self.model, self.kv, self.rank_util = tensors.model, tensors.kv, tensors.rank_util
        self.role, self.n_role_inputs, self.n_out = role, n_role_inputs, n_out
        # kept out of the module tree (a plain attribute): its parameters are the model's, named model.*
        object.__setattr__(self, "_role_module", None if role in (KV_MOVE, KV_COMPACT) else role_module(spec, tensors.model))

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        cache = KVCache(self.kv, functional=True)
        if self.role == KV_MOVE:  # cache row src_dst[0] -> row src_dst[1]
            src_dst = inputs[0]
            cache.kv = torch.ops.aten.index_put(self.kv, [None, None, src_dst[1:]], self.kv[:, :, src_dst[:1]])
            outs: tuple = ()
        elif self.role == KV_COMPACT:  # row r: slots src[i] -> dst[i], every source read before any write
            pairs = (inputs[0].shape[0] - 1) // 2
            row, src, dst = inputs[0][:1].expand(pairs), inputs[0][1:1 + pairs], inputs[0][1 + pairs:]
            moved = torch.ops.aten.index.Tensor(self.kv, [None, None, row, None, src])  # [pairs, L, 2, Hkv, d]
            cache.kv = torch.ops.aten.index_put(self.kv, [None, None, row, None, dst], moved)
            outs = ()
        else:
            outs = tuple(self._role_module(cache, self.rank_util.rank, *inputs[:self.n_role_inputs]))
        fill = tuple(torch.zeros(1, dtype=torch.int32, device=self.kv.device) for _ in range(self.n_out - len(outs)))
        return (*outs, *fill, cache.kv)


class Key3(NeuronKey):
    def forward(self, input0, input1, input2):
        return self.run((input0, input1, input2))


class Key4(NeuronKey):
    def forward(self, input0, input1, input2, input3):
        return self.run((input0, input1, input2, input3))


class Key5(NeuronKey):
    def forward(self, input0, input1, input2, input3, input4):
        return self.run((input0, input1, input2, input3, input4))


class Key6(NeuronKey):
    def forward(self, input0, input1, input2, input3, input4, input5):
        return self.run((input0, input1, input2, input3, input4, input5))


KEY_CLASSES = {3: Key3, 4: Key4, 5: Key5, 6: Key6}  # by arity (no *args: NxD's tracing takes explicit parameters)


def key_module(mg: ModelGraphs, key: str, device: str = "cpu", comm=None) -> NeuronKey:
    """A fresh module for one key: its own DeviceModel (nothing shared with another key's)."""
    spec, n_inputs = mg.key_spec(key)
    return KEY_CLASSES[mg.arity](key_role(key), DeviceModel(mg, device, comm), n_inputs, mg.n_out, spec)


class ShapeCollectives:
    """Collectives with the right output shapes and no SDK (a rank's own values): for meta-device runs."""

    def __init__(self, tp: int):
        self.tp = tp

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.tp, dim=-1)


class _ReadRecorder(TorchFunctionMode):
    """The identities of every tensor a torch function or tensor method is given."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def _note(self, x) -> None:
        if isinstance(x, torch.Tensor):
            self.seen.add(id(x))
        elif isinstance(x, (list, tuple)):
            for y in x:
                self._note(y)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self._note(list(args) + list((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def weights_read(mg: ModelGraphs, key: str, tp: int) -> set[str]:
    """The model weights one key's graph reads: its first bucket run on the meta device (no compute, no
    memory), every op's tensor arguments recorded by identity."""
    module = key_module(mg, key, device="meta", comm=ShapeCollectives(tp))
    example = tuple(x.to("meta") for x in mg.examples(key)[0])
    named = {id(p): n.removeprefix("model.") for n, p in module.model.named_parameters()}
    with torch.no_grad(), _ReadRecorder() as rec:
        module(*example)
    return {named[i] for i in rec.seen if i in named}


def priority_key(mg: ModelGraphs, tp: int) -> str:
    """The key ModelBuilder optimises the weight layout for: the first of the model's PRIORITY_ROLES that reads
    every weight. None doing so is refused: ModelBuilder would leave the unread weights in their checkpoint
    layout in every graph (model_builder.py _mark_weight_in_priority_hlo / _add_layout_optimization...)."""
    keys, want, tried = mg.keys(), set(mg.weights), []
    for role in PRIORITY_ROLES[mg.name]:
        if role in keys:
            unread = sorted(want - weights_read(mg, role, tp))
            if not unread:
                return role
            tried.append(f"{role} does not read {', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''}")
    raise UserError(f"backend neuron: no key of the {mg.name} reads every weight ({'; '.join(tried)}), and "
                    "ModelBuilder optimises the weight layout of the priority key's weights only; this is a bug in "
                    "eagle3-build's graphs: report it with the recipe")


def key_instance(base, make_module, n_out: int):
    """The model instance ModelBuilder loads a key from (`base`: NxD's BaseModelInstance): a fresh module on
    every `load_module`; `get` (once per bucket) aliases the module's KV state to output `n_out` in a NEW dict
    each time. torch-neuronx's generate_hlo moves the module to the XLA device and back, which replaces every
    Parameter object, so a dict made for an earlier bucket names Parameters the module no longer has (NxDI
    DecoderModelInstance.get, models/model_wrapper.py: "we have to init an input_output_aliases map for each
    buckets, otherwise it will fail the aliasing setup when generating HLO")."""

    class KeyInstance(base):
        def __init__(self):
            super().__init__(make_module, input_output_aliases={})

        def load_module(self):
            self.module = self.module_cls()

        def get(self, bucket_rank, **kwargs):
            return self.module, {self.module.kv: n_out}

    return KeyInstance()


def _no_checkpoint():
    raise RuntimeError("eagle3-build shards the weights itself (weights/<model>/tp<r>_sharded_checkpoint.safetensors); "
                       "ModelBuilder's checkpoint_loader is never used")
