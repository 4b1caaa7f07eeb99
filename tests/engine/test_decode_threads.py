"""The thread count of decode steps, chosen by timing both counts (engine.native.compute.threads.DecodeThreads)."""

from __future__ import annotations

from ragspeed.engine.native.compute.threads import DecodeThreads


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(choice: DecodeThreads, batch: int, seconds: dict[int, float], steps: int, clock: Clock) -> list[int]:
    """`steps` decode steps of `batch`, each taking `seconds[threads]`; the counts picked."""
    picked = []
    for _ in range(steps):
        threads = choice.pick(batch, 2)
        choice.observe(batch, threads, seconds[threads])
        clock.now += seconds[threads]
        picked.append(threads)
    return picked


def test_both_counts_are_timed_then_the_faster_is_used() -> None:
    clock = Clock()
    choice = DecodeThreads(clock=clock)
    picked = run(choice, 1, {2: 0.009, 1: 0.005}, 2 * DecodeThreads.WARMUP + 50, clock)
    warmup = picked[: 2 * DecodeThreads.WARMUP]
    assert sorted(warmup) == [1] * DecodeThreads.WARMUP + [2] * DecodeThreads.WARMUP
    assert set(picked[2 * DecodeThreads.WARMUP :]) == {1}


def test_batch_sizes_are_chosen_apart() -> None:
    clock = Clock()
    choice = DecodeThreads(clock=clock)
    run(choice, 1, {2: 0.009, 1: 0.005}, 20, clock)
    run(choice, 16, {2: 0.027, 1: 0.037}, 20, clock)
    assert choice.pick(1, 2) == 1
    assert choice.pick(16, 2) == 2
    assert choice.pick(31, 2) == 2  # 16 to 31 decodes share a bucket
    picked = run(choice, 4, {2: 0.012, 1: 0.012}, 2 * DecodeThreads.WARMUP, clock)
    assert (
        sorted(picked) == [1] * DecodeThreads.WARMUP + [2] * DecodeThreads.WARMUP
    )  # a new one: timed afresh


def test_the_slower_count_is_timed_again_and_a_change_of_load_is_followed() -> None:
    clock = Clock()
    choice = DecodeThreads(explore_s=1.0, clock=clock)
    run(choice, 1, {2: 0.009, 1: 0.005}, 20, clock)
    picked = run(choice, 1, {2: 0.009, 1: 0.005}, 1000, clock)  # 5 s of steps
    assert 4 <= picked.count(2) <= 6  # about once a second
    # The other process that slowed two threads is gone: two become the faster.
    picked = run(choice, 1, {2: 0.003, 1: 0.005}, 4000, clock)
    assert picked[-100:] == [2] * 100


def test_one_thread_is_one_thread() -> None:
    choice = DecodeThreads()
    assert [choice.pick(batch, 1) for batch in (1, 8, 64)] == [1, 1, 1]
