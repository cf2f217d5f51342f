"""The vllm-server router's decisions, from metric texts shaped as vLLM's: a group stays on its server while
that server has room, else goes to the least loaded; a lost server gets nothing until it is back; queue
times are counted from the servers' histograms. And the ledger that resubmits a lost server's samples from
the tokens they drew."""

from __future__ import annotations

import pytest
from support.vllm_standin import metrics_text

from treetrain.rollout.engines.generation import Completion, Draft, GenerationRequest
from treetrain.rollout.engines.server_fleet import KV_FULL, PROBE_EVERY_S, Fleet, ServerLoad, read_load
from treetrain.rollout.engines.server_parts import Ledger, part_seed
from treetrain.rollout.sampling import Sampling


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fleet(n: int = 3, capacity: int = 8) -> tuple[Fleet, Clock]:
    clock = Clock()
    return Fleet([f"http://s{i}" for i in range(n)], [capacity] * n, clock=clock), clock


def test_the_metrics_vllm_reports_are_read() -> None:
    load = read_load(metrics_text(running=3, waiting=2, kv=0.5, queue_seconds=1.25, queued=7))
    assert load == ServerLoad(running=3, waiting=2, kv_usage=0.5, queue_seconds=1.25, queued=7)
    two_engines = metrics_text(running=1, kv=0.25) + metrics_text(running=2, kv=0.25).replace('"0"', '"1"')
    assert read_load(two_engines).running == 3 and read_load(two_engines).kv_usage == 0.5


@pytest.mark.parametrize(
    "text",
    ["vllm:num_requests_waiting NaN\n", "vllm:num_requests_waiting -4\n", "vllm:num_requests_waiting inf\n"],
)
def test_numbers_outside_reason_are_left_out(text: str) -> None:
    assert read_load(text).waiting == 0
    assert (
        read_load('vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting{a="b"} 1e308\n').waiting == 1e12
    )
    assert read_load("vllm:kv_cache_usage_perc 7\n").kv_usage == 1.0


def test_text_that_is_not_prometheus_is_refused() -> None:
    for bad in ["<html>not found</html>", "vllm:num_requests_waiting{ 1\n"]:
        with pytest.raises(ValueError):
            read_load(bad)


def test_a_group_stays_on_its_server_while_it_has_room() -> None:
    fleet, _ = _fleet()
    first = fleet.pick("g", 2, in_flight=(0, 0, 0))
    assert first == 0
    busy = [0, 0, 0]
    busy[first] = 6  # others' requests would make it the most loaded: the group stays anyway
    assert fleet.pick("g", 2, in_flight=busy) == first
    busy[first] = 7  # 7 + 2 > 8 sequences: no room, the group moves to the least loaded
    assert fleet.pick("g", 2, in_flight=busy) == 1
    assert fleet.pick("g", 2, in_flight=(7, 0, 0)) == 1  # and stays there


@pytest.mark.parametrize(("metrics", "why"), [({"waiting": 1}, "a queue"), ({"kv": KV_FULL}, "a full KV cache"),
                                              ({"running": 7}, "others' sequences")])  # fmt: skip
def test_a_server_without_room_by_its_metrics_loses_the_group(metrics: dict, why: str) -> None:
    fleet, _ = _fleet(2)
    assert fleet.pick("g", 2, in_flight=(0, 0)) == 0
    fleet.observe(0, read_load(metrics_text(**metrics)))
    assert fleet.pick("g", 2, in_flight=(0, 0)) == 1, why
    fleet.observe(0, read_load(metrics_text()))  # the negative control: room again, but the group moved on
    assert fleet.pick("g", 2, in_flight=(0, 0)) == 1


def test_clients_that_start_at_once_spread_over_idle_servers() -> None:
    """Each trainer rank is a client of its own: on an idle fleet, rank r takes server r (mod the fleet)
    first, where every client would otherwise take server 0; load still decides over the rank."""
    urls, caps = [f"http://s{i}" for i in range(3)], [8] * 3
    firsts = [Fleet(urls, caps, first=rank).pick("g", 2, in_flight=(0, 0, 0)) for rank in range(4)]
    assert firsts == [0, 1, 2, 0]
    assert Fleet(urls, caps).pick("g", 2, in_flight=(0, 0, 0)) == 0  # the control: one order for all
    assert Fleet(urls, caps, first=1).pick("g", 2, in_flight=(0, 2, 0)) == 2  # a loaded server is passed


def test_a_new_group_goes_to_the_least_loaded_server() -> None:
    fleet, _ = _fleet()
    fleet.observe(0, read_load(metrics_text(running=6, kv=0.1)))
    fleet.observe(1, read_load(metrics_text(running=2, kv=0.5)))
    fleet.observe(2, read_load(metrics_text(running=4, kv=0.1)))
    # sequences per slot with the new ones, plus KV use: 0 -> 8/8 + 0.1, 1 -> 4/8 + 0.5, 2 -> 6/8 + 0.1
    assert fleet.pick("new", 2, in_flight=(0, 0, 0)) == 2
    assert fleet.pick("other", 2, in_flight=(0, 0, 8)) == 1  # our own samples in flight count between reads


def test_without_metrics_the_samples_in_flight_decide() -> None:
    fleet, _ = _fleet(2)
    fleet.observe(0, None)  # its /metrics could not be read
    assert [fleet.pick(f"g{i}", 1, in_flight=(i % 2, 1 - i % 2)) for i in range(4)] == [0, 1, 0, 1]


