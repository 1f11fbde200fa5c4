#!/usr/bin/env python3
"""Writes docs/unimplemented.md from remoting/protocol/driver-api.list: every entry point Gleam does not
implement (`stub` lines, and the per-thread forms and aliases of stubs), grouped by why it is left.

    python3 tools/driver-list/unimplemented.py        # rewrite the document
    python3 tools/driver-list/unimplemented.py --check  # exit 1 if the document is out of date

A `# not implemented...` comment right above a run of stub lines in the list is those lines' reason;
other stubs are grouped by the rules below. `remoting/protocol/tests/unimplemented_doc.rs` checks in CI
that the document names exactly the list's unimplemented entry points.
"""

import re
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "remoting/protocol/driver-api.list"
DOC = ROOT / "docs/unimplemented.md"

# Themes, in the document's order: (title, explanation). A stub's reason (from the list or the rules)
# picks its theme by the first pattern that matches it.
THEMES = [
    ("network", "Meaningless across a network",
     "These name processes, files, devices or buses of the serving machine, which the borrowing program "
     "is not on."),
    ("graphics", "Graphics and other interop", "These share buffers with a display or another API stack "
     "that would have to run on the serving machine."),
    ("multigpu", "Several GPUs, or partitions of one", "Gleam lends one GPU per session."),
    ("legacy", "Superseded forms", "Old forms of calls whose successors are implemented (or that CUDA 12 "
     "removed from its headers); binaries built since use the successors."),
    ("graphs", "Graphs built or edited by hand", "Graphs made by stream capture are implemented "
     "(capture, instantiate, launch, upload, destroy); building and editing a graph node by node is "
     "future work."),
    ("future", "Not implemented yet", "Nothing stands in the way; future work."),
]

# (regex on the name, theme, reason) for stubs the list gives no reason for.
RULES = [
    (r"^cuMemPool(Import|Export)", "network",
     "exporting and importing pool memory is IPC between processes of one machine, which has no meaning "
     "across a network (the importer would be a process of the serving machine)"),
    (r"^cu(TexRef|SurfRef)|^cuModuleGet(Tex|Surf)Ref$|^cuParamSetTexRef$", "legacy",
     "texture and surface references, removed in CUDA 12; texture and surface objects are implemented"),
    (r"^cu(Launch|LaunchGrid|LaunchGridAsync|ParamSetf|ParamSeti|ParamSetSize|ParamSetv|FuncSetBlockShape|"
     r"FuncSetSharedSize)$", "legacy",
     "the execution control API before CUDA 4.0, removed from CUDA 12's headers; cuLaunchKernel replaces it"),
    (r"^cuLaunchCooperativeKernelMultiDevice$", "multigpu",
     "a cooperative launch over several devices (deprecated since CUDA 11.3)"),
    (r"^cu(Graph|UserObject|DeviceGraphMemTrim|StreamBeginCaptureToGraph|StreamUpdateCaptureDependencies)",
     "graphs", "explicit graph construction, inspection and editing, and user objects"),
    (r"^cuLink", "future",
     "JIT linking: the linker must run where the code runs (the emu backend interprets PTX and links "
     "nothing)"),
    (r"^cuMipmappedArray|^cuArray(GetPlane|GetSparseProperties|GetMemoryRequirements)$", "future",
     "mipmapped, multi-planar and sparse CUDA arrays"),
    (r"Batch", "future", "the batched copy, prefetch, discard and decompression calls of CUDA 12.8 and 13"),
    (r"^cuMemcpy3DPeer", "future", "3D copies between contexts (cuMemcpyPeer is implemented)"),
    (r"^cuMemGetAttribute(_v2)?$", "future",
     "undocumented exports without a public declaration; no program is known to call them"),
    (r"^cuLibraryGetUnifiedFunction$", "future", "unified functions of a library (CUDA 12.4)"),
]

