"""The stage clock charges each stage its own code's time, not the stages it hands on to."""

from __future__ import annotations

from loadtest.stage_cpu import StageClock, clocked


class Timer:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_stage_is_charged_before_it_hands_on_and_after_the_rest_returns():
    timer = Timer()
    clock = StageClock(timer)

    class Front:
        async def __call__(self, ctx, call_next):
            timer.now += 1  # before handing on
            answer = await call_next(ctx)
            timer.now += 2  # after the rest returned
            return answer

    class Back:
        async def __call__(self, ctx, call_next):
            timer.now += 4
            return await call_next(ctx)

    class Endpoint:
        async def __call__(self, ctx):
            timer.now += 8
            return "answer"

    clocked(Front, "front", clock)
    clocked(Back, "back", clock)
    clocked(Endpoint, "endpoint", clock, endpoint=True)
    front, back, endpoint = Front(), Back(), Endpoint()

    async def to_back(ctx):
        return await back(ctx, endpoint)

    timer.now += 16  # the server's own work, before the first stage
    assert await front(None, to_back) == "answer"
    clock.enter("outside")
    assert clock.cpu == {"outside": 16, "front": 3, "back": 4, "endpoint": 8}
