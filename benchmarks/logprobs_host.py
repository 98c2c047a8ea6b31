"""The host's cost of `--logprobs N` per output token (CPU only, no model): the real path from a
step's packed read-back to the request's `--output` line, timed on realistic shapes.

Per step: its read-back turned into rows (`tolist` of [rows, L + T + k + 1] int64, L the
log-probability columns: `pack_logprobs` of a real log-softmax over `--vocab` ids) and each row
applied to its request (`Engine._apply_verify`: `_logprobs_of`, `Request.append`). Per finished
request: its output (`Engine._output`, which decodes the log-probabilities) and its line, as the
CLI writes it to --output. Continuous batching: `--rows` requests at a time, a finished one's
row taken by the next, every output kept to the end (as `generate` returns them). The same run
without log-probabilities (no columns, no request asking) gives their cost: with - without, per
output token and phase; "gc" is the time the garbage collector took within the phases.

The engine is a stand-in holding only the host state those methods read (`HostOnly`); the rows'
values come from a pool of real log-softmax positions (peaked and flat, ties, -inf, top ids at
the vocab's end, tokens sampled), drawn at random per step.

    python benchmarks/logprobs_host.py [--requests 1000] [--tokens 300] [--logprobs 5]
        [--width 1] [--rows 256] [--vocab 128256] [--pool 2048] [--repeats 3] [--profile]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import time

import torch
from _common import run_info

from speculant.executor.engine import Engine
from speculant.executor.logprobs import logprob_columns, pack_logprobs
from speculant.executor.request import Request, SamplingParams

PHASES = ("step", "output", "line")


class GCTime:
    """Seconds the garbage collector takes while in use (`with`)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GCTime:
        gc.collect()  # none of an earlier run's garbage
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class NoChooser:
    """Adaptive speculation's chooser, observing nothing."""

    def observe(self, index: int, verified: int, accepted: int) -> None:
        pass


class HostOnly(Engine):
    """An Engine holding only the state its host path of a step's rows and a finished
    request's output reads (no model, no device)."""

    def __init__(self, num_logprobs: int | None):
        self.num_logprobs, self.tokenizer, self.chooser = num_logprobs, None, NoChooser()


