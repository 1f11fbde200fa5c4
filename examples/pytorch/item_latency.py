"""Round trip of tensor.item() (a device-to-host copy and synchronisation), and of a tiny launch plus
item(): medians of many.

    python3 examples/pytorch/item_latency.py [--n 1000]
"""

import argparse
import time

import common  # noqa: F401
import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    x = torch.ones(1, device=args.device)
    print(f"item: {x.item()}")
    common.first_result()
    for _ in range(50):
        x.item()
        (x + 1).item()
    item, launch_item = [], []
    for _ in range(args.n):
        t0 = time.perf_counter()
        x.item()
        t1 = time.perf_counter()
        (x + 1).item()
        t2 = time.perf_counter()
        item.append(t1 - t0)
        launch_item.append(t2 - t1)
    print(f"launch+item: {(x + 1).item()}")
    common.perf("item round trip", item)
    common.perf("launch + item round trip", launch_item)


if __name__ == "__main__":
    main()
