"""GPT-2 small (transformers, from GPT2Config(), random weights from a fixed seed): greedy generation of N
tokens after a fixed prompt of token ids (no tokenizer, no download).

    python3 examples/pytorch/gpt2.py [--dtype fp32|fp16] [--new-tokens 16] [--prompt-len 32] [--device cuda]

stdout: the generated token ids, a checksum of every step's logits (see common.py), then perf: lines
(tokens per second of a timed generation after a warm-up one).
"""

import argparse
import statistics
import time

import common  # noqa: F401
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model, prompt, new_tokens):
    """Greedy decoding with the KV cache: returns the new token ids and each step's last-position logits."""
    ids = prompt
    past = None
    tokens, logits = [], []
    for _ in range(new_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        step = out.logits[:, -1, :]
        nxt = step.argmax(dim=-1, keepdim=True)
        logits.append(step)
        tokens.append(nxt)
        ids = nxt
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3, help="timed generations (the median is reported)")
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.dtype]

    common.deterministic(torch)
    config = GPT2Config()
    model = GPT2LMHeadModel(config)  # random init on the CPU from the fixed seed
    model = model.eval().to(device=args.device, dtype=dtype)
    g = torch.Generator().manual_seed(4321)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=g).to(args.device)
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"gpt2 {args.dtype} on {args.device}: {params} parameter bytes, prompt {prompt[0, :8].tolist()}...")

    with torch.inference_mode():
        tokens, logits = generate(model, prompt, args.new_tokens)
        sync(args.device)
        common.first_result()
        print(f"generated {tokens[0].tolist()}")
        common.report("step_logits", logits)
        # The median of a few timed generations (one is at the mercy of a single hiccup), with the
        # calling thread's CPU time beside it: a step bound by Python and PyTorch on that thread shows
        # a CPU time close to its latency.
        times, identical = [], True
        thread0 = time.thread_time()
        for _ in range(max(args.repeats, 1)):
            t0 = time.perf_counter()
            again, _ = generate(model, prompt, args.new_tokens)
            sync(args.device)
            times.append(time.perf_counter() - t0)
            identical = identical and torch.equal(again, tokens)
        thread_cpu = (time.thread_time() - thread0) / len(times)
    print(f"repeat identical: {'yes' if identical else 'NO'}")
    elapsed = statistics.median(times)
    common.perf(f"gpt2 {args.dtype} tokens_per_s", value=args.new_tokens / elapsed, unit="tokens/s")
    common.perf(f"gpt2 {args.dtype} per_token", value=elapsed / args.new_tokens * 1000.0, unit="ms")
    common.perf(
        f"gpt2 {args.dtype} calling thread's cpu per token", value=thread_cpu / args.new_tokens * 1000.0
    )


if __name__ == "__main__":
    main()
