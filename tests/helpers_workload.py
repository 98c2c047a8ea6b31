"""What the workload tests share: deterministic prompts and a run with arrivals by step."""

from __future__ import annotations


def prompt_of(length: int, seed: int) -> list[int]:
    """A deterministic prompt of `length` ids in 3..252 (no special tokens)."""
    return [3 + (seed * 7919 + i * 104729) % 250 for i in range(length)]


def run_with_arrivals(engine, prompts, params, arrivals) -> list[list[int]]:
    """Add request i at step `arrivals[i]` and step until every request finished; the output
    ids in input order."""
    requests = engine.make_requests(prompts, params)
    pending = sorted(zip(arrivals, range(len(requests)), requests, strict=True))
    outputs: dict[int, list[int]] = {}
    step = 0
    while pending or engine.scheduler.has_unfinished():
        if not engine.scheduler.has_unfinished():
            step = max(step, pending[0][0])  # nothing running: the next request arrives now
        while pending and pending[0][0] <= step:
            engine.scheduler.add(pending.pop(0)[2])
        for request in engine.step():
            outputs[request.index] = list(request.output_ids)
        step += 1
    return [outputs[i] for i in range(len(requests))]


def workload_strategy(max_prompt: int, max_new: int, max_arrival: int):
    """Hypothesis lists of (prompt length, max_new_tokens, arrival step, prompt seed)."""
    from hypothesis import strategies as st

    return st.lists(
        st.tuples(
            st.integers(1, max_prompt),
            st.integers(1, max_new),
            st.integers(0, max_arrival),
            st.integers(0, 10**6),
        ),
        min_size=1,
        max_size=6,
    )
