"""The stall watchdog's rules on a clock made by hand (no thread, no training): the pace it
learns, the bound, pauses left out, one report a stall, the resume told with its length."""

from __future__ import annotations

from spikewatch.trainer.core.watchdog import StallConfig, Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dog(**cfg) -> tuple[Watchdog, Clock, list, list]:
    clock, stalls, resumes = Clock(), [], []
    w = Watchdog(StallConfig(**cfg), stalls.append, resumes.append, clock=clock)
    w._last = clock()  # as `start` does, without its thread
    return w, clock, stalls, resumes


def steps(w: Watchdog, clock: Clock, n: int, seconds: float, first: int = 1) -> None:
    for s in range(first, first + n):
        clock.now += seconds
        w.beat(s)


def test_no_judgement_before_the_pace_is_known() -> None:
    w, clock, stalls, _ = dog(min_s=1.0, warmup_steps=5)
    steps(w, clock, 4, 0.1)
    clock.now += 100.0
    assert w.bound() is None and w.check() is None and stalls == []


def test_a_stall_is_reported_once_past_the_bound_and_its_end_is_told() -> None:
    w, clock, stalls, resumes = dog(min_s=2.0, factor=10.0)
    steps(w, clock, 10, 0.5)  # median 0.5 s: bound max(2, 10 x 0.5) = 5 s
    assert w.bound() == 5.0
    clock.now += 4.9
    assert w.check() is None
    clock.now += 0.2
    info = w.check()
    assert info is not None and info["step"] == 10 and info["idle_s"] == 5.1
    clock.now += 30.0
    assert w.check() is None  # one report a stall, not one a wake
    steps(w, clock, 1, 1.0, first=11)
    (stall,) = stalls
    assert stall is info and "test_a_stall_is_reported_once" in stall["loop_stack"]
    assert resumes == [{"step": 11, "stalled_s": 36.1, "after_step": 10}]


def test_the_floor_holds_for_fast_steps() -> None:
    w, clock, stalls, _ = dog(min_s=120.0, factor=10.0)
    steps(w, clock, 20, 0.01)
    clock.now += 119.0
    assert w.check() is None and w.bound() == 120.0


def test_paused_work_is_neither_a_stall_nor_part_of_the_pace() -> None:
    """A 60 s checkpoint between steps of 1 s: no stall, and the step after it counts 1 s."""
    w, clock, stalls, _ = dog(min_s=5.0, factor=10.0)
    steps(w, clock, 10, 1.0)
    with w.paused():
        clock.now += 60.0
        assert w.check() is None  # while it lasts
    clock.now += 1.0
    w.beat(11)
    assert stalls == [] and list(w.durations)[-1] == 1.0
    clock.now += 10.5  # a real stall after it is still seen
    assert w.check() is not None


def test_a_slowdown_is_told_once_and_its_end_once() -> None:
    """100 steps of 1 s, 50 of 2 s, then 1 s again: the median of the last 16 passes 1.5x the
    baseline at the 9th slow step (step 109), is told once that has lasted 30 s (15 steps of 2
    s: step 123) and is back within 1.2x at the 9th fast one (step 159)."""
    slow, back = [], []
    clock = Clock()
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_slowdown=slow.append, on_pace_back=back.append)  # fmt: skip
    w._last = clock()
    steps(w, clock, 100, 1.0)
    steps(w, clock, 50, 2.0, first=101)
    steps(w, clock, 30, 1.0, first=151)
    assert slow == [{"step": 123, "since_step": 109, "lasted_s": 30.0, "recent_s": 2.0,
                     "baseline_s": 1.0, "ratio": 2.0}]  # fmt: skip
    assert back == [{"step": 159, "since_step": 109, "recent_s": 1.0, "baseline_s": 1.0}]


def test_a_slowdown_of_a_millisecond_is_not_told() -> None:
    """Steps of 1.3 ms that take 2.1 ms for a while (a clean toy run on a busy machine did):
    1.6x, but 0.8 ms a step is the machine's noise, below the 5 ms floor. Steps of 100 ms that
    take 160 ms (for 300 steps: past the 30 s a slowdown must last) are told."""
    for base, slow_s, told in ((0.0013, 0.0021, False), (0.1, 0.16, True)):
        slow: list = []
        clock = Clock()
        w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                     on_slowdown=slow.append)  # fmt: skip
        w._last = clock()
        steps(w, clock, 100, base)
        steps(w, clock, 300, slow_s, first=101)
        assert bool(slow) is told, (base, slow)


