"""Shared by the PyTorch examples: deterministic settings, result printing, timing, and the /proc/self/maps
report that shows which libcuda the process mapped.

Conventions (scripts/gpu/compare-pytorch.sh relies on them):
* stdout lines are results and must be bit-identical between a local run and a Gleam run on the same GPU,
  except lines starting with "perf:", which carry timings;
* with GLEAM_PRINT_MAPS=1 the process prints, at exit, one "maps: PATH" line on stderr for every mapped
  driver library (libcuda*, libgleamcuda*, libnvidia-*).
"""

import atexit
import hashlib
import os
import re
import statistics
import sys
import time

# Before torch is imported anywhere: cuBLAS needs this for deterministic results with several streams.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

STARTED = time.perf_counter()
# Results survive a crash at exit (in the driver's teardown) even when stdout is a file.
sys.stdout.reconfigure(line_buffering=True)
# The driver (NVIDIA's libcuda.so.1 -> libcuda.so.580..., or Gleam's shim) and NVIDIA's helper libraries;
# not the runtime (libcudart).
DRIVER_LIBRARY = re.compile(r"^(libcuda\.so|libgleamcuda|libnvidia-)")


def _driver_libraries():
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                if DRIVER_LIBRARY.match(base) and path not in found:
                    found.append(path)
    except OSError as err:
        found.append(f"(cannot read /proc/self/maps: {err})")
    return found


def _print_maps():
    libs = _driver_libraries()
    if not libs:
        print("maps: (no driver library mapped)", file=sys.stderr)
    for path in libs:
        print(f"maps: {path}", file=sys.stderr)
    sys.stderr.flush()


if os.environ.get("GLEAM_PRINT_MAPS") == "1":
    atexit.register(_print_maps)


def deterministic(torch, seed=0):
    """Fixed seeds and the deterministic choices PyTorch offers."""
    torch.manual_seed(seed)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def digest(tensor):
    """sha256 of the tensor's bytes (on the CPU, contiguous)."""
    import torch

    t = tensor.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def report(name, tensor, first=5):
    """Prints a result exactly: shape, dtype, its first values (as float.hex), sum in float64, sha256."""
    t = tensor.detach().float().cpu()
    flat = t.reshape(-1)
    values = " ".join(float(v).hex() for v in flat[:first].tolist())
    print(f"{name}: shape {tuple(tensor.shape)} dtype {str(tensor.dtype).replace('torch.', '')}")
    print(f"{name}: first {values}")
    print(f"{name}: first (decimal) {' '.join(f'{v:.9g}' for v in flat[:first].tolist())}")
    print(f"{name}: sum {float(t.double().sum()).hex()} ({float(t.double().sum()):.9g})")
    print(f"{name}: sha256 {digest(tensor)}")
    sys.stdout.flush()


def perf(label, seconds_list=None, value=None, unit="ms"):
    """One timing line; never compared."""
    if seconds_list is not None:
        ms = [s * 1000.0 for s in seconds_list]
        print(
            f"perf: {label} median {statistics.median(ms):.3f} ms mean {statistics.fmean(ms):.3f} ms "
            f"min {min(ms):.3f} ms (n={len(ms)})"
        )
    else:
        print(f"perf: {label} {value:.3f} {unit}")
    sys.stdout.flush()


def first_result():
    """Seconds from interpreter start (this module's import) to now."""
    perf("start_to_first_result", value=time.perf_counter() - STARTED, unit="s")
