"""Times flash-linear-attention's chunk_simple_gla (Triton) on the lightning layer's shapes,
for the side-by-side with `sala bench --kernel lightning` (issue 4). Same inputs as ours:
batch 1, 32 heads of 128, bf16 q/k/v, head-wise constant decay g = -slope (ALiBi, SPEC 4.3),
scale 1/sqrt(128), an fp32 initial state and the final state returned. Prints one JSON line
per context with the median of `--repeat` timed runs (CUDA events) after one warm-up, and
TFLOP/s by the count of `lightning_flops` in crates/sala/src/bench.rs.

Usage: python3 scripts/fla_bench.py 8192 65536 [--repeat 10]
"""
import argparse
import json
import math

import torch
from fla.ops.simple_gla import chunk_simple_gla


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("contexts", type=int, nargs="+")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    h, d = args.heads, args.head_dim
    start = 2.0 ** (-(2.0 ** -(math.log2(h) - 3)))
    slopes = torch.tensor([start * start**i for i in range(h)], dtype=torch.float32)
    g_gamma = (-slopes).cuda()
    torch.manual_seed(0)
    for t in args.contexts:
        q = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
        h0 = torch.zeros(1, h, d, d, device="cuda", dtype=torch.float32)

        def run():
            return chunk_simple_gla(
                q, k, v, g_gamma=g_gamma, scale=d**-0.5, initial_state=h0, output_final_state=True
            )

        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        times.sort()
        median = times[len(times) // 2]
        flops = t * h * (4.0 * 64 * d + 4.0 * d * d)
        print(json.dumps({
            "impl": "fla chunk_simple_gla",
            "context": t,
            "median_s": median,
            "tflops": flops / median / 1e12,
            "repeat": args.repeat,
            "torch": torch.__version__,
        }))


if __name__ == "__main__":
    main()
