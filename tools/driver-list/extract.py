#!/usr/bin/env python3
"""Extracts the C signature of every CUDA driver export from NVIDIA's headers, as Rust parameter lists.

Used to write and check `remoting/protocol/driver-api.list` (the declaration list): run it when moving to a
new driver, compare its output with the list's signatures. Inputs: the headers of the CUDA toolkit the driver
belongs to (`cuda.h`, `cudaGL.h`, `cudaEGL.h`, `cudaVDPAU.h`; from the PyPI wheel `nvidia-cuda-runtime==13.0.*`)
and the driver's export list. Output, one line per export: `name(param: RustType, ...)`.

    python3 tools/driver-list/extract.py INCLUDE_DIR remoting/shim/libcuda-580-exports.txt
"""
import os
import re
import subprocess
import sys
import tempfile

PRELUDE = """
typedef unsigned int GLuint; typedef unsigned int GLenum;
typedef void* EGLImageKHR; typedef void* EGLStreamKHR; typedef int EGLint; typedef void* EGLSyncKHR;
typedef void* EGLDisplay; typedef void* EGLImage;
typedef unsigned int VdpDevice; typedef void VdpGetProcAddress; typedef unsigned int VdpVideoSurface;
typedef unsigned int VdpOutputSurface;
"""

# Exports whose prototypes are not in the public headers (cudaProfiler.h is not shipped in the wheel;
# the others are undocumented): their parameters as documented elsewhere, or none (stubs only).
EXTRA = {
    "cuProfilerInitialize": "configFile: *const c_char, outputFile: *const c_char, outputMode: u32",
    "cuProfilerStart": "",
    "cuProfilerStop": "",
    "cuEGLApiInit": "",
    "cuMemGetAttribute": "",
    "cuMemGetAttribute_v2": "",
}

# Opaque handle typedefs (pointers to incomplete structs) and the Rust name used for each.
HANDLES = {
    "CUcontext": "CUcontext", "CUmodule": "CUmodule", "CUfunction": "CUfunction", "CUlibrary": "CUlibrary",
    "CUkernel": "CUkernel", "CUstream": "CUstream", "CUevent": "CUevent",
}

SCALARS = {
    "void": "c_void", "char": "c_char", "int": "i32", "unsigned int": "u32", "unsigned": "u32",
    "short": "i16", "unsigned short": "u16", "unsigned char": "u8", "long": "i64",
    "unsigned long": "u64", "long long": "i64", "unsigned long long": "u64", "float": "f32",
    "double": "f64", "size_t": "usize", "cuuint64_t": "u64", "cuuint32_t": "u32",
    "CUdeviceptr": "u64", "CUdeviceptr_v2": "u64", "CUdevice": "i32", "CUdevice_v1": "i32",
    "CUtexObject": "u64", "CUsurfObject": "u64", "CUtexObject_v1": "u64", "CUsurfObject_v1": "u64",
    "CUmemGenericAllocationHandle": "u64", "CUmemGenericAllocationHandle_v1": "u64",
    "GLuint": "u32", "GLenum": "u32", "EGLint": "i32", "VdpDevice": "u32", "VdpVideoSurface": "u32",
    "VdpOutputSurface": "u32", "cuuint64_t_": "u64", "CUgraphConditionalHandle": "u64",
    "CUlogIterator": "u32", "CUasyncCallbackHandle": "*mut c_void",
}


RUST_KEYWORDS = {"fn", "type", "ref", "in", "loop", "match", "move", "where", "use", "mod", "impl",
                 "self", "super", "crate", "struct", "enum", "trait", "let", "static", "const", "box"}


