"""Lower a torch module to HLO with torch-xla (CPU PJRT) and check what neuronx-cc would receive.

Dev tool, NOT part of the product: runs only in the neuron-stack venv (.venv-neuron-stack, torch 2.9 +
torch-xla 2.9, CPU) and is never imported by eagle3_build / eagle3_runtime.

    PJRT_DEVICE=CPU .venv-neuron-stack/bin/python tools/hlo_check.py            # self-test, prints JSON
    PYTHONPATH=/work/main:/work/main/tools .venv-neuron-stack/bin/python -c "import hlo_check; ..."

What was measured with torch 2.9.0 / torch-xla 2.9.0 on CPU (one PJRT device, real world size 1):

* Collectives. `xm.all_reduce` returns its input unchanged when `torch_xla.runtime.world_size() == 1`
  (torch_xla/core/xla_model.py: `if runtime.world_size() == 1 and not XLA_ALWAYS_ALLREDUCE`), so
  without help NO all-reduce reaches the HLO. Patching `torch_xla.runtime.world_size` to return tp
  (what NxD's ModelBuilder does with unittest.mock) is enough: xla_model.py looks the function up on
  the module at call time, and `xr` *is* that module, so patching `xr.world_size` is the same patch.
  `xm.xrt_world_size` no longer exists in 2.9 (patching it raises AttributeError). The env var
  XLA_ALWAYS_ALLREDUCE=1 also keeps the all-reduce. `xm.all_gather(..., groups=..., pin_layout=False)`
  is never elided: its shard count comes from len(groups[0]), not from the world size.
  The list form `xm.all_reduce(SUM, [x], groups=...)` (what NxD's comm.py calls) is IN PLACE on x
  (`_xla_all_reduce_inplace`) and lowers to a tuple all-reduce `(T, f32[]) all-reduce(x, token)`:
  the extra f32[] operand is torch-xla's collective-ordering token, an extra f32[] ENTRY parameter.
  pin_layout defaults to True there, so it carries `constrain_layout=true`.
* Extra scalar parameters. torch-xla turns Python scalars other than 0/1 into scalar device data,
  i.e. extra ENTRY parameters (e.g. an s32[] holding a dim size for index_put's negative-index wrap,
  an f32[] for `x * 2`); the token above is another. `lower_detailed()` labels every ENTRY parameter
  (module parameter/buffer name, `input[i]`, or `scalar/token`) via
  `_get_tensors_xla_device_data_node`, whose order is the HLO parameter order.
* Aliasing. `_get_xla_tensors_hlo` / `_get_xla_tensors_text` / `_get_xla_tensors_hlo_proto` and
  XLA_SAVE_TENSORS_FILE (+XLA_SAVE_TENSORS_FMT=hlo) never show aliasing; XLA_IR_DEBUG/XLA_HLO_DEBUG
  only add source locations (`metadata={...}`). Aliasing appears only when the graph is really
  synced after an in-place update of a device-data tensor (`param.copy_(new)`, then mark_step /
  `_xla_sync_multi`), and only in XLA's own dump (XLA_FLAGS=--xla_dump_to=DIR, which must be set
  before the PJRT client starts, i.e. before the first device use):
  `*.SyncTensorsGraph.N.before_optimizations.txt` has `buffer_donor={ (P, {}) }` and
  `*.cpu_after_optimizations.txt` has `input_output_alias={ {O}: (P, {}, may-alias) }`.
  `_xla_warm_up_cache` (compile, no run) does not donate, so it shows neither.
  The CPU runtime cannot run a bf16 all-reduce (`ValueError: AllReduce for datatype 'bf16' is not
  supported`), but that is raised after both dumps are written. torch_neuronx instead writes the
  alias into the HloModuleProto itself; `lower()` does the equivalent in text: it adds
  `input_output_alias={ {O}: (P, {}, must-alias) }` to the HloModule header, with P found from the
  state parameter's tensor id, and `lower_detailed()` cross-checks it against XLA's own dump.
* Collective token leak. Each collective chains torch-xla's per-device token (it is even added into
  the all-gather's input); only torch_xla.sync()/mark_step resets it, not `_xla_sync_multi` nor a
  sync that raised. Tracing a second graph in the same process then drags the first graph's
  all-reduce into the second HLO. `lower_detailed()` resets the token before and after each graph.
* `module.to(xla_device)` REPLACES the Parameter objects (XLA and CPU tensors are not shallow-copy
  compatible), so `aliases` keyed by the caller's Parameters are resolved to names before the move.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import re
import shutil
import sys
import tempfile

# --- XLA's own HLO dump (the only place aliasing is visible); must precede the PJRT client --------
os.environ.setdefault("PJRT_DEVICE", "CPU")
_DUMP_DIR: str | None = None
_m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
if _m:
    _DUMP_DIR = _m.group(1)
elif os.environ.get("HLO_CHECK_XLA_DUMP", "1") != "0" and "torch_xla" not in sys.modules:
    _DUMP_DIR = tempfile.mkdtemp(prefix="hlo_check_xla_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP_DIR}"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph").strip()
    atexit.register(shutil.rmtree, _DUMP_DIR, True)

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

_X = torch_xla._XLAC


# --- world size / NxD mappings: the builder's own (the NEFF generation lowers with them) ------------
from eagle3_build.backends.neuron.xla_internals import XlaCollectives as NxdMappingsShim  # noqa: E402
from eagle3_build.backends.neuron.xla_internals import reset_token as _reset_collective_token  # noqa: E402
from eagle3_build.backends.neuron.xla_internals import tp_world  # noqa: E402


def nxd_mappings_shim(tp: int) -> NxdMappingsShim:
    return NxdMappingsShim(tp)


# --- lowering -------------------------------------------------------------------------------------
def _state_names(module: torch.nn.Module, aliases: dict) -> dict[str, int]:
    names = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), n)
    out = {}
    for t, idx in aliases.items():
        if id(t) not in names:
            raise ValueError(f"alias key {tuple(t.shape)} {t.dtype} is not a parameter/buffer of the module")
        out[names[id(t)]] = int(idx)
    return out


def _get_state(module: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def _dump_files() -> set[str]:
    return set(glob.glob(os.path.join(_DUMP_DIR, "*"))) if _DUMP_DIR else set()


def _header_attr(text: str, key: str) -> str | None:
    first = text.split("\n", 1)[0]
    m = re.search(key + r"=\{(.*?)\}\s*(?:,\s*[a-z_]+=|$)", first)
    return m.group(1).strip() if m else None


def lower_detailed(module: torch.nn.Module, example_inputs: tuple, aliases: dict | None, tp: int, *,
                   xla_alias_evidence: bool = True) -> dict:
    """Trace `module(*example_inputs)` on the XLA device with the world size patched to `tp`.

    Returns {"hlo": HLO text of the outputs with the state aliases added to the header,
    "hlo_raw": `_get_xla_tensors_hlo` as is, "ir_text": `_get_xla_tensors_text`, "parameters": the
    ENTRY parameters with what each one is, "aliases": {output index: parameter number},
    "xla_evidence": what XLA's own dump says after an in-place update + sync (or why not)}."""
    aliases = aliases or {}
    alias_names = _state_names(module, aliases)
    dev = torch_xla.device()
    _reset_collective_token()
    module = module.to(dev)
    inputs = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in example_inputs)
    with torch.no_grad(), tp_world(tp):
        outs = module(*inputs)
    single = isinstance(outs, torch.Tensor)
    outs = [outs] if single else list(outs)
    hlo_raw = _X._get_xla_tensors_hlo(outs)
    ir_text = _X._get_xla_tensors_text(outs)

    # which torch tensor each ENTRY parameter is
    ids, values = _X._get_tensors_xla_device_data_node(outs)
    tid = _X._xla_get_tensor_id
    role = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        role.setdefault(tid(t), f"state:{n}")
    for i, a in enumerate(inputs):
        if isinstance(a, torch.Tensor):
            role.setdefault(tid(a), f"input[{i}]")
    params = [{"number": k, "role": role.get(i, "scalar/token (torch-xla device data)"),
               "dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
              for k, (i, v) in enumerate(zip(ids, values))]
    alias_map: dict[int, int] = {}
    for name, out_idx in alias_names.items():
        t = _get_state(module, name)
        if tid(t) not in ids:
            raise ValueError(f"state {name} is aliased to output {out_idx} but the graph never reads it")
        if not (0 <= out_idx < len(outs)):
            raise ValueError(f"state {name}: output index {out_idx} out of range ({len(outs)} outputs)")
        alias_map[out_idx] = ids.index(tid(t))
    hlo = hlo_raw
    if alias_map:
        entries = ", ".join(f"{{{o}}}: ({p}, {{}}, must-alias)" for o, p in sorted(alias_map.items()))
        first, rest = hlo_raw.split("\n", 1)
        first = re.sub(r"^(HloModule [^,\s]+)", rf"\1, input_output_alias={{ {entries} }}", first)
        hlo = first + "\n" + rest

    evidence: dict = {"attempted": False}
    if xla_alias_evidence and alias_names:
        evidence = _xla_alias_evidence(module, outs, alias_names)
        if evidence.get("sync_graph_hlo"):  # same ENTRY parameters, so the donor numbers are comparable
            sig = lambda h: [(p["dtype"], p["shape"]) for p in check(h, tp=tp)["parameters"]]  # noqa: E731
            evidence["entry_layout_matches_lowered"] = sig(evidence["sync_graph_hlo"]) == sig(hlo_raw)
    return {"hlo": hlo, "hlo_raw": hlo_raw, "ir_text": ir_text, "parameters": params,
            "aliases": {str(o): p for o, p in sorted(alias_map.items())}, "xla_evidence": evidence}


def _xla_alias_evidence(module, outs, alias_names) -> dict:
    """Copy each aliased output into its state tensor and sync; read XLA's dump of that graph."""
    ev: dict = {"attempted": True, "dump_dir_active": bool(_DUMP_DIR)}
    if not _DUMP_DIR:
        ev["why_not"] = "no --xla_dump_to (XLA_FLAGS must be set before the PJRT client starts)"
        return ev
    before = _dump_files()
    sync = list(outs)
    with torch.no_grad():
        for name, out_idx in alias_names.items():
            t = _get_state(module, name)
            t.copy_(outs[out_idx])
            sync[out_idx] = t
    try:
        _X._xla_sync_multi(sync, [], True, True)
        ev["run"] = "ok"
    except Exception as e:  # compile is done (and dumped) before e.g. the CPU bf16 all-reduce error
        ev["run"] = f"{type(e).__name__}: {e}"
    _reset_collective_token()
    new = sorted(_dump_files() - before)
    pre = [f for f in new if f.endswith("before_optimizations.txt")]
    post = [f for f in new if f.endswith("after_optimizations.txt")]
    if not pre:
        ev["why_not"] = "XLA wrote no before_optimizations dump (flags parsed before hlo_check was imported?)"
        return ev
    pre_text = open(pre[-1]).read()
    ev["module"] = os.path.basename(pre[-1])
    ev["buffer_donor"] = _header_attr(pre_text, "buffer_donor")
    if post:
        ev["compiled_input_output_alias"] = _header_attr(open(post[-1]).read(), "input_output_alias")
    ev["sync_graph_hlo"] = pre_text
    return ev


def lower(module: torch.nn.Module, example_inputs: tuple, aliases: dict, tp: int) -> str:
    """HLO text of `module(*example_inputs)` lowered with world size `tp`, with
    `input_output_alias={ {out}: (param, {}, must-alias) }` added for each aliased state parameter."""
    return lower_detailed(module, example_inputs, aliases, tp, xla_alias_evidence=False)["hlo"]


# --- checking -------------------------------------------------------------------------------------
_SHAPE = re.compile(r"^([a-z]+[0-9]*)\[([0-9,]*)\]")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "all-reduce-start", "all-gather-start", "collective-broadcast")
_INDEXED = ("scatter", "gather", "dynamic-slice", "dynamic-update-slice", "select-and-scatter")
_INT = {"s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64"}


