"""Hypothesis strategies for sets of trajectories with the sharing patterns a tree must get right.

Calls are drawn from a tiny token alphabet and assembled from earlier calls (copy, prefix, extension,
fork), so the sets include identical trajectories, trajectories that are prefixes of others, divergence
at the first token, adjacent segments of one role, multi-call trajectories whose later calls rewrite or
reuse the context of earlier ones, and calls of one trajectory sharing a prefix.
"""

from __future__ import annotations

from hypothesis import strategies as st

from treetrain.trajectory import REWARD_LIMIT, Call, Role, Segment, Trajectory, TrajectoryMeta

TOKENS = st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1))
LOGPROB = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
REWARD = st.floats(min_value=-REWARD_LIMIT, max_value=REWARD_LIMIT)
OPTIONAL_INT = st.none() | st.integers(-(2**63), 2**64 - 1)


@st.composite
def segments(draw: st.DrawFn, max_size: int = 3) -> list[Segment]:
    out = []
    for _ in range(draw(st.integers(1, max_size))):
        role = draw(st.sampled_from(list(Role)))
        tokens = tuple(draw(st.lists(TOKENS, min_size=1, max_size=4)))
        logprobs = None
        if role is Role.POLICY and draw(st.booleans()):
            logprobs = tuple(draw(st.lists(LOGPROB, min_size=len(tokens), max_size=len(tokens))))
        out.append(Segment(role, tokens, logprobs))
    return out


def truncate(segs: list[Segment], n: int) -> list[Segment]:
    """The first `n` tokens of a call, cutting the last segment (and its logprobs) if needed."""
    out: list[Segment] = []
    for s in segs:
        if n <= 0:
            break
        if len(s) <= n:
            out.append(s)
        else:
            lps = None if s.logprobs is None else s.logprobs[:n]
            out.append(Segment(s.role, s.tokens[:n], lps))
        n -= len(s)
    return out


@st.composite
def call_segments(draw: st.DrawFn, pool: list[list[Segment]]) -> list[Segment]:
    op = draw(st.sampled_from(["fresh", "copy", "prefix", "extend", "fork"])) if pool else "fresh"
    if op == "fresh":
        return draw(segments())
    base = draw(st.sampled_from(pool))
    if op == "copy":
        return list(base)
    total = sum(len(s) for s in base)
    if op == "prefix":
        return truncate(base, draw(st.integers(1, total)))
    if op == "extend":
        return [*base, *draw(segments(max_size=2))]
    return [*truncate(base, draw(st.integers(0, total))), *draw(segments(max_size=2))]


@st.composite
def trajectory_sets(draw: st.DrawFn, max_trajectories: int = 5, max_calls: int = 3) -> list[Trajectory]:
    n = draw(st.integers(1, max_trajectories))
    ids = draw(st.lists(st.text(min_size=1, max_size=4), min_size=n, max_size=n, unique=True))
    pool: list[list[Segment]] = []
    out: list[Trajectory] = []
    for tid in ids:
        if out and draw(st.integers(0, 5)) == 0:  # an identical episode under another id
            calls = draw(st.sampled_from(out)).calls
        else:
            segs_per_call = []
            for _ in range(draw(st.integers(1, max_calls))):
                segs = draw(call_segments(pool))
                if segs[0].role is Role.POLICY:  # a call's first token is context, never generated
                    segs = [Segment(Role.PROMPT, (draw(TOKENS),)), *segs]
                pool.append(segs)
                segs_per_call.append(segs)
            if not any(s.role is Role.POLICY for s in segs_per_call[0]):
                # The first call owns all of its policy tokens, so this guarantees one trainable token.
                segs_per_call[0] = [*segs_per_call[0], Segment(Role.POLICY, (draw(TOKENS),))]
            calls = tuple(Call(tuple(s)) for s in segs_per_call)
        n_policy = sum(1 for c in calls for s in c.segments if s.role is Role.POLICY)
        steps = draw(st.one_of(st.just([]), st.lists(REWARD, min_size=n_policy, max_size=n_policy)))
        meta = TrajectoryMeta(
            env=draw(st.text(max_size=4)),
            seed=draw(OPTIONAL_INT),
            model_version=draw(OPTIONAL_INT),
            extra=draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
        )
        out.append(Trajectory(tid, calls, draw(REWARD), tuple(steps), meta))
    return out
