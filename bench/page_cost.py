"""What touching fresh memory costs on this machine: a tensor filled while the
process reuses memory it just freed (warm pages), and once the process holds
more than it ever did (pages the system must hand over; on a VM with free page
reporting, from the host). bench/README.md, "What the time of a call means".

    python bench/page_cost.py [--mb 400] [--steps 24]

Each step fills a fresh ``--mb`` MB tensor and frees it; every other step the
tensor is kept instead, so the next fill needs memory the process never held.
Prints seconds and microseconds per 4 KiB page for each step.
"""

from __future__ import annotations

import argparse
import time

import torch


def fill_seconds(mb: int) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    x = torch.empty(mb * 2**20 // 4)
    x.fill_(1.0)
    return x, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--steps", type=int, default=24)  # up to 4.8 GB held: past what is warm
    args = p.parse_args()
    torch.set_num_threads(1)
    held = []
    pages = args.mb * 2**20 / 4096
    for step in range(args.steps):
        x, seconds = fill_seconds(args.mb)
        print(
            f"fill {args.mb} MB, holding {args.mb * len(held)} MB: {seconds:.3f} s, {seconds / pages * 1e6:.2f} us/page"
        )
        if step % 2 == 0:
            held.append(x)
        del x


if __name__ == "__main__":
    main()
