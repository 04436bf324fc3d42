"""The seconds a fixed CPU workload takes here, printed by .ci/run beside the suites' durations.

Machines of one kind differ by 2-2.5x and CI may share its cores: a suite's seconds mean little without the speed of
the machine that gave them. The work is fixed (what the test suite spends its time on: Python, and small single-thread
torch ops); each part is timed three times and the fastest is kept, so a passing burst of other load counts less.
"""

from __future__ import annotations

import time

import torch


def python_loop() -> None:
    total = 0
    for index in range(2_000_000):
        total += index * index % 7


def small_matmuls() -> None:
    torch.manual_seed(0)
    x = torch.randn(128, 128)
    for _ in range(2_000):
        x = torch.tanh(x @ x * 0.01)


def fastest_of_three(work) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    torch.set_num_threads(1)
    python_s, torch_s = fastest_of_three(python_loop), fastest_of_three(small_matmuls)
    print(
        f"machine speed (fixed work, fastest of 3, lower is faster): python loop {python_s:.2f} s, "
        f"1-thread torch {torch_s:.2f} s"
    )
