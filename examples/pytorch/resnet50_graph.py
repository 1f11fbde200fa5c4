"""ResNet-50 inference captured once into a CUDA graph (torch.cuda.CUDAGraph) and replayed.

    python3 examples/pytorch/resnet50_graph.py [--dtype fp32|fp16] [--iters 20]

Same model, weights and input as resnet50.py, and the same result lines (a replay must give what the eager
model gives), then whether the replay equals this process's eager output, and perf: lines (one replay plus a
synchronisation each).
"""

import argparse
import time

import common  # noqa: F401
import torch

from resnet50 import build


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.dtype]

    model, x = build(dtype, "cuda")
    static_in = x.clone()
    with torch.inference_mode():
        eager = model(x)
        # Warm up on a side stream (lazy initialisation, cuDNN/cuBLAS handles) before capturing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(static_in)
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        common.first_result()
        print(f"resnet50 {args.dtype} batch 1, CUDA graph replay")
        common.report("logits", static_out)
        print(f"top5 {static_out.float().topk(5).indices.tolist()[0]}")
        print(f"replay equals eager: {'yes' if torch.equal(static_out, eager) else 'no'}")
        first = static_out.clone()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"replays identical: {'yes' if torch.equal(static_out, first) else 'NO'}")
    common.perf(f"resnet50_graph {args.dtype} replay latency", times)


if __name__ == "__main__":
    main()
