"""GPU check: pinned + non_blocking transfer in the DataModule's hook vs unpinned, and how much copy is hidden.

What is measured (one CUDA device, side by side in one run, median of several rounds):
- ``compute``: the per-step compute alone (a stack of matmuls sized to take a few ms), batches already on GPU.
- ``copy``: the host-to-device copy of one batch alone, from pageable and from pinned memory.
- ``unpinned``: a training-like loop — the loader hands out a pageable batch, it is moved with a blocking
  ``.to(device)``, then compute runs.
- ``pinned``: the lightning_d9d path — the loader pins the batch (``pin_batch``), the transfer hook
  (``D9DDataModule.transfer_batch_to_device`` → ``move_batch_to_device``) queues a ``non_blocking`` copy.
- ``hidden`` = 1 − (step_time − compute) / copy: the share of the copy's cost that the step does not pay.

Without a CUDA device the script says so and exits 0 (nothing to measure on CPU: the hook is a pass-through).

Run: ``python benchmarks/gpu_transfer.py [--microbatch 8 --seq-len 4096 --steps 50]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from lightning_d9d import D9DDataModule, pin_batch


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def make_batches(count: int, microbatch: int, seq_len: int) -> list[Batch]:
    def one() -> Batch:
        ids = torch.randint(0, 50_000, (microbatch, seq_len))
        return Batch(ids, torch.ones(microbatch, seq_len, dtype=torch.int64), ids.clone())

    return [one() for _ in range(count)]


def check_loader_pins_dataclasses(microbatch: int, seq_len: int) -> None:
    """The DataModule's loader (workers + torch's pin thread) hands out dataclass batches in pinned memory."""
    samples = [torch.randint(0, 50_000, (seq_len,)) for _ in range(4 * microbatch)]

    def collate(rows: list[torch.Tensor]) -> Batch:
        ids = torch.stack(rows)
        return Batch(ids, torch.ones_like(ids), ids.clone())

    for workers in (0, 2):
        dm = D9DDataModule(
            samples, collate, global_batch_size=microbatch, microbatch_size=microbatch, num_workers=workers
        )
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        pinned = [t.is_pinned() for t in dataclasses.astuple(batch)]
        print(f"loader with num_workers={workers}: {type(batch).__name__} tensors pinned: {pinned}")
        assert isinstance(batch, Batch) and all(pinned)


def timed(fn, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096, help="matmul size of the simulated compute")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (on CPU the transfer hook is a pass-through). Run on a GPU machine.")
        return
    device = torch.device("cuda")
    check_loader_pins_dataclasses(args.microbatch, args.seq_len)
    hook = D9DDataModule(list(range(8)), global_batch_size=8, microbatch_size=8).transfer_batch_to_device
    weight = torch.randn(args.hidden, args.hidden, device=device)
    batches = make_batches(args.steps, args.microbatch, args.seq_len)
    pinned = [pin_batch(batch) for batch in batches]
    on_device = [hook(batch, device, 0) for batch in pinned]
    bytes_per_batch = sum(t.numel() * t.element_size() for t in dataclasses.astuple(batches[0]))

    def compute(batch: Batch) -> torch.Tensor:
        x = weight[: args.microbatch].float() + batch.input_ids[:, :1].float()
        for _ in range(8):
            x = torch.tanh(x @ weight)
        return x.sum()

    def loop_compute() -> None:
        for batch in on_device:
            compute(batch)

    def loop_unpinned() -> None:
        for batch in batches:
            compute(Batch(*(t.to(device) for t in dataclasses.astuple(batch))))

    def loop_pinned() -> None:
        for batch in pinned:
            compute(hook(batch, device, 0))

    def copy_pageable() -> None:
        for batch in batches:
            for t in dataclasses.astuple(batch):
                t.to(device)

    def copy_pinned() -> None:
        for batch in pinned:
            hook(batch, device, 0)

    results: dict[str, list[float]] = {}
    loops = {
        "compute": loop_compute,
        "copy pageable": copy_pageable,
        "copy pinned": copy_pinned,
        "unpinned step": loop_unpinned,
        "pinned step": loop_pinned,
    }
    for fn in loops.values():  # warm up kernels and the pinned allocator
        timed(fn, device)
    for _ in range(args.rounds):
        for name, fn in loops.items():  # interleaved, so drift hits every variant alike
            results.setdefault(name, []).append(timed(fn, device) / args.steps * 1e3)
    ms = {name: statistics.median(values) for name, values in results.items()}
    print(f"device: {torch.cuda.get_device_name(device)}; batch {bytes_per_batch / 2**20:.1f} MiB")
    for name, value in ms.items():
        print(f"{name:>15}: {value:8.3f} ms/step")
    for variant, copy in (("unpinned step", "copy pageable"), ("pinned step", "copy pinned")):
        hidden = 1 - (ms[variant] - ms["compute"]) / ms[copy]
        print(f"{variant:>15}: copy {ms[copy]:.3f} ms, {100 * max(0.0, hidden):.0f} % of it hidden behind compute")
    print(f"pinned vs unpinned step time: {ms['pinned step'] / ms['unpinned step']:.3f}x")
    print(
        f"H2D bandwidth: pageable {bytes_per_batch / ms['copy pageable'] / 1e6:.1f} GB/s, "
        f"pinned {bytes_per_batch / ms['copy pinned'] / 1e6:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
