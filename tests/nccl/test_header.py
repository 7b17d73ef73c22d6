"""The ctypes declarations against the nccl.h shipped beside the loaded library, whatever its
release: prototypes, enums and ``ncclConfig_t`` as that release has them.

``tests/nccl/test_versions.py`` runs this file again against a second NCCL release.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from ferrodist.core import ALL_DTYPES

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import _library
from ferrodist.nccl._library import (
    ADDED_IN,
    CONFIG_FIELDS,
    PROTOTYPES,
    ConfigStruct,
    DataType,
    RedOp,
    Result,
    UniqueIdStruct,
    config_fields,
    config_size,
)

#: C type (as written in nccl.h, spaces normalised) -> the ctypes type a binding must use.
C_TO_CTYPES = {
    "ncclResult_t": ctypes.c_int,
    "ncclResult_t*": ctypes.POINTER(ctypes.c_int),
    "const char*": ctypes.c_char_p,
    "const void*": ctypes.c_void_p,
    "void*": ctypes.c_void_p,
    "size_t": ctypes.c_size_t,
    "int": ctypes.c_int,
    "int*": ctypes.POINTER(ctypes.c_int),
    "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int,
    "ncclComm_t": ctypes.c_void_p,
    "const ncclComm_t": ctypes.c_void_p,
    "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p),
    "cudaStream_t": ctypes.c_void_p,
    "ncclUniqueId": UniqueIdStruct,
    "ncclUniqueId*": ctypes.POINTER(UniqueIdStruct),
    "ncclConfig_t*": ctypes.POINTER(ConfigStruct),
    "unsigned int": ctypes.c_uint,
}

_PROTOTYPE = re.compile(r"^(ncclResult_t|const char\*)\s+(nccl\w+)\s*\(([^)]*)\)\s*;", re.MULTILINE)


def _normalise(c_type: str) -> str:
    c_type = re.sub(r"\s*\*", "*", " ".join(c_type.split()))
    return c_type


def _split_parameter(parameter: str) -> str:
    """``const void* sendbuff`` -> ``const void*`` (the type without the parameter name)."""
    parameter = " ".join(parameter.split())
    match = re.match(r"^(.*?[\s*])(\w+)$", parameter)
    assert match, parameter
    return _normalise(match.group(1))


def parse_prototypes(header: str) -> dict[str, tuple[str, list[str]]]:
    """Every ``nccl*`` function of the header: name -> (return type, parameter types)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for restype, name, parameters in _PROTOTYPE.findall(header):
        params = [p for p in (x.strip() for x in parameters.split(",")) if p and p != "void"]
        found[name] = (_normalise(restype), [_split_parameter(p) for p in params])
    return found


def parse_enum(header: str, typedef: str) -> dict[str, int]:
    """``typedef enum { a = 0, b = 1, ... } typedef;`` -> {a: 0, b: 1, ...} (numeric values only)."""
    match = re.search(r"typedef enum\s*\{([^}]*)\}\s*" + typedef + r"\s*;", header)
    assert match, typedef
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", match.group(1), flags=re.DOTALL)
    return {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)\b", body)}


def parse_struct(header: str, typedef: str) -> list[tuple[str, str]]:
    """The fields ``(C type, name)`` of ``typedef struct ... { ... } typedef;``, in order."""
    end = re.search(r"\}\s*" + typedef + r"\s*;", header)
    assert end, typedef
    start = header.rfind("typedef struct", 0, end.start())
    body = header[header.index("{", start) + 1 : end.start()]
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.DOTALL)
    fields = []
    for declaration in body.split(";"):
        declaration = " ".join(declaration.split())
        if declaration:
            fields.append((_split_parameter(declaration), re.findall(r"\w+", declaration)[-1]))
    return fields


def test_the_parser_finds_the_prototypes(nccl_header):
    prototypes = parse_prototypes(nccl_header)
    assert prototypes["ncclAllReduce"] == (
        "ncclResult_t",
        ["const void*", "void*", "size_t", "ncclDataType_t", "ncclRedOp_t", "ncclComm_t", "cudaStream_t"],
    )
    assert prototypes["ncclGroupStart"] == ("ncclResult_t", [])
    assert prototypes["ncclGetErrorString"] == ("const char*", ["ncclResult_t"])


def header_version(header: str) -> tuple[int, int, int]:
    """``(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)`` of a header."""
    parts = (re.search(rf"^#define NCCL_{part}\s+(\d+)", header, re.MULTILINE) for part in ("MAJOR", "MINOR", "PATCH"))
    major, minor, patch = (int(match.group(1)) for match in parts if match)
    return major, minor, patch


def has(name: str, version: tuple[int, int, int]) -> bool:
    """Whether release ``version`` has ``name``, by :data:`ADDED_IN`."""
    return ADDED_IN.get(name, (0, 0, 0)) <= version


@pytest.mark.parametrize("name", sorted(PROTOTYPES))
def test_binding_matches_the_header(nccl_header, name):
    prototypes = parse_prototypes(nccl_header)
    if not has(name, header_version(nccl_header)):
        assert name not in prototypes, f"{name} is declared before the release ADDED_IN names"
        return
    assert name in prototypes, f"{name} is not declared in nccl.h"
    c_restype, c_argtypes = prototypes[name]
    restype, argtypes = PROTOTYPES[name]
    assert restype is C_TO_CTYPES[c_restype], (name, c_restype)
    assert len(argtypes) == len(c_argtypes), (name, c_argtypes)
    for position, (ours, theirs) in enumerate(zip(argtypes, c_argtypes, strict=True)):
        assert ours is C_TO_CTYPES[theirs], f"{name} argument {position}: header says {theirs}, binding {ours}"