def pool_of(positions: int, width: int, vocab: int, n: int, seed: int) -> torch.Tensor:
    """`pack_logprobs` rows [positions // width, width (1 + 2 n)] of real log-softmax values:
    peaked and flat positions, a few with tied top logits, some with every id but a few at
    -inf, top ids at the vocab's end; the chosen tokens sampled from each position's softmax."""
    gen = torch.Generator().manual_seed(seed)
    rows, chunk = [], max(1, 64 // width)
    for start in range(0, positions // width, chunk):
        count = min(chunk, positions // width - start)
        logits = torch.randn(count, width, vocab, generator=gen) * 2.5
        peak = torch.randint(0, vocab, (count, width), generator=gen)
        logits.scatter_add_(-1, peak[..., None], torch.full((count, width, 1), 14.0))
        flat = logits.view(-1, vocab)
        for p in range(0, flat.shape[0], 7):  # ties at the top
            flat[p, vocab - 3 : vocab] = flat[p].max() + 1.0
        for p in range(3, flat.shape[0], 29):  # all but a few ids masked
            keep = flat[p, vocab - 2 :].clone()
            flat[p] = float("-inf")
            flat[p, vocab - 2 :] = keep
        tokens = torch.multinomial(flat.softmax(-1), 1, generator=gen).view(count, width)
        rows.append(pack_logprobs(logits, tokens, n))
    return torch.cat(rows)


class Job:
    """`requests` requests of about `tokens` output tokens each through the host path,
    `rows` at a time; `seconds` per phase."""

    def __init__(self, args: argparse.Namespace, n: int | None, pool: torch.Tensor | None):
        rnd = random.Random(args.seed)
        self.engine, self.n, self.pool = HostOnly(n), n, pool
        self.T, self.k = args.width, args.width - 1
        params = [
            SamplingParams(max_new_tokens=rnd.randint(args.tokens // 2, args.tokens * 3 // 2),
                           ignore_eos=True, logprobs=n)
            for _ in range(args.requests)
        ]  # fmt: skip
        self.queue = [self.request(i, p) for i, p in enumerate(params)][::-1]
        self.active = [self.queue.pop() for _ in range(min(args.rows, len(self.queue)))]
        self.outputs = []  # kept to the end, as generate returns them
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def request(self, index: int, params: SamplingParams) -> Request:
        return Request(
            index=index,
            prompt_ids=[1, 2, 3],
            params=params,
            seed=index,
            max_new_tokens=params.max_new_tokens,
            stop_ids=frozenset(),
            accepted_per_position=[0] * self.k,  # as its first token's extend step sets it
            **self.engine._output_state(params),
        )

    def run(self) -> dict:
        """The whole job; seconds per phase (and the collector's) and the output tokens."""
        with open(os.devnull, "w") as out_file, GCTime() as collector:
            while self.active:
                self.step(out_file)
        self.seconds["gc"] = collector.seconds
        return {"seconds": self.seconds, "tokens": sum(len(o.token_ids) for o in self.outputs)}

    def step(self, out_file: io.TextIOBase) -> None:
        """One step of the active requests; the finished ones' outputs and lines, their rows
        taken by queued requests."""
        bs, T = len(self.active), self.T
        # the step's packed results (the device's work: not timed)
        parts = [
            torch.randint(0, 128_000, (bs, T + self.k), dtype=torch.int64),  # tokens, drafts
            torch.randint(1, T + 1, (bs, 1), dtype=torch.int64),  # accept_len
        ]
        if self.n is not None:
            parts.insert(0, self.pool[torch.randint(0, self.pool.shape[0], (bs,))])
        packed = torch.cat(parts, 1)
        start = time.perf_counter()
        host = packed.tolist()  # ReadResults / PendingResults.wait
        for request, row in zip(self.active, host, strict=True):
            self.engine._apply_verify(request, row, 0.0, self.k, T)
        self.seconds["step"] += time.perf_counter() - start
        still = []
        for request in self.active:
            if request.finish_reason is None:
                still.append(request)
                continue
            start = time.perf_counter()
            out = self.engine._output(request)
            middle = time.perf_counter()
            out_file.write(out.json_line())  # launch/cli.py's --output line
            out_file.flush()
            self.seconds["output"] += middle - start
            self.seconds["line"] += time.perf_counter() - middle
            self.outputs.append(out)
            if self.queue:
                still.append(self.queue.pop())
        self.active = still


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=300, help="mean output tokens a request")
    parser.add_argument("--logprobs", type=int, default=5, help="N (the engine's and requests')")
    parser.add_argument("--width", type=int, default=1, help="T = k + 1 (1: plain decoding)")
    parser.add_argument("--rows", type=int, default=256, help="requests decoding at once")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--pool", type=int, default=2048, help="real log-softmax positions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one run with them")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pool = pool_of(args.pool, args.width, args.vocab, args.logprobs, args.seed)
    assert pool.shape[1] == logprob_columns(args.width, args.logprobs)
    results = {}
    for name, n in (("without", None), ("with", args.logprobs)):
        runs = [Job(args, n, pool).run() for _ in range(args.repeats)]
        best = min(runs, key=lambda r: sum(r["seconds"][p] for p in PHASES))  # least total
        tokens = best["tokens"]
        us = {phase: best["seconds"][phase] / tokens * 1e6 for phase in (*PHASES, "gc")}
        us["total"] = sum(us[p] for p in PHASES)
        results[name] = {"tokens": tokens, "us_per_token": us}
    print(
        f"{results['with']['tokens']} output tokens, {args.requests} requests, --logprobs "
        f"{args.logprobs}, T {args.width}, {args.rows} rows; us per output token (the run of "
        f"least total of {args.repeats}; gc: within the phases):"
    )
    print(f"{'phase':<8}{'with':>9}{'without':>9}{'cost':>9}")
    for phase in (*PHASES, "total", "gc"):
        w, wo = results["with"]["us_per_token"][phase], results["without"]["us_per_token"][phase]
        print(f"{phase:<8}{w:>9.3f}{wo:>9.3f}{w - wo:>9.3f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(Job(args, args.logprobs, pool).run)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info("cpu"), "args": vars(args), **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
