"""The engine's scheduler on its own (engine/scheduler.py): admission into the lowest free slots
grouped by prompt, the refill rule, compaction (bucketed and eager) and release, on plain numbers:
no model, no tensor."""

from __future__ import annotations

import pytest

from qerl_pipe.engine.scheduler import Scheduler


def _buckets(*sizes: int):
    """batch_size_for over CUDA-graph sizes, as engine.graphs.DecodeRunner gives it."""
    return lambda slots: next((s for s in sizes if s >= slots), slots)


def _eager(slots: int) -> int:
    return slots


def _consistent(s: Scheduler) -> None:
    assert all(s.slot_of(seq) == slot for slot, seq in s.active.items())
    assert not set(s.active.values()) & set(s.queue)


def test_admission_fills_the_lowest_free_slots_and_groups_by_prompt():
    # 3 prompts x 2 samples, prompt-major, on 4 slots.
    s = Scheduler([0, 0, 1, 1, 2, 2], slots=4)
    assert s.busy and s.should_admit()  # nothing decodes: admit
    assert s.admit() == [[(0, 0), (1, 1)], [(2, 2), (3, 3)]]
    assert list(s.queue) == [4, 5] and not s.should_admit()  # no slot free
    _consistent(s)
    s.release([1, 2])  # sequences 1 and 2 finished
    assert s.should_admit()  # 2 free slots take prompt 2's two remaining samples
    assert s.admit() == [[(4, 1), (5, 2)]]
    _consistent(s)
    s.release([0, 1, 2, 3])
    assert not s.busy and not s.should_admit()


def test_a_wave_splits_a_prompt_whose_samples_do_not_all_fit():
    s = Scheduler([0, 0, 0, 1, 1, 1], slots=4)
    assert s.admit() == [[(0, 0), (1, 1), (2, 2)], [(3, 3)]]
    s.release([1])
    # One free slot: prompt 1 still has 2 samples queued, and a quarter of 4 slots is 1.
    assert s.should_admit()
    assert s.admit() == [[(4, 1)]]


def test_refill_waits_for_the_head_prompt_or_a_quarter_of_the_slots():
    # 8 slots: refill_min = 2. Prompt 0 fills them all; prompt 1 (4 samples) waits.
    s = Scheduler([0] * 8 + [1] * 4, slots=8)
    s.admit()
    s.release([5])
    assert not s.should_admit()  # 1 free < min(4 remaining, 2)
    s.release([6])
    assert s.should_admit()  # 2 free
    assert s.admit() == [[(8, 5), (9, 6)]]


def test_bucketed_step_compacts_whenever_a_smaller_size_would_do():
    s = Scheduler(list(range(8)), slots=8)
    s.admit()
    s.release([0, 1, 2, 4, 5])  # live: slots 3, 6, 7 (sequences 3, 6, 7)
    b, moves = s.plan_step(_buckets(1, 2, 4, 8), bucketed=True)
    # 3 live fit size 4: the ones at 6 and 7 move into the lowest holes below it.
    assert (b, moves) == (4, [(6, 0), (7, 1)])
    assert s.active == {0: 6, 1: 7, 3: 3} and s.slot_of(6) == 0
    _consistent(s)
    assert s.plan_step(_buckets(1, 2, 4, 8), bucketed=True) == (4, [])  # nothing left to gain


def test_eager_step_compacts_only_when_half_the_rows_idle():
    s = Scheduler(list(range(8)), slots=8)
    s.admit()
    s.release([0, 1, 2])  # 5 live of 8 rows: no move
    assert s.plan_step(_eager, bucketed=False) == (8, [])
    s.release([3])  # 4 live of 8: the ones above 4 move down
    b, moves = s.plan_step(_eager, bucketed=False)
    assert (b, moves) == (4, [(4, 0), (5, 1), (6, 2), (7, 3)])
    _consistent(s)


def test_the_schedule_is_the_same_for_the_same_events():
    def replay() -> list:
        s = Scheduler([p for p in range(5) for _ in range(3)], slots=6)
        log = []
        finish = iter([[0, 4], [1], [2, 3, 5], [0], [1, 2], [3, 4, 5], [0, 1], [2]])
        while s.busy:
            if s.should_admit():
                log.append(("admit", s.admit()))
                continue
            log.append(("step", s.plan_step(_buckets(1, 2, 4, 8), bucketed=True)))
            done = [slot for slot in next(finish, list(s.active)) if slot in s.active]
            s.release(done or [min(s.active)])
        return log

    assert replay() == replay()


def test_bad_uses_fail_clearly():
    with pytest.raises(ValueError, match="at least one slot"):
        Scheduler([0], slots=0)
    with pytest.raises(ValueError, match="no active sequence"):
        Scheduler([0], slots=1).plan_step(_eager, bucketed=False)
