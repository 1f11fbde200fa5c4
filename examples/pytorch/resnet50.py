"""torchvision ResNet-50 inference, batch 1, random weights from a fixed seed.

    python3 examples/pytorch/resnet50.py [--dtype fp32|fp16] [--iters 20] [--warmup 5] [--device cuda]

stdout: the output logits exactly (see common.py), then perf: lines (per-inference latency after warm-up,
each including a device synchronisation).
"""

import argparse
import time

import common  # noqa: F401  (sets CUBLAS_WORKSPACE_CONFIG before torch loads)
import torch
import torchvision


def build(dtype, device):
    common.deterministic(torch)
    model = torchvision.models.resnet50(weights=None)  # random init on the CPU: identical everywhere
    model = model.eval().to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1, 3, 224, 224, generator=g).to(device=device, dtype=dtype)
    return model, x


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.dtype]

    model, x = build(dtype, args.device)
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"resnet50 {args.dtype} batch 1 on {args.device}: {params} parameter bytes")
    with torch.inference_mode():
        out = model(x)
        sync(args.device)
        common.first_result()
        common.report("logits", out)
        print(f"top5 {out.float().topk(5).indices.tolist()[0]}")
        for _ in range(args.warmup):
            model(x)
        sync(args.device)
        times = []
        last = None
        # CPU time beside the latency: the calling thread's (Python, PyTorch and the driver's work on
        # it) and the whole process's (the driver's own threads too), to tell a CPU-bound step from one
        # that waits.
        thread0, process0 = time.thread_time(), time.process_time()
        for _ in range(args.iters):
            t0 = time.perf_counter()
            last = model(x)
            sync(args.device)
            times.append(time.perf_counter() - t0)
        thread_cpu, process_cpu = time.thread_time() - thread0, time.process_time() - process0
    print(f"repeat identical: {'yes' if torch.equal(last, out) else 'NO'}")
    common.perf(f"resnet50 {args.dtype} latency", times)
    common.perf(f"resnet50 {args.dtype} calling thread's cpu per step", value=thread_cpu * 1e3 / args.iters)
    common.perf(f"resnet50 {args.dtype} process cpu per step", value=process_cpu * 1e3 / args.iters)


if __name__ == "__main__":
    main()
