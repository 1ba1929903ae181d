"""The few fields of a serialised `xla.HloModuleProto` the NEFF generation reads or writes, in protobuf's wire
format (no protobuf package, no XLA): the ENTRY signature (`host_program_shape`) and the input/output aliasing.

Field numbers from XLA's xla/service/hlo.proto and xla/xla_data.proto: HloModuleProto {name 1,
entry_computation_name 2, computations 3, host_program_shape 4, input_output_alias 8}; ProgramShapeProto
{parameters 1, result 2, parameter_names 3}; ShapeProto {element_type 2, dimensions 3, tuple_shapes 4};
HloInputOutputAliasProto {entries 1}; AliasEntryProto {output_shape_index 1, parameter_number 2,
parameter_shape_index 3, kind 4 (MUST_ALIAS = 2)}. Appending a serialised field to a message merges it
(repeated fields append), so an alias is added without re-encoding the module.
"""
from __future__ import annotations

from dataclasses import dataclass

# xla_data.proto PrimitiveType -> the manifest's dtype names
PRIMITIVE = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
             9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}
TUPLE = 13
MUST_ALIAS = 2


class HloProtoError(ValueError):
    pass


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise HloProtoError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def fields(data: bytes) -> list[tuple[int, int, object]]:
    """Every (field number, wire type, value) of one message: an int for varints and fixed, bytes for the rest."""
    out, i = [], 0
    while i < len(data):
        key, i = _varint(data, i)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise HloProtoError("field number 0")
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            n, i = _varint(data, i)
            if i + n > len(data):
                raise HloProtoError("truncated length-delimited field")
            value, i = data[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if i + n > len(data):
                raise HloProtoError("truncated fixed field")
            value, i = int.from_bytes(data[i:i + n], "little"), i + n
        else:
            raise HloProtoError(f"wire type {wire} (groups) in an HloModuleProto")
        out.append((num, wire, value))
    return out


def _ints(values: list[tuple[int, object]]) -> list[int]:
    """A repeated int64 field, packed or not."""
    out = []
    for wire, v in values:
        if wire == 2:
            j = 0
            while j < len(v):
                x, j = _varint(v, j)
                out.append(x - (1 << 64) if x >> 63 else x)
        else:
            out.append(v)
    return out


@dataclass(frozen=True)
class Port:
    dtype: str
    shape: list[int]


def _shape(data: bytes) -> Port | list[Port]:
    fs = fields(data)
    kind = next((v for n, w, v in fs if n == 2 and w == 0), 0)
    if kind == TUPLE:
        return [p for n, w, v in fs if n == 4 and w == 2 for p in _flat(_shape(v))]
    if kind not in PRIMITIVE:
        raise HloProtoError(f"element type {kind} is not one a graph port may have")
    return Port(PRIMITIVE[kind], _ints([(w, v) for n, w, v in fs if n == 3]))


def _flat(p) -> list[Port]:
    return p if isinstance(p, list) else [p]


@dataclass(frozen=True)
class HloSignature:
    name: str
    parameters: list[Port]
    results: list[Port]  # the ENTRY result, a tuple flattened
    aliases: list[tuple[int, int]]  # (output index, parameter number)


def signature(data: bytes) -> HloSignature:
    """The ENTRY signature and aliases of a serialised HloModuleProto; HloProtoError where it is not one."""
    fs = fields(data)
    name = next((v for n, w, v in fs if n == 1 and w == 2), None)
    programs = [v for n, w, v in fs if n == 4 and w == 2]
    if name is None or not programs or not any(n == 3 and w == 2 for n, w, _ in fs):
        raise HloProtoError("not an HloModuleProto (no name, computations or host_program_shape)")
    program = fields(programs[-1])
    params = [_shape(v) for n, w, v in program if n == 1 and w == 2]
    result = next((_shape(v) for n, w, v in program if n == 2 and w == 2), [])
    aliases = []
    for n, w, v in fs:
        if n == 8 and w == 2:
            for en, ew, entry in fields(v):
                if en == 1 and ew == 2:
                    ef = fields(entry)
                    out = _ints([(w2, x) for n2, w2, x in ef if n2 == 1])
                    param = next((x for n2, w2, x in ef if n2 == 2 and w2 == 0), 0)
                    aliases.append((out[0] if out else -1, param))
    return HloSignature(name.decode("utf-8", "replace"), [_flat(p)[0] for p in params], _flat(result), aliases)


def _key(num: int, wire: int) -> bytes:
    return _encode_varint(num << 3 | wire)


def _encode_varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


def _delimited(num: int, payload: bytes) -> bytes:
    return _key(num, 2) + _encode_varint(len(payload)) + payload


def with_alias(data: bytes, output: int, parameter: int) -> bytes:
    """`data` with `input_output_alias {entries {output_shape_index: [output] parameter_number: parameter
    kind: MUST_ALIAS}}` added: ENTRY output `output` (of its result tuple) reuses parameter `parameter`'s buffer."""
    entry = (_key(1, 2) + _encode_varint(len(_encode_varint(output))) + _encode_varint(output)
             + _key(2, 0) + _encode_varint(parameter) + _key(4, 0) + _encode_varint(MUST_ALIAS))
    return data + _delimited(8, _delimited(1, entry))