def test_the_pace_is_judged_per_token_where_the_steps_tokens_are_told() -> None:
    """A sequence-length ramp: 100 steps of 4,096 tokens at 0.1 s, then 8,192 tokens at 0.2 s:
    each step twice as long, the same tokens a second, no slowdown. Then the same 8,192
    tokens at 0.4 s: half the tokens a second, told once it has lasted 30 s, in tokens a
    second."""
    slow: list = []
    clock = Clock()
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_slowdown=slow.append)  # fmt: skip
    w._last = clock()
    for s, (n, tokens, seconds) in enumerate([(100, 4096, 0.1), (60, 8192, 0.2), (100, 8192, 0.4)]):
        for i in range(n):
            clock.now += seconds
            w.beat(1000 * s + i, tokens)
        if s < 2:
            assert slow == [], (s, slow)
    (told,) = slow
    assert told["step"] == 2082 and told["since_step"] == 2008 and told["ratio"] == 2.0
    assert told["tokens_per_s"] == 20480.0 and told["baseline_tokens_per_s"] == 40960.0
    assert told["recent_s"] == 0.4 and told["baseline_s"] == 0.2  # at this step's tokens


def test_no_slowdown_over_10000_noisy_clean_steps() -> None:
    """Step times jittering by 20% (log-normal) around 1 s for 10,000 steps: no slowdown."""
    import random

    rng = random.Random(0)
    slow = []
    clock = Clock()
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_slowdown=slow.append)  # fmt: skip
    w._last = clock()
    for s in range(1, 10_001):
        clock.now += rng.lognormvariate(0.0, 0.2)
        w.beat(s)
    assert slow == []


def test_bursts_of_a_busy_machine_are_no_slowdown_a_lasting_one_is() -> None:
    """Steps of 50 ms on a shared machine: every 24 s a neighbour's job slows 60 of them to
    120 ms (7 s), enough to move the 16-step median past 1.5x for 6 s at a time, 30 such
    bursts: none is told (each would be, at the burst's 8th step, had a slowdown not to last).
    Then the same slowness for a minute: told once, 30 s after the median moved."""
    for lasting, bursts_told in ((30.0, 0), (0.0, 30)):
        slow: list = []
        clock = Clock()
        w = Watchdog(StallConfig(slowdown_lasting_s=lasting), lambda i: None, lambda i: None,
                     clock=clock, on_slowdown=slow.append)  # fmt: skip
        w._last = clock()
        step = 1
        for _ in range(30):
            steps(w, clock, 340, 0.05, first=step)  # 17 s of the run's own pace
            steps(w, clock, 60, 0.12, first=step + 340)  # 7 s, a burst
            step += 400
        assert len(slow) == bursts_told, (lasting, len(slow))
        steps(w, clock, 340, 0.05, first=step)
        steps(w, clock, 500, 0.12, first=step + 340)  # a minute
        if lasting:
            (told,) = slow
            assert told["since_step"] == step + 347 and 30.0 <= told["lasted_s"] <= 30.12


def test_a_slowdown_near_the_bar_lasts_until_the_pace_is_back() -> None:
    """Steps of 1 s, then a slowdown that hovers at the bar: 12 steps of 1.6 s and 10 of 1.35
    s in turn. The 16-step median crosses 1.5x, then dips to 1.35x for a few steps each cycle:
    still slow (a slowdown lasts until the median is back within 1.2x, as a told one ends), so
    it is told once 30 s have passed, not started afresh at every dip."""
    slow: list = []
    clock = Clock()
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_slowdown=slow.append)  # fmt: skip
    w._last = clock()
    steps(w, clock, 100, 1.0)
    step = 101
    for _ in range(6):
        steps(w, clock, 12, 1.6, first=step)
        steps(w, clock, 10, 1.35, first=step + 12)
        step += 22
    (told,) = slow
    assert told["since_step"] == 109 and 30.0 <= told["lasted_s"] < 31.6, told


def test_the_heartbeat_is_told_once_a_period_stalled_or_not() -> None:
    """The heartbeat is the process's, not the steps': it goes on through a stall (a stuck
    run is stalled, not gone) and comes once per period however often the watchdog wakes."""
    beats: list = []
    clock = Clock()
    cfg = StallConfig(min_s=1.0, heartbeat_s=10.0)
    w = Watchdog(cfg, lambda i: None, lambda i: None, on_heartbeat=beats.append, clock=clock)
    w._last = clock()
    for _ in range(35):  # 35 wakes a second apart, no step ending: a stall past the bound
        w.heartbeat()
        w.check()
        clock.now += 1.0
    assert beats == [{"period_s": 10.0}] * 4  # at 0, 10, 20 and 30 s
    off = Watchdog(StallConfig(heartbeat_s=None), lambda i: None, lambda i: None,
                   on_heartbeat=beats.append, clock=clock)  # fmt: skip
    off.heartbeat()
    assert len(beats) == 4