def test_loaded_functions_carry_the_declared_types(library):
    for name, (restype, argtypes) in PROTOTYPES.items():
        if not has(name, library.version):
            assert not library.has(name), name
            continue
        function = getattr(library, name)
        assert function.restype is restype, name
        assert tuple(function.argtypes) == argtypes, name


def test_result_enum_matches_the_header(nccl_header):
    parsed = parse_enum(nccl_header, "ncclResult_t")
    parsed.pop("ncclNumResults")
    version = header_version(nccl_header)
    assert parsed == {member.name: member.value for member in Result if has(member.name, version)}


def test_datatype_enum_matches_the_header_and_core(nccl_header):
    parsed = parse_enum(nccl_header, "ncclDataType_t")
    parsed.pop("ncclNumTypes")
    version = header_version(nccl_header)
    primary = {member.name: member.value for member in DataType if has(member.name, version)}
    assert {name: value for name, value in parsed.items() if name in primary} == primary
    assert set(parsed.values()) == set(primary.values())  # the rest are aliases (ncclChar, ncclHalf, ...)
    by_core_name = {
        "int8": "ncclInt8",
        "uint8": "ncclUint8",
        "bool": "ncclUint8",
        "int32": "ncclInt32",
        "uint32": "ncclUint32",
        "int64": "ncclInt64",
        "uint64": "ncclUint64",
        "float16": "ncclFloat16",
        "bfloat16": "ncclBfloat16",
        "float32": "ncclFloat32",
        "float64": "ncclFloat64",
    }
    for dt in ALL_DTYPES:
        if dt.name in by_core_name:
            assert dt.nccl == parsed[by_core_name[dt.name]], dt.name
        else:
            assert dt.nccl is None, dt.name  # int16, uint16: no NCCL type


def test_redop_enum_matches_the_header(nccl_header):
    parsed = parse_enum(nccl_header, "ncclRedOp_t")
    assert {name: parsed[name] for name in RedOp.__members__} == {m.name: m.value for m in RedOp}


def test_config_struct_matches_the_header(nccl_header):
    fields = parse_struct(nccl_header, "ncclConfig_t")
    version = header_version(nccl_header)
    assert [name for _, name in fields] == list(config_fields(version)), "CONFIG_FIELDS's releases are off"
    ctypes_of = {name: ctype for name, ctype, _ in CONFIG_FIELDS}
    for c_type, name in fields:
        expected = {"const char*": ctypes.c_char_p}.get(c_type, C_TO_CTYPES.get(c_type))
        assert ctypes_of[name] is expected, (name, c_type)
    assert [name for name, _ in ConfigStruct._fields_] == [name for name, _, _ in CONFIG_FIELDS]


def test_config_size_is_the_headers_sizeof(nccl_header):
    fields = parse_struct(nccl_header, "ncclConfig_t")
    ctypes_of = {name: ctype for name, ctype, _ in CONFIG_FIELDS}

    class AsTheHeaderHasIt(ctypes.Structure):
        _fields_ = [(name, ctypes_of[name]) for _, name in fields]

    assert config_size(header_version(nccl_header)) == ctypes.sizeof(AsTheHeaderHasIt)


def test_config_initializer_matches_the_header(nccl_header):
    match = re.search(r"#define NCCL_CONFIG_INITIALIZER \{(.*?)\n\}", nccl_header, re.DOTALL)
    assert match
    values = [line.split("/*")[0].strip().rstrip(",") for line in match.group(1).split("\\") if line.strip()]
    values = [v for v in values if v]
    assert values[0] == "sizeof(ncclConfig_t)"
    magic = _define_hex(nccl_header, "NCCL_API_MAGIC") if values[1] == "NCCL_API_MAGIC" else int(values[1], 16)
    assert magic == _library.API_MAGIC
    assert values[2] in ("NCCL_VERSION_CODE", "NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)")
    version = header_version(nccl_header)
    config = ConfigStruct.initialized(version)
    assert config.size == config_size(version) <= ctypes.sizeof(ConfigStruct)
    assert config.magic == _library.API_MAGIC == 0xCAFEBEEF
    assert config.version == _library.version_code(*version)
    names = config_fields(version)
    assert len(values) == len(names)
    for name, value in zip(names[3:], values[3:], strict=True):
        if value == "NCCL_CONFIG_UNDEF_INT":
            assert getattr(config, name) == -(2**31), name
        else:
            assert value == "NCCL_CONFIG_UNDEF_PTR", name
            assert getattr(config, name) is None, name
    for name, _, _ in CONFIG_FIELDS[len(names) :]:
        assert not getattr(config, name), f"{name} is past this release's size and must stay zero"


def test_the_header_is_the_loaded_librarys(nccl_header, library):
    assert header_version(nccl_header) == library.version


def _define_hex(header: str, name: str) -> int:
    return int(re.search(rf"#define {name} (0x[0-9a-fA-F]+)", header).group(1), 16)