def _balanced(s: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket group starting at s[i] == open_."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_:
            depth += 1
        elif s[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _types(t: str) -> list[tuple[str, list[int]]]:
    """'bf16[2,8]{1,0}' or '(bf16[1,8]{1,0}, f32[])' -> [(dtype, dims), ...]."""
    t = t.strip()
    if t.startswith("("):
        return [x for part in _split_top(t[1:-1]) for x in _types(part)]
    m = _SHAPE.match(t)
    return [(m.group(1), [int(d) for d in m.group(2).split(",") if d])] if m else []


def _fmt(ts) -> str:
    return ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in ts)


def _elems(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _parse(hlo: str):
    """Yield (computation, is_entry, name, type_str, opcode, operands_str, attrs_str)."""
    comp, entry = None, False
    for line in hlo.splitlines():
        s = line.strip()
        if not s or s.startswith("HloModule") or s == "}":
            continue
        if s.endswith("{") and "=" not in s.split("(", 1)[0]:
            entry = s.startswith("ENTRY")
            comp = s.split()[1 if entry else 0].lstrip("%")
            continue
        if s.startswith("ROOT "):
            s = s[5:]
        if " = " not in s:
            continue
        name, rhs = s.split(" = ", 1)
        if rhs.startswith("("):
            end = _balanced(rhs, 0, "(", ")")
        else:
            end = rhs.find(" ")
        type_str, rest = rhs[:end], rhs[end:].strip()
        p = rest.find("(")
        if p < 0:
            continue
        opcode = rest[:p]
        close = _balanced(rest, p, "(", ")")
        yield comp, entry, name.lstrip("%"), type_str, opcode, rest[p + 1:close - 1], rest[close:].lstrip(", ")


def _groups(attrs: str):
    m = re.search(r"replica_groups=(\{\{[0-9,{} ]*\}\}|\{\})", attrs)
    if not m:
        m2 = re.search(r"replica_groups=(\[[^\s,]+\]<=\[[0-9,]+\][^\s,]*)", attrs)  # iota form
        return m2.group(1) if m2 else None
    body = m.group(1)[1:-1]
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", body)]


S64_KINDS = {
    "index-wrap": "an s32 value widened to s64 and compared with 0: torch-xla's lowering of an indexing op "
                  "(index, index_put) wraps negative indices so; the select and the index itself stay s32",
    "index-result": "argmax / topk: XLA computes the index in s32, torch's int64 result widens it, and the graph "
                    "narrows it back to s32 at once",
}


def s64_tensors(hlo: str) -> list[dict]:
    """Every instruction with a 64-bit integer result: name, op, type, torch op (XLA_IR_DEBUG's op_type) and
    `kind` (S64_KINDS), None where an int32 would serve. A widened s32 value keeps its value through
    neuronx-cc's int64 -> int32 downcast, so both kinds are exact under it."""
    inst = {name: (ty, op, operands, attrs) for _, _, name, ty, op, operands, attrs in _parse(hlo)}
    users: dict[str, list[str]] = {}
    for name, (_, _, operands, _) in inst.items():
        for o in re.findall(r"%([\w.\-]+)", operands):
            users.setdefault(o, []).append(name)

    def s64(name: str) -> bool:
        return name in inst and any(d in ("s64", "u64") for d, _ in _types(inst[name][0]))

    def operands(name: str) -> list[str]:
        return re.findall(r"%([\w.\-]+)", inst[name][2])

    def zero(name: str) -> bool:  # a broadcast of (or) an s64 constant 0
        ty, op, ops, _ = inst.get(name, ("", "", "", ""))
        if op == "broadcast":
            return all(zero(o) for o in operands(name))
        return op == "constant" and ops.strip() == "0"

    def widened(name: str) -> bool:  # convert from a 32-bit integer
        return inst[name][1] == "convert" and all(_types(inst[o][0])[0][0] in ("s32", "u32") for o in operands(name))

    wrap: set[str] = set()
    for name, (ty, op, ops, attrs) in inst.items():
        args = operands(name) if op == "compare" else []
        if op == "compare" and "direction=LT" in attrs and len(args) == 2 and widened(args[0]) and zero(args[1]):
            wrap |= {args[0], args[1], *[o for o in operands(args[1]) if zero(o)]}
    out = []
    for name, (ty, op, ops, attrs) in inst.items():
        if not s64(name):
            continue
        m = re.search(r'op_type="([^"]*)"', attrs)
        kind = None
        if name in wrap:
            kind = "index-wrap"
        elif widened(name) and users.get(name) and all(
                inst[u][1] == "convert" and _types(inst[u][0])[0][0] == "s32" for u in users[name]):
            kind = "index-result"
        out.append({"name": name, "op": op, "type": ty, "torch_op": m.group(1) if m else None, "kind": kind})
    return out


def check(hlo_text: str, *, tp: int, int_inputs_expected_int32: bool = True, max_constant_elems: int = 1024,
          expect_collectives: bool | None = None) -> dict:
    """Findings on one HLO module's text (from `_get_xla_tensors_hlo`, `lower()`, or an XLA dump).

    `issues` lists what would be wrong for neuronx-cc: collectives whose replica_groups are not
    [[0..tp-1]], s64 ENTRY parameters (when int inputs should be int32), constants larger than
    `max_constant_elems` (weights folded into the graph), s64 operands/results of scatter/gather/
    collectives, aliases whose parameter and output types differ, and (when `expect_collectives`
    is set) collectives present/absent against that expectation."""
    header = hlo_text.split("\n", 1)[0]
    defs: dict[str, str] = {}
    insts = list(_parse(hlo_text))
    for comp, entry, name, ty, *_ in insts:
        defs[name] = ty
    issues: list[str] = []
    params, collectives, constants, s64_critical, custom_calls = [], [], [], [], []
    hist: dict[str, int] = {}
    s64_ops: dict[str, int] = {}
    for comp, entry, name, ty, op, operands, attrs in insts:
        if entry:
            hist[op] = hist.get(op, 0) + 1
        rtypes = _types(ty)
        otypes = [t for o in re.findall(r"%([\w.\-]+)", operands) for t in _types(defs.get(o, ""))]
        if not otypes:  # operand types printed inline ("f32[2,8]{1,0} %x")
            otypes = [t for part in _split_top(operands) for t in _types(part)]
        if entry and op == "parameter":
            (d, dims), = rtypes or [("?", [])]
            params.append({"number": int(operands), "name": name, "dtype": d, "shape": dims})
        if op in _COLLECTIVES:
            c = {"op": op, "name": name, "computation": comp, "result": _fmt(rtypes), "operands": _fmt(otypes),
                 "replica_groups": _groups(attrs)}
            for key in ("dimensions", "constrain_layout", "channel_id", "use_global_device_ids", "to_apply"):
                m = re.search(key + r"=(\{[^}]*\}|[^,\s]+)", attrs)
                if m:
                    c[key] = m.group(1)
            collectives.append(c)
            if c["replica_groups"] != [list(range(tp))]:
                issues.append(f"{op} {name}: replica_groups {c['replica_groups']} != {[list(range(tp))]}")
        if op == "constant":
            (d, dims), = rtypes or [("?", [])]
            n = _elems(dims)
            if n > 1:
                constants.append({"name": name, "type": _fmt(rtypes), "elems": n})
            if n > max_constant_elems:
                issues.append(f"large constant {name} {_fmt(rtypes)} ({n} elements > {max_constant_elems}): "
                              "weights folded into the graph?")
        if op == "custom-call":
            m = re.search(r'custom_call_target="([^"]*)"', attrs)
            custom_calls.append({"name": name, "target": m.group(1) if m else None})
        if any(d == "s64" for d, _ in rtypes):
            s64_ops[op] = s64_ops.get(op, 0) + 1
        if (op in _COLLECTIVES or op in _INDEXED) and any(d in ("s64", "u64") for d, _ in rtypes + otypes):
            s64_critical.append({"op": op, "name": name, "result": _fmt(rtypes), "operands": _fmt(otypes)})
            issues.append(f"64-bit integer {op} {name}: ({_fmt(otypes)}) -> {_fmt(rtypes)}")
    params.sort(key=lambda p: p["number"])
    if int_inputs_expected_int32:
        for p in params:
            if p["dtype"] in ("s64", "u64"):
                issues.append(f"parameter {p['number']} ({p['name']}) is {p['dtype']}{p['shape']}, expected 32-bit ints")
    n_coll = len(collectives)
    if expect_collectives is True and n_coll == 0:
        issues.append(f"no collectives in the HLO but tp={tp} (elided: world size not patched?)")
    if expect_collectives is False and n_coll:
        issues.append(f"{n_coll} collectives in the HLO, none expected")

    # aliasing in the header (added by lower(), or XLA's own input_output_alias / buffer_donor)
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", header)
    outs = []
    if layout:
        outs_s = re.sub(r"/\*.*?\*/", "", layout.group(2)).strip()
        outs = _split_top(outs_s[1:-1]) if outs_s.startswith("(") else [outs_s]
    alias_s = _header_attr(hlo_text, "input_output_alias")
    aliases = []
    if alias_s:
        for o, p, kind in re.findall(r"\{(\d*)\}:\s*\((\d+),\s*\{[^}]*\},?\s*([a-z\-]*)\)", alias_s):
            a = {"output": int(o) if o else None, "parameter": int(p), "kind": kind or None}
            pt = next((x for x in params if x["number"] == a["parameter"]), None)
            ot = _types(outs[a["output"]]) if a["output"] is not None and a["output"] < len(outs) else []
            a["parameter_type"] = _fmt([(pt["dtype"], pt["shape"])]) if pt else None
            a["output_type"] = _fmt(ot) if ot else None
            if a["parameter_type"] != a["output_type"]:
                issues.append(f"alias output {o} -> parameter {p}: types differ "
                              f"({a['output_type']} vs {a['parameter_type']})")
            aliases.append(a)
    return {
        "ok": not issues,
        "issues": issues,
        "module": header.split()[1].rstrip(",") if header.startswith("HloModule") else None,
        "parameters": params,
        "int_parameters": [p for p in params if p["dtype"] in _INT],
        "outputs": [_fmt(_types(o)) for o in outs],
        "collectives": collectives,
        "constants_nonscalar": constants,
        "s64_critical_ops": s64_critical,
        "s64_result_ops": s64_ops,
        "custom_calls": custom_calls,
        "input_output_alias": aliases,
        "buffer_donor": _header_attr(hlo_text, "buffer_donor"),
        "entry_opcodes": dict(sorted(hist.items())),
    }


# --- self-test ------------------------------------------------------------------------------------
class _ToyTP(torch.nn.Module):
    """Row-parallel matmul, an all-reduce through the shim, and a functional KV update."""

    def __init__(self, tp: int):
        super().__init__()
        self.comm = nxd_mappings_shim(tp)
        self.weight = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16))
        self.kv = torch.nn.Parameter(torch.zeros(2, 8, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor):
        y = self.comm.reduce_from_tensor_model_parallel_region(x @ self.weight)  # [1, 8]
        new_kv = torch.index_put(self.kv, (pos,), y)
        return y, new_kv


class _ToyGather(torch.nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        self.comm = nxd_mappings_shim(tp)

    def forward(self, x):
        return self.comm.gather_from_tensor_model_parallel_region(x * 3)


def _selftest() -> int:
    tp = 2
    torch.manual_seed(0)
    m = _ToyTP(tp)
    x = torch.randn(1, 4, dtype=torch.bfloat16)
    pos = torch.tensor([1], dtype=torch.int32)
    res = lower_detailed(m, (x, pos), {m.kv: 1}, tp)
    findings = check(res["hlo"], tp=tp, expect_collectives=True)
    ev = res["xla_evidence"]
    sync_findings = check(ev["sync_graph_hlo"], tp=tp) if ev.get("sync_graph_hlo") else None
    ev = {k: v for k, v in ev.items() if k != "sync_graph_hlo"}
    # probes: elision without the patch, and the all-gather
    unpatched = _X._get_xla_tensors_hlo([xm.all_reduce(xm.REDUCE_SUM, [torch.ones(2, 2, device=torch_xla.device())],
                                                       groups=[[0, 1]])[0]])
    g = check(lower(_ToyGather(tp), (torch.randn(2, 8),), {}, tp), tp=tp, expect_collectives=True)
    report = {
        "versions": {"torch": torch.__version__, "torch_xla": torch_xla.__version__,
                     "python": sys.version.split()[0]},
        "hlo_header": res["hlo"].split("\n", 1)[0],
        "lowered_parameters": res["parameters"],
        "aliases": res["aliases"],
        "findings": findings,
        "xla_evidence": ev,
        "sync_graph_findings": {k: sync_findings[k] for k in ("module", "buffer_donor", "collectives", "issues")}
        if sync_findings else None,
        "probe_all_reduce_without_world_size_patch": {"all_reduce_ops": unpatched.count(" all-reduce(")},
        "probe_gather": {"collectives": g["collectives"], "outputs": g["outputs"], "issues": g["issues"]},
    }
    print(json.dumps(report, indent=1))
    ok = (findings["ok"] and len(findings["collectives"]) == 1
          and findings["collectives"][0]["replica_groups"] == [[0, 1]]
          and any(p["dtype"] == "s32" and p["shape"] == [1] for p in findings["parameters"])
          and findings["input_output_alias"] and ev.get("buffer_donor") == "(5, {})"
          and ev.get("entry_layout_matches_lowered") is True and report["probe_all_reduce_without_world_size_patch"]["all_reduce_ops"] == 0
          and g["collectives"] and g["collectives"][0]["op"] == "all-gather" and g["outputs"] == ["f32[2,16]"])
    print("SELFTEST", "PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_selftest())