class _Store:
    """torch.distributed's store, as the watchdog uses it: set, check, get."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key]


def test_a_stall_names_the_ranks_the_others_wait_for() -> None:
    """Each rank publishes (step, phase); a stall reads them all. The loop thread only marks
    its phase; publishing is the watchdog thread's, and only when the progress changed."""
    from spikewatch.trainer.core.watchdog import BEGUN, GATED, RankBeats, behind, ranks_said

    shared = _Store()
    clock, stalls = Clock(), []
    w = Watchdog(StallConfig(min_s=1.0), stalls.append, lambda i: None, clock=clock,
                 ranks=RankBeats(shared, 0, 3))  # fmt: skip
    w._last = clock()
    steps(w, clock, 10, 0.05)
    RankBeats(shared, 1, 3).publish((10, GATED))  # rank 1 at step 10's gate
    RankBeats(shared, 2, 3).publish((10, 0))  # rank 2 never got its next batch
    w.mark(11, GATED)
    clock.now += 5.0
    (info,) = [w.check()]
    assert info["behind"] == [2] and info["ranks"] == {"0": [11, 2], "1": [10, 2], "2": [10, 0]}
    assert behind({0: (11, BEGUN), 1: (11, BEGUN)}) == []  # all alike: none named
    assert ranks_said({0: (11, GATED), 1: (10, 0)}, [1]) == (
        "rank 1 behind (step 10 ended; the others at step 11, at the gate)"
    )


def test_a_rank_whose_batches_keep_the_others_waiting_is_named_once() -> None:
    """Three ranks publish their median wait for their batches; rank 0 judges once a wake.
    Rank 2 waits 60 ms a step where the others wait 2 ms: named after three wakes running,
    once, with its wait and the others'; back within 1.2x, a later straggler is told anew. A
    rank 1.4x slower, or 2x slower by a millisecond, is not named."""
    from spikewatch.trainer.core.watchdog import BEGUN, RankBeats, straggler

    shared = _Store()
    clock, told = Clock(), []
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_straggler=told.append, ranks=RankBeats(shared, 0, 3))  # fmt: skip
    w._last = clock()
    for s in range(1, 17):  # rank 0's own waits, timed by its loop thread's marks
        clock.now += 0.002
        w.mark(s, BEGUN)
        clock.now += 0.05
        w.beat(s)
    w.publish()
    assert shared.kv["spikewatch/pace/0"] == b"0.002"
    RankBeats(shared, 1, 3).publish_pace(0.0021)
    RankBeats(shared, 2, 3).publish_pace(0.06)
    assert [w.judge_ranks() for _ in range(3)][:2] == [None, None]  # two wakes: not yet
    (info,) = told
    assert info["rank"] == 2 and info["batch_wait_s"] == 0.06
    assert info["others_batch_wait_s"] == 0.00205
    assert w.judge_ranks() is None and len(told) == 1  # once an episode
    RankBeats(shared, 2, 3).publish_pace(0.0022)  # back in step
    w.judge_ranks()
    RankBeats(shared, 1, 3).publish_pace(0.05)  # another rank falls behind
    for _ in range(3):
        w.judge_ranks()
    assert [i["rank"] for i in told] == [2, 1]
    assert straggler({0: 0.010, 1: 0.014}, 1.5, 0.005) is None  # 1.4x
    assert straggler({0: 0.001, 1: 0.002}, 1.5, 0.005) is None  # 2x, a millisecond
    assert straggler({0: 0.001}, 1.5, 0.005) is None  # one rank


def test_a_rank_slow_in_its_forward_is_named_by_it_when_its_batches_keep_pace() -> None:
    """Each rank times its forwards (batch in hand to the forward's end, `forward_ended`) and
    publishes their median: rank 1's take 60 ms where the others take 10, its batches as
    fast as theirs. Rank 0 names it after three wakes, by its forward, once."""
    from spikewatch.trainer.core.watchdog import BEGUN, RankBeats

    shared = _Store()
    clock, told = Clock(), []
    w = Watchdog(StallConfig(), lambda i: None, lambda i: None, clock=clock,
                 on_straggler=told.append, ranks=RankBeats(shared, 0, 3))  # fmt: skip
    w._last = clock()
    for s in range(1, 17):
        clock.now += 0.002
        w.mark(s, BEGUN)
        clock.now += 0.01
        w.forward_ended()
        clock.now += 0.04
        w.forward_ended()  # a second forward of the step (a micro-batch): not timed
        w.beat(s)
    w.publish()
    assert shared.kv[f"{RankBeats.FORWARD}0"] == b"0.01"
    for r, forward in ((1, 0.06), (2, 0.011)):
        RankBeats(shared, r, 3).publish_pace(0.002)
        RankBeats(shared, r, 3).publish_pace(forward, RankBeats.FORWARD)
    for _ in range(4):
        w.judge_ranks()
    (info,) = told
    assert (info["rank"], info["slow_in"], info["forward_s"]) == (1, "forward", 0.06)
    assert info["others_forward_s"] == 0.0105