def test_a_lost_server_gets_nothing_until_it_is_back() -> None:
    fleet, clock = _fleet(2)
    assert fleet.pick("g", 1, in_flight=(0, 0)) == 0
    assert fleet.lost(0, "cannot connect") and not fleet.lost(0, "again")  # counted once
    assert fleet.servers_lost == 1 and fleet.alive == (1,)
    assert fleet.pick("g", 1, in_flight=(0, 0)) == 1
    assert fleet.to_read() == [1]  # its metrics are not read either
    assert fleet.to_probe() == []
    clock.now += PROBE_EVERY_S
    assert fleet.to_probe() == [0] and fleet.to_probe() == []  # once per period
    assert fleet.pick("h", 1, in_flight=(0, 5)) == 1  # probed is not back: still no work
    fleet.back(0)
    assert fleet.pick("k", 1, in_flight=(0, 5)) == 0 and fleet.pick("h", 1, in_flight=(0, 5)) == 1  # h stays
    fleet.lost(0, "again")
    fleet.lost(1, "refused")
    assert fleet.servers_lost == 3 and fleet.pick("g", 1, in_flight=(0, 0)) is None


def test_queue_times_count_what_was_queued_since_the_last_read() -> None:
    fleet, clock = _fleet(1)
    fleet.observe(0, read_load(metrics_text(queue_seconds=10.0, queued=4)))  # before the run: a baseline...
    fleet.servers[0].stats = type(fleet.servers[0].stats)("http://s0")  # ...whose history is not counted here
    clock.now += 1
    fleet.observe(0, read_load(metrics_text(queue_seconds=10.5, queued=6)))
    fleet.sent(0, 3)
    stats = fleet.stats()[0]
    assert (stats.requests, stats.samples, stats.queued) == (
        1,
        3,
        2,
    ) and stats.queue_seconds == pytest.approx(0.5)
    clock.now += 1
    fleet.observe(
        0, read_load(metrics_text(queue_seconds=0.25, queued=1))
    )  # restarted: its histogram began again
    assert fleet.stats()[0].queued == 3 and fleet.stats()[0].queue_seconds == pytest.approx(0.75)


def _request(n: int = 2, budget: int = 6, seed: int = 11) -> GenerationRequest:
    return GenerationRequest((5, 6), n, budget, Sampling(), ((2,), (8, 9)), seed=seed, group="g")


def _event(index: int, tokens: list[int], logprobs: list[float], finish: str | None = None) -> dict:
    return {"choices": [{"index": index, "token_ids": tokens, "logprobs": {"token_logprobs": logprobs},
                         "finish_reason": finish}]}  # fmt: skip


def test_a_lost_part_goes_on_from_the_tokens_each_sample_drew() -> None:
    ledger = Ledger()
    part = ledger.open(0, _request(n=3), version=4, adapter=None)
    part.streamed.add(_event(0, [7, 7], [-0.5, -0.25]))
    part.streamed.add(_event(1, [3], [-1.0]))  # sample 2 drew nothing yet
    rest = {p.slots: p for p in ledger.lost(part.pid)}
    assert set(rest) == {(0,), (1,), (2,)}
    assert rest[(0,)].request.context == (5, 6, 7, 7) and rest[(0,)].request.max_new_tokens == 4
    assert rest[(0,)].request.seed == part_seed(11, 0, 2) != rest[(1,)].request.seed
    assert rest[(2,)].request.context == (5, 6) and rest[(2,)].request.n == 1
    ledger.answered(rest[(0,)].pid, (Completion((8, 9), (-0.1, -0.2), "stop", 4),), cached=4)
    ledger.answered(rest[(1,)].pid, (Completion((4, 4, 4, 4, 4), (-0.3,) * 5, "length", 4),), cached=3)
    assert not ledger.complete(0)
    ledger.answered(rest[(2,)].pid, (Completion((2,), (-0.7,), "stop", 4),), cached=2)
    result = ledger.take(0)
    assert [c.tokens for c in result.completions] == [(7, 7, 8, 9), (3, 4, 4, 4, 4, 4), (2,)]
    assert result.completions[0].logprobs == (-0.5, -0.25, -0.1, -0.2)  # the sampler's own, kept
    assert result.completions[0].finish == "stop" and result.cached_tokens == 9
    assert all(c.version == 4 and not c.runs for c in result.completions)


def test_samples_that_drew_nothing_are_resent_as_they_were() -> None:
    ledger = Ledger()
    part = ledger.open(3, _request(), version=0, adapter="treetrain-v0")
    (again,) = ledger.lost(part.pid)  # an answer read whole brings nothing before it ends
    assert again.request == part.request and again.slots == (0, 1) and again.adapter == "treetrain-v0"


def test_a_sample_whose_drawn_tokens_end_it_needs_no_request() -> None:
    ledger = Ledger()
    part = ledger.open(0, _request(budget=3), version=1, adapter=None)
    part.streamed.add(_event(0, [7, 8, 9], [-0.5, -0.25, -0.125]))  # a stop spanning two events
    part.streamed.add(_event(1, [4, 4, 4], [-0.5] * 3))  # the whole budget
    assert ledger.lost(part.pid) == [] and ledger.complete(0)
    tokens = [(c.tokens, c.finish) for c in ledger.take(0).completions]
    assert tokens == [((7, 8, 9), "stop"), ((4, 4, 4), "length")]


def test_an_interrupt_while_a_part_goes_on_joins_what_each_sample_drew() -> None:
    ledger = Ledger()
    part = ledger.open(0, _request(n=1), version=2, adapter=None)
    part.streamed.add(_event(0, [7], [-0.5]))
    (rest,) = ledger.lost(part.pid)
    rest.streamed.add(_event(0, [3, 3], [-0.1, -0.2]))
    (stopped,) = ledger.interrupt()
    assert stopped.samples == (Draft((7, 3, 3), (-0.5, -0.1, -0.2), ((3, 2),)),)
    assert not ledger.held and not ledger.parts
