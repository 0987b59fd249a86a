"""Check that protos/ does not break clients built against the committed descriptor set.

    python protos/breaking.py           # exit 1 with the list of breaking changes (tests run it)
    python protos/breaking.py --accept  # record the current protos as the baseline, on purpose

The baseline, protos/h3/v1/h3.binpb, is a FileDescriptorSet (no source info) of every .proto under
protos/, as `python -m grpc_tools.protoc --descriptor_set_out=... -Iprotos h3/v1/h3.proto` writes it.
The current protos are compiled afresh and compared with it, type by type.

Breaking (a client or a stored message built on the baseline would misread the new one):
  - a message or enum removed;
  - a field removed (unless its number is now `reserved`), renumbered, retyped (scalar type,
    message or enum type, repeated or not), renamed (the JSON and text formats go by name), moved
    into or out of a oneof, or added under a number the baseline reserved;
  - an enum value removed (unless its number is now reserved) or renamed;
  - a service or an RPC removed, or an RPC whose request, response or streaming changed.
Not breaking: new fields, messages, enums, enum values, services and RPCs; comments.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorSet,
    MethodDescriptorProto,
    ServiceDescriptorProto,
)

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
BASELINE = PROTOS / "h3" / "v1" / "h3.binpb"

# Scalar types by their number in FieldDescriptorProto.Type, as .proto files spell them.
SCALARS = {number: name.removeprefix("TYPE_").lower() for name, number in FieldDescriptorProto.Type.items()}


class ProtoError(Exception):
    """protoc refused the protos (its messages are on stderr)."""


def compile_protos(root: Path = PROTOS) -> FileDescriptorSet:
    """Every .proto under `root`, compiled with grpcio-tools' protoc (imports relative to `root`)."""
    from grpc_tools import protoc

    sources = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # the well-known types
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        args = ["protoc", f"-I{root}", f"-I{include}", f"--descriptor_set_out={out}", *sources]
        if protoc.main(args) != 0:
            raise ProtoError(f"protoc failed on {', '.join(sources)} under {root}")
        return FileDescriptorSet.FromString(out.read_bytes())


def load(path: Path = BASELINE) -> FileDescriptorSet:
    return FileDescriptorSet.FromString(path.read_bytes())


def save(descriptors: FileDescriptorSet, path: Path = BASELINE) -> None:
    path.write_bytes(descriptors.SerializeToString(deterministic=True))


# ---- the comparison ------------------------------------------------------------------------------


@dataclass
class Types:
    """A descriptor set's messages, enums and services by full name (`h3.v1.Session`)."""

    messages: dict[str, DescriptorProto] = field(default_factory=dict)
    enums: dict[str, EnumDescriptorProto] = field(default_factory=dict)
    services: dict[str, ServiceDescriptorProto] = field(default_factory=dict)

    @classmethod
    def of(cls, descriptors: FileDescriptorSet) -> Types:
        types = cls()
        for file in descriptors.file:
            prefix = f"{file.package}." if file.package else ""
            types.services.update((prefix + s.name, s) for s in file.service)
            types.enums.update((prefix + e.name, e) for e in file.enum_type)
            for message in file.message_type:
                types.add_message(prefix + message.name, message)
        return types

    def add_message(self, name: str, message: DescriptorProto) -> None:
        self.messages[name] = message
        self.enums.update((f"{name}.{e.name}", e) for e in message.enum_type)
        for nested in message.nested_type:
            self.add_message(f"{name}.{nested.name}", nested)


def breaking_changes(old: FileDescriptorSet, new: FileDescriptorSet) -> list[str]:
    """Every change from `old` to `new` that breaks a client of `old`, one line each, by type name."""
    before, after = Types.of(old), Types.of(new)
    problems: list[str] = []
    for name, message in sorted(before.messages.items()):
        if name not in after.messages:
            problems.append(f"{name}: message removed")
        else:
            problems += [f"{name}: {p}" for p in _message_changes(message, after.messages[name])]
    for name, enum in sorted(before.enums.items()):
        if name not in after.enums:
            problems.append(f"{name}: enum removed")
        else:
            problems += [f"{name}: {p}" for p in _enum_changes(enum, after.enums[name])]
    for name, service in sorted(before.services.items()):
        if name not in after.services:
            problems.append(f"{name}: service removed")
        else:
            problems += [f"{name}: {p}" for p in _service_changes(service, after.services[name])]
    return problems