def test_the_ranks_pace_is_read_in_two_store_calls_once_every_rank_has_published() -> None:
    from spikewatch.trainer.core.watchdog import RankBeats

    class Counted(_Store):
        calls = 0

        def check(self, keys: list[str]) -> bool:
            Counted.calls += 1
            return super().check(keys)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            Counted.calls += 1
            return [self.kv[k] for k in keys]

    shared = Counted()
    beats = [RankBeats(shared, r, 64) for r in range(64)]
    for b in beats[:63]:
        b.publish_pace(0.001)
    assert beats[0].read_pace() == {}  # rank 63 has not published yet
    beats[63].publish_pace(0.05)
    Counted.calls = 0
    pace = beats[0].read_pace()
    assert Counted.calls == 2 and len(pace) == 64 and pace[63] == 0.05


def test_the_last_gradient_is_learnt_on_the_first_backward_and_its_hook_alone_kept() -> None:
    """Under torchrun each rank times its backward to its last gradient (`LastGrad`): on the
    first backward every parameter's hook notes the order; once a forward shows that backward
    done (`settle`), the hook of the last parameter alone stays, one call a backward."""
    import torch

    from spikewatch.trainer.core.watchdog import LastGrad

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 2))
    calls: list[int] = []
    last = LastGrad(model.parameters(), lambda: calls.append(1))
    model(torch.tensor([1, 2])).sum().backward()
    assert len(calls) == 3  # learning: every parameter's gradient
    assert last._order[-1] == id(model[0].weight)  # the embedding's comes last
    last.settle()
    assert list(last._handles) == [id(model[0].weight)]
    calls.clear()
    model(torch.tensor([3])).sum().backward()
    assert calls == [1]
    last.remove()
    model(torch.tensor([3])).sum().backward()
    assert calls == [1]


def test_a_rank_late_at_the_collectives_is_the_straggler_under_fsdp2() -> None:
    """FSDP2: every rank waits inside the all-gathers and reduce-scatters for the slowest, so
    only when each reaches them tells the straggler. Each rank publishes its enqueue times
    summed over blocks of the same collectives (`arrival_blocks`, from torch's flight
    recorder); rank 0 reads every rank's, and a rank later by 5 ms a step or more, and by more
    than half the rest of the step, in three blocks running, is told once, by its lateness."""
    from spikewatch.trainer.core.watchdog import RankBeats, late_arrival

    ms = 1_000_000
    shared = _Store()
    clock, told = Clock(), []
    w = Watchdog(StallConfig(min_s=1.0), lambda i: None, lambda i: None, clock=clock,
                 on_straggler=told.append, ranks=RankBeats(shared, 0, 3))  # fmt: skip
    w.arrivals = True
    w._last = clock()
    steps(w, clock, 20, 0.1)  # steps of 100 ms: a block of 128 collectives spans 10 of them

    def publish(blocks: range, late_ms: dict[int, float]) -> None:
        for rank in range(3):  # a block spans 1 s, 10 steps: late_ms[r] later in each
            RankBeats(shared, rank, 3).publish_arrivals({
                f"0:{b}": [128 * b * 100 * ms + int(late_ms.get(rank, 0.0) * ms * 10),
                           1000 * ms] for b in blocks
            })  # fmt: skip

    publish(range(1, 4), {})  # in step: no one told
    assert w.judge_ranks() is None and told == []
    publish(range(2, 5), {2: 40.0})  # rank 2 40 ms late a step (its 100 ms against 60): 4 ...
    assert w.judge_ranks() is None  # one block only
    publish(range(5, 8), {2: 40.0})  # ... 5, 6, 7: three running
    info = w.judge_ranks()
    assert info is not None and told == [info]
    assert info["rank"] == 2 and info["slow_in"] == "arrival"
    assert abs(info["late_s"] - 0.04) < 1e-6 and info["others_late_s"] == 0.0
    publish(range(8, 11), {2: 40.0})
    assert w.judge_ranks() is None and len(told) == 1  # once
    publish(range(11, 14), {})  # in step again: it may be told anew later
    assert w.judge_ranks() is None and w._straggler is None
    # a rank 3 ms late a step (under the 5 ms floor) is no straggler
    assert late_arrival({0: {"0:1": [0, 10**9]}, 1: {"0:1": [0, 10**9]}}, 0.1) == [
        (1, {0: 0.0, 1: 0.0})
    ]
    publish(range(14, 20), {1: 3.0})
    assert w.judge_ranks() is None and len(told) == 1