REASON_THEMES = [
    (r"green context|SM partitions|multicast|several GPUs|two GPUs|several devices", "multigpu"),
    (r"graphics|Vulkan|Direct3D|NvSci|display", "graphics"),
    (r"network|machine|pid|file system|GPUDirect|bus|share a bus|IPC|dma-buf|Windows|ShareableHandle",
     "network"),
    (r"32-bit|CUDA 3\.|removed|deprecated|Visual Profiler", "legacy"),
    (r"graph", "graphs"),
]


def parse():
    """(name, mode, base, reason, section) for every entry of the list."""
    entries = []
    section, reason, run_reason = None, None, None
    for line in LIST.read_text().splitlines():
        if line.startswith("## "):
            section, run_reason = line[3:].strip(), None
            continue
        if line.startswith("# not implemented"):
            reason = line[2:].strip()
            reason = re.sub(r"^not implemented( yet| here)?:\s*", "", reason)
            continue
        if not line.strip() or line.startswith("#"):
            continue
        mode, name = re.match(r"(\S+)\s+(\w+)", line).groups()
        base = line.split("=", 1)[1].strip() if mode in ("per-thread", "alias") else None
        if mode == "stub":
            # A comment is the reason of the stub run right below it.
            run_reason = reason if reason is not None else run_reason
        elif mode not in ("per-thread", "alias"):
            run_reason = None
        entries.append((name, mode, base, run_reason if mode == "stub" else None, section))
        reason = None
    return entries


def unimplemented(entries):
    modes = {name: mode for name, mode, _, _, _ in entries}
    reasons = {name: reason for name, _, _, reason, _ in entries}
    out = []
    for name, mode, base, reason, section in entries:
        if mode == "stub":
            out.append((name, reason, section))
        elif mode in ("per-thread", "alias") and modes.get(base) == "stub":
            out.append((name, reasons.get(base), section))
    return out


def classify(name, reason, implemented):
    """(theme, reason) of one unimplemented entry point."""
    if reason:
        for pattern, theme in REASON_THEMES:
            if re.search(pattern, reason, re.IGNORECASE):
                return theme, reason
        return "future", reason
    for pattern, theme, why in RULES:
        if re.search(pattern, name):
            return theme, why
    for suffix in ("_v2", "_v3"):
        stem = re.sub(r"_(ptsz|ptds)$", "", name)
        if stem + suffix in implemented:
            return "legacy", (
                "the first form (CUDA 3.x: 32-bit device pointers and sizes, or an older descriptor); "
                "the `_v2` form is implemented")
    return "future", "not implemented yet"


def render():
    entries = parse()
    implemented = {n for n, m, _, _, _ in entries if m not in ("stub",)}
    missing = unimplemented(entries)
    implemented -= {n for n, _, _ in missing}
    groups = OrderedDict((key, OrderedDict()) for key, _, _ in THEMES)
    for name, reason, _ in missing:
        theme, why = classify(name, reason, implemented)
        groups[theme].setdefault(why, []).append(name)
    total = len(entries)
    lines = [
        "# Driver entry points Gleam does not implement",
        "",
        f"{len(missing)} of the {total} entry points of NVIDIA's 580 driver (CUDA 13.0) are not implemented: "
        "each returns `CUDA_ERROR_NOT_SUPPORTED` and logs its name once (`gleam trace` lists the ones a "
        "program calls). Below, grouped by why each is left.",
        "",
        "Generated from `remoting/protocol/driver-api.list` by `tools/driver-list/unimplemented.py`; "
        "`remoting/protocol/tests/unimplemented_doc.rs` fails when this list and the declaration list "
        "disagree (rerun the script after changing a `stub` line).",
        "",
    ]
    for key, title, explanation in THEMES:
        reasons = groups[key]
        if not reasons:
            continue
        count = sum(len(v) for v in reasons.values())
        lines += [f"## {title} ({count})", "", explanation, ""]
        for why, names in reasons.items():
            lines += [f"### {why[0].upper()}{why[1:]}", ""]
            lines += [f"- `{n}`" for n in names]
            lines.append("")
    return "\n".join(lines)


def main():
    text = render()
    if "--check" in sys.argv:
        if DOC.read_text() != text:
            print(f"{DOC} is out of date: run {sys.argv[0]}", file=sys.stderr)
            sys.exit(1)
        return
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
