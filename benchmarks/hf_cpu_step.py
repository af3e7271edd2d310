"""The Hugging Face swap's CPU training step against transformers' sdpa, side by side in one run.

    python benchmarks/hf_cpu_step.py [--head-dims 32 80] [--steps 10]

A 2-layer Llama built from a config (GQA, 4 heads over 2) trains on one packed row of four
documents (256 tokens, position_ids restarting per document), once with `attn_implementation=
"sdpa"` and once with `varlen_workbench.kernels.hf.register()`, whose `backend="auto"` picks the
`torch` backend on a CPU. Prints the median step time of each and their ratio, per head dim.
Target: the swap within 2x of sdpa.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from varlen_workbench.kernels import hf
from varlen_workbench.kernels.varlen.op import auto_backend

LENGTHS = (40, 90, 30, 96)


def median_step(attn_implementation: str, head_dim: int, steps: int) -> float:
    """Median seconds of forward + backward over `steps` steps, after one warm-up step."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(1, 1000, (1, sum(LENGTHS)))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(input_ids=input_ids, position_ids=position_ids, labels=input_ids).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 80], help="head dims to time")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    args = parser.parse_args()
    ours = hf.register()
    for head_dim in args.head_dims:
        backend = auto_backend(torch.device("cpu"), torch.float32, head_dim)
        sdpa, swap = (median_step(impl, head_dim, args.steps) for impl in ("sdpa", ours))
        print(
            f"head_dim {head_dim}: sdpa {sdpa * 1e3:.1f} ms, {ours} (auto: {backend}) {swap * 1e3:.1f} ms, "
            f"ratio {swap / sdpa:.2f}x (target < 2x)"
        )


if __name__ == "__main__":
    main()