def _message_changes(old: DescriptorProto, new: DescriptorProto) -> Iterator[str]:
    by_number = {f.number: f for f in new.field}
    by_name = {f.name: f for f in new.field}
    for was in old.field:
        now = by_number.get(was.number)
        if now is None:
            if _reserved(new.reserved_range, was.number, end_inclusive=False):
                continue
            moved = by_name.get(was.name)
            if moved is not None:
                yield f"field `{was.name}` renumbered {was.number} -> {moved.number}"
            else:
                yield f"field {was.number} `{was.name}` removed (to delete a field, reserve its number)"
            continue
        if now.name != was.name:
            yield f"field {was.number} renamed `{was.name}` -> `{now.name}`"
        if _field_type(now) != _field_type(was):
            yield f"field {was.number} `{was.name}` retyped {_field_type(was)} -> {_field_type(now)}"
        if _oneof(old, was) != _oneof(new, now):
            yield f"field {was.number} `{was.name}` moved {_oneof_move(_oneof(old, was), _oneof(new, now))}"
    old_numbers = {f.number for f in old.field}
    for now in new.field:
        if now.number not in old_numbers and _reserved(old.reserved_range, now.number, end_inclusive=False):
            yield f"field {now.number} `{now.name}` reuses a reserved number"


def _field_type(f: FieldDescriptorProto) -> str:
    """How the field reads in a .proto (`repeated uint32`, `h3.v1.Session`), presence left out:
    adding or dropping proto3 `optional` keeps the wire format."""
    name = f.type_name.removeprefix(".") if f.type_name else SCALARS[f.type]
    return f"repeated {name}" if f.label == FieldDescriptorProto.LABEL_REPEATED else name


def _oneof(message: DescriptorProto, f: FieldDescriptorProto) -> str | None:
    """The real oneof holding `f` (proto3 `optional` fields sit in a synthetic one of their own)."""
    if not f.HasField("oneof_index") or f.proto3_optional:
        return None
    return str(message.oneof_decl[f.oneof_index].name)


def _oneof_move(was: str | None, now: str | None) -> str:
    if was is None:
        return f"into oneof `{now}`"
    return f"out of oneof `{was}`" if now is None else f"from oneof `{was}` to `{now}`"


def _enum_changes(old: EnumDescriptorProto, new: EnumDescriptorProto) -> Iterator[str]:
    by_number = {v.number: v for v in new.value}
    for was in old.value:
        now = by_number.get(was.number)
        if now is None:
            if not _reserved(new.reserved_range, was.number, end_inclusive=True):
                yield f"value {was.number} `{was.name}` removed (to delete a value, reserve its number)"
        elif now.name != was.name:
            yield f"value {was.number} renamed `{was.name}` -> `{now.name}`"


def _service_changes(old: ServiceDescriptorProto, new: ServiceDescriptorProto) -> Iterator[str]:
    by_name = {m.name: m for m in new.method}
    for was in old.method:
        now = by_name.get(was.name)
        if now is None:
            yield f"rpc `{was.name}` removed"
        elif _signature(now) != _signature(was):
            yield f"rpc `{was.name}` changed: `{_signature(was)}` -> `{_signature(now)}`"


def _signature(m: MethodDescriptorProto) -> str:
    request = ("stream " if m.client_streaming else "") + m.input_type.removeprefix(".")
    response = ("stream " if m.server_streaming else "") + m.output_type.removeprefix(".")
    return f"{m.name}({request}) returns ({response})"


class _Range(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def _reserved(ranges: Iterable[_Range], number: int, end_inclusive: bool) -> bool:
    """Message reserved ranges end before `end`; enum reserved ranges include it."""
    return any(r.start <= number < r.end + end_inclusive for r in ranges)


# ---- the command ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accept", action="store_true", help="write the current protos as the new baseline")
    parser.add_argument("--protos", type=Path, default=PROTOS, help="the .proto tree (default: protos/)")
    parser.add_argument("--against", type=Path, default=BASELINE, help="the baseline (default: %(default)s)")
    args = parser.parse_args(argv)
    current = compile_protos(args.protos)
    if args.accept:
        save(current, args.against)
        print(f"wrote {args.against}")
        return 0
    baseline = load(args.against)
    problems = breaking_changes(baseline, current)
    if problems:
        print(f"{args.protos} breaks clients of {args.against} ({len(problems)}):", file=sys.stderr)
        print("".join(f"  {p}\n" for p in problems), end="", file=sys.stderr)
        print("Undo them, or record a new baseline on purpose: python protos/breaking.py --accept", file=sys.stderr)
        return 1
    if current.SerializeToString(deterministic=True) != baseline.SerializeToString(deterministic=True):
        print(f"no breaking change; {args.protos} adds to {args.against}: `--accept` records the additions")
    else:
        print(f"no breaking change: {args.protos} matches {args.against}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