def preprocess(include, text):
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        return subprocess.run(["gcc", "-E", "-P", "-I", include, path], check=True,
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


def typedefs(pp):
    """typedef name -> what it stands for, from the preprocessed headers."""
    enums, structs, aliases, fnptrs = set(), set(), {}, set()
    for m in re.finditer(r"typedef\s+enum\s+\w*\s*\{[^}]*\}\s*(\w+)\s*;", pp, re.S):
        enums.add(m.group(1))
    for m in re.finditer(r"typedef\s+(?:struct|union)\s+\w*\s*\{", pp):
        # find the name after the matching brace
        depth, i = 0, m.end() - 1
        while i < len(pp):
            if pp[i] == "{":
                depth += 1
            elif pp[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        name = re.match(r"\s*(\w+)", pp[i + 1:])
        if name:
            structs.add(name.group(1))
    for m in re.finditer(r"typedef\s+([\w\s\*]+?)\s*(\w+)\s*;", pp):
        aliases[m.group(2)] = " ".join(m.group(1).split())
    for m in re.finditer(r"typedef\s+[\w\s\*]+\(\s*(?:CUDA_CB\s*)?\*\s*(\w+)\s*\)\s*\(", pp):
        fnptrs.add(m.group(1))
    return enums, structs, aliases, fnptrs


def rust_type(ctype, tds):
    enums, structs, aliases, fnptrs = tds
    ctype = re.sub(r"\b(struct|enum|union)\s+", "", ctype).strip()
    stars = ctype.count("*")
    base = ctype.replace("*", " ").split()
    const = "const" in base
    base = " ".join(b for b in base if b not in ("const", "volatile", "restrict", "__restrict__"))
    seen = set()
    while base in aliases and base not in SCALARS and base not in HANDLES and base not in seen:
        target = aliases[base]
        if re.fullmatch(r"(struct\s+)?\w+_st\s*\*", target):
            HANDLES[base] = base  # an opaque handle: a pointer to a driver-private struct
            break
        seen.add(base)
        if "*" in target:
            stars += target.count("*")
            base = " ".join(target.replace("*", " ").split())
        else:
            base = re.sub(r"\b(struct|enum|union)\s+", "", target).strip()
    if base in HANDLES:
        inner = HANDLES[base]
    elif base in SCALARS:
        inner = SCALARS[base]
    elif base in enums or base.endswith("_enum") or base in ("CUresult",):
        inner = "u32"
    elif base in fnptrs:
        inner = "*mut c_void"  # a C function pointer: called only by hand-written code
    elif base.endswith("_st") or base in structs or base.startswith("CU") or base.startswith("CUDA"):
        # A struct: behind a pointer it is opaque here (hand-written code gives it a Rust type); by value
        # it keeps its C name, defined in gleam_protocol::types with the C layout.
        inner = "c_void" if stars else re.sub(r"_v\d+$", "", base)
    else:
        inner = f"UNKNOWN({base})"
    for i in range(stars):
        inner = ("*const " if (const and i == 0) else "*mut ") + inner
    return inner


def params(args, tds):
    args = args.strip()
    if args in ("", "void"):
        return ""
    out = []
    for i, p in enumerate(split_args(args)):
        m = re.match(r"(.*?)(\w+)\s*(\[\s*\w*\s*\])?$", p.strip(), re.S)
        ctype, name, array = m.group(1), m.group(2), m.group(3)
        if not ctype.strip():  # unnamed parameter
            ctype, name = p, f"arg{i}"
        if array:
            ctype += "*"
        if name in RUST_KEYWORDS:
            name += "_"
        out.append(f"{name}: {rust_type(ctype, tds)}")
    return ", ".join(out)


def split_args(args):
    depth, cur, out = 0, "", []
    for ch in args:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    out.append(cur)
    return out


def main():
    include, exports = sys.argv[1], sys.argv[2]
    pp = preprocess(include, PRELUDE + '#define __CUDA_API_VERSION_INTERNAL 1\n#include "cuda.h"\n'
                    '#include "cudaGL.h"\n#include "cudaEGL.h"\n#include "cudaVDPAU.h"\n')
    pp += preprocess(include, '#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1\n#include "cuda.h"\n')
    tds = typedefs(pp)
    decls = {}
    for m in re.finditer(r"CUresult\s+(cu\w+)\s*\(([^;{]*?)\)\s*(?:__attribute__\s*\(\([^;]*?\)\))?\s*;",
                         pp, re.S):
        decls.setdefault(m.group(1), m.group(2))
    for name in (l.strip() for l in open(exports)):
        if not name:
            continue
        if name in EXTRA:
            print(f"{name}({EXTRA[name]})")
        elif name in decls:
            print(f"{name}({params(decls[name], tds)})")
        else:
            print(f"{name}(UNKNOWN)")


if __name__ == "__main__":
    main()
