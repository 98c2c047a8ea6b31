"""How many drafts each step proposes (`--speculation auto|fixed`).

A step's `DraftShape` is (drafts it verifies, drafts it proposes). Fixed speculation runs every
step at (k, k). Adaptive speculation picks, each step, the number of drafts to propose, 0 or k,
that maximises expected tokens per second: expected tokens from a per-position acceptance
weighted over the last ~10 verify rows (per request once it has verified a few times, the
batch's otherwise; `AcceptanceEstimate`),
step time from `StepCosts`, replay times measured on this machine at start-up. A step after one
that proposed nothing has nothing to verify, so the shapes are (k, k), (0, k) and (0, 0); a step
that proposes nothing drops the drafts its rows hold and runs as a plain step (0, 0), in which
the drafter only catches its state up on the new tokens (EAGLE-3 and DFLASH write their K/V of
those positions, the draft model runs its LM over them), so a later step can draft again.
A step of prefill chunks alone proposes under `auto` only where the drafter's per-sequence part
of an extend step replays a graph (executor/propose_graphs.py: greedy steps of at most the
largest row count; `Engine._drafts_cheaply`); otherwise the chooser is asked with `proposes`
False and the next decode step, a captured (0, k) graph, proposes: eagerly that part (EAGLE-3's
last-position layer and chain, DFLASH's block, the draft model's k decodes) costs 7-11 ms on the
bundled models on an H200 (about 3, 5 and 36 ms on the 8B shape, benchmarks/results/piecewise.md),
more than the one round of acceptance the new requests' first decode step then gives up. A
mixed step (decode rows and chunks) still proposes when drafting wins: its decode rows would
otherwise lose their next verify, and back-to-back mixed steps would never verify at all.
To start drafting it must win by MARGIN; once drafting has won (until it loses, or a step has
no batch) it goes on while it wins by STAY_MARGIN (today equal to MARGIN, see there; a batch of
one row by ONE_ROW_STAY_MARGIN, lower), and stops only after STOP_AFTER comparisons in a row lost
(a one-row dip of the estimate goes on drafting; no new row within PROBE_WAITS steps counts as a
lost one).
While plain steps win, a probe (one step that drafts, then verify steps until PROBE_ROWS rows were
verified: one at a large batch, several at a small one) refreshes the acceptance estimate every
`probe_interval` steps, doubling while probes keep losing.

When the drafter's acceptance would not pay even at batch size 1 (the cheapest verify relative
to a plain step), REST_AFTER probes in a row have lost and REST_MIN_SAMPLES rows were verified,
the drafter rests for REST_STEPS steps (after a rest one more lost probe starts the next,
twice as long, up to LAST_REST; a rest goes on past its length while every request of the step
is cold, see below, and through steps that sample nothing unless a context starts in them): no
drafter work at all (no catch-up records kept, no drafter forward over prefill chunks, no
probes), so a drafter that accepts nothing costs nothing. Its
state then lags for every request that ran a step while it rested: such requests are `cold`:
their drafts are still verified exactly (output stays lossless), but they count as accepting
nothing, and their verify outcomes teach the estimate nothing. A request whose context starts
again (admitted, or resumed after a preemption) outside a rest's length is warm (and so ends a
rest gone on past it). When no request runs, the next batch starts afresh (`idle`)."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, deque
from typing import NamedTuple

FIXED, AUTO = "fixed", "auto"
PROBE_DRAFTED, PROBE_VERIFYING = "drafted", "verifying"
MODES = (AUTO, FIXED)


class DraftShape(NamedTuple):
    """A step's drafts: `verify` drafts per row are verified (its rows hold verify + 1 input
    tokens), `draft` drafts per row are proposed for the next step."""

    verify: int
    draft: int

    @property
    def tokens_per_req(self) -> int:
        return self.verify + 1


PLAIN = DraftShape(0, 0)  # a plain step: verifies nothing, drafts nothing


def shapes_for(k: int, mode: str) -> list[DraftShape]:
    """The shapes steps can take (graphs are captured for each): (k, k) only when fixed."""
    if k == 0:
        return [DraftShape(0, 0)]
    if mode == FIXED:
        return [DraftShape(k, k)]
    return [DraftShape(k, k), DraftShape(0, k), DraftShape(0, 0)]


def step_shape(num_drafts: int, held: int, k: int) -> DraftShape:
    """The shape of a step proposing `num_drafts` whose rows hold at least `held` drafts: it
    verifies k when every row holds k and the step drafts again, else nothing."""
    verify = k if num_drafts and held >= k else 0
    return DraftShape(verify, num_drafts)


class StepCosts:
    """Seconds of one decode step per (shape, padded batch size), measured on this machine; a
    size between measured ones costs what the next measured size does (it is padded to it on a
    GPU), one past the largest is scaled linearly.

    The start-up table times graph replays alone. A step as the engine runs it also pays the
    host's share (filling inputs, reading back, applying each row's tokens), which grows with
    the tokens a row emits and decides small models' steps. On one rank (`observe`), the
    engine's measured step cycles refine it: the median of the last WINDOW cycles per (shape,
    size) once OBSERVED_MIN were seen, else the table's figure plus the host share measured
    for another shape at that size, scaled down where this shape's rows emit fewer tokens (a
    (4, 4) step's share at bs 32 on the bundled models, 0.47 ms, lent whole to the plain step
    made it about 0.75 ms against 0.39 measured, benchmarks/results/adaptive.md, wave 8), never
    up: a drafting shape's cost that only grows from a plain share would keep drafting from ever
    being tried, and so observed, at that size. Several ranks keep the table (every rank must
    decide alike)."""

    OBSERVED_MIN = 2
    # a cycle counts when this many steps in a row launched the same (shape, size): the first
    # steps after a change still wait on the ones before (Engine._observe_cycle). With 2, the
    # plain checks at bs 8 on the bundled models (H200) measured the plain step at 0.37 ms: the
    # second plain step after a drafting one ran 0.42-0.45 ms against 0.25-0.26 steady, which
    # made drafting look 40% cheaper there than it was (benchmarks/results/adaptive.md, wave 8)
    STEADY = 3
    WINDOW = 16  # the median of a (shape, size)'s last WINDOW cycles: one stall moves it little

    def __init__(self, table: dict[tuple[DraftShape, int], float]):
        self.table = dict(table)
        self.sizes: dict[DraftShape, list[int]] = {}
        for shape, bs in self.table:
            self.sizes.setdefault(DraftShape(*shape), []).append(bs)
        for sizes in self.sizes.values():
            sizes.sort()
        self.cycles: dict[tuple[DraftShape, int], deque] = {}  # the last WINDOW cycles
        self._seen: dict[tuple[DraftShape, int], float] = {}  # their median, once OBSERVED_MIN
        self._stale: set[tuple[DraftShape, int]] = set()  # keys observed since their median
        self.learns = False  # the engine observes its steps (one rank)
        self._version = 0  # grows as observations change the figures (a decision cache's key)

    @property
    def seen(self) -> dict[tuple[DraftShape, int], float]:
        """The median cycle per (shape, size) once OBSERVED_MIN were seen."""
        return self._medians()

    @property
    def version(self) -> int:
        self._medians()
        return self._version

    def _medians(self) -> dict[tuple[DraftShape, int], float]:
        """The medians brought up to date (taken when asked for: a rest's steps observe
        without anyone asking)."""
        for key in self._stale:
            cycles = self.cycles[key]
            if len(cycles) < self.OBSERVED_MIN:
                continue
            median, old = statistics.median(cycles), self._seen.get(key)
            self._seen[key] = median
            if old is None or abs(median - old) > 0.02 * old:  # decisions may change
                self._version += 1
        self._stale.clear()
        return self._seen

    def measured_size(self, shape: DraftShape, bs: int) -> int | None:
        """The measured size a batch of bs of this shape runs at; None past the largest (no
        cycle is observed there)."""
        size, scale = self._size(shape, bs)
        return size if scale == 1.0 else None

    def _size(self, shape: DraftShape, bs: int) -> tuple[int, float]:
        """The measured size a batch of bs runs at, and the scale past the largest."""
        sizes = self.sizes[shape]
        index = bisect.bisect_left(sizes, bs)
        if index < len(sizes):
            return sizes[index], 1.0
        return sizes[-1], bs / sizes[-1]

    def __call__(self, shape: DraftShape, bs: int) -> float:
        size, scale = self._size(shape, bs)
        medians = self.seen
        seen = medians.get((shape, size))
        if seen is not None:
            return seen * scale
        base = self.table[(shape, size)]
        for other in self.sizes:  # the host's share, as measured for another shape (scaled
            known = medians.get((other, size))  # down to the tokens a row of this one can emit)
            if other != shape and known is not None:
                share = known - self.table[(other, size)]
                share *= min(shape.tokens_per_req, other.tokens_per_req) / other.tokens_per_req
                return max(base + share, 0.5 * base) * scale
        return base * scale

    def observe(self, shape: DraftShape, bs: int, seconds: float) -> None:
        """One step's cycle as the engine ran it (start to the next step's start)."""
        size, scale = self._size(shape, bs)
        if scale != 1.0:
            return
        key = (shape, size)
        cycles = self.cycles.get(key)
        if cycles is None:
            cycles = self.cycles[key] = deque(maxlen=self.WINDOW)
        cycles.append(seconds)
        self._stale.add(key)

    @classmethod
    def averaged(cls, tables: list[dict]) -> StepCosts:
        """One table from every rank's measurements (the mean), so that every rank, timing its
        own replays, takes the same decisions."""
        keys = tables[0].keys()
        return cls({key: sum(t[key] for t in tables) / len(tables) for key in keys})


class AcceptanceEstimate:
    """Conditional acceptance of draft position i (given 1..i-1 were accepted), one per
    position: the mean of the outcomes seen at that position with the starting rates counted
    as `prior_weight` of them, until 1 / (1 - decay) were seen, then exponentially weighted with
    that memory. So a new estimate moves fast, and a long-lived one follows the last ~1 /
    (1 - decay) rows instead of the last few: one request's acceptance swings from row to row
    (a few rows of 0 accepted inside a stretch of 3-4), and an estimate that followed the last
    three rows went plain in those dips and paid for the switch (benchmarks/results/adaptive.md,
    wave 8)."""

    def __init__(
        self, k: int, prior: float = 0.5, decay: float = 0.9, rates=None, prior_weight: int = 1
    ):
        self.rates = list(rates) if rates is not None else [prior] * k
        self.prior_weight = prior_weight
        self.counts = [0] * k  # outcomes seen per position
        self.decay = decay
        self.samples = 0
        self.expected = self._expected()

    def observe(self, verified: int, accepted: int) -> None:
        """One verify row: `verified` drafts checked, the first `accepted` of them accepted.
        Positions past the first rejection were not reached and teach nothing."""
        reached = min(accepted + 1, verified)
        floor = 1 - self.decay
        for i in range(reached):
            hit = 1.0 if i < accepted else 0.0
            self.counts[i] += 1
            weight = max(floor, 1 / (self.counts[i] + self.prior_weight))
            self.rates[i] += weight * (hit - self.rates[i])
        self.samples += 1
        self.expected = self._expected()

    def expected_tokens(self) -> float:
        """Tokens one verify row emits on average: 1 + sum over i of P(drafts 1..i accepted)."""
        return self.expected

    def _expected(self) -> float:
        total, run = 1.0, 1.0
        for rate in self.rates:
            run *= rate
            total += run
        return total


class DraftLengthChooser:
    """Decides each step's number of drafts. `fixed`: always k. `auto`: see the module doc."""

    MIN_SAMPLES = 2  # a request's own estimate counts once it has verified this often
    DECAY = 0.9  # the acceptance estimates' memory: ~1 / (1 - DECAY) verify rows
    OWN_PRIOR = 5  # verify rows the batch's rates count as in a request's own estimate
    # to start drafting, it must beat plain steps by this factor in expected tokens/s: drafting
    # pays costs outside its step cycles (the (0, k) step that starts it, steps that cannot run
    # ahead, rows ending at different steps); measured on the bundled
    # models (H200): a 15% modelled gain at bs 8 ran 12% slower than plain, a 27% one at bs 1
    # ran 9% faster
    MARGIN = 1.2
    # while drafting (its rows hold drafts), it goes on above this factor: going plain drops the
    # drafts and a later (0, k) step must start again. Measured on the bundled models (H200,
    # benchmarks/results/adaptive.md, wave 8): 1.1 kept EAGLE-3 at bs 1 drafting through one-row
    # dips of the estimate (0.98-0.99 of fixed, was 0.95), but held it drafting at bs 8 and 32,
    # where the model overrates drafting (rows ending at different steps): 0.82-0.92 of plain.
    # So it equals MARGIN: no hold-on until the model sees those costs.
    STAY_MARGIN = 1.2
    # ... but a batch of one row keeps drafting above this one: there every row ends at the same
    # step, so the model's error at larger batches is absent, and what is left is what stopping
    # costs (at least FIRST_PROBE plain steps and a (0, k) step before drafting again). EAGLE-3
    # at bs 1 on the bundled models (H200, adaptive.md, waves 9 and 10): its modelled gain of
    # 1.22-1.27 crosses 1.2 as one prompt's estimate swings, 35 of fixed's 37 verify rows a
    # generate and 0.966-0.968 of fixed in two bars of five; a hold-on of 1.1 read 0.996
    ONE_ROW_STAY_MARGIN = 1.1
    # while drafting, it stops after this many comparisons in a row (each on new figures: a
    # verify row read back, a batch change) lose: one request's estimate dips for a row or two
    # (EAGLE-3 on the bundled target rejects position 2 in a new prompt's first rows), and a
    # one-step plain dip pays a plain step and a (0, k) step to start again; a real collapse
    # costs one more drafting step (benchmarks/results/adaptive.md, wave 9), and a lost
    # comparison no verify row follows within PROBE_WAITS steps (cold rows) counts as the next
    STOP_AFTER = 2
    FIRST_PROBE, LAST_PROBE = 8, 256
    PROBE_ROWS = 8  # verify rows a probe gathers (a small batch verifies several steps)
    PROBE_WAITS = 2  # steps a probe waits for its verify outcome before it is abandoned
    REST_AFTER = 2  # lost probes in a row (acceptance losing at batch size 1) before a rest
    REST_MIN_SAMPLES = 16  # verify rows seen, at least, before a rest
    REST_STEPS, LAST_REST = 1024, 8192  # steps of a first rest; each next one doubles, up to
    # while drafting wins and step costs are observed: CHECK_STEPS plain steps after 32, 64, ...
    # up to 1024 drafting steps in a row at a padded size (the interval keeps growing across
    # plain stretches), so the plain step's real cost is known too (the first StepCosts.STEADY -
    # 1 of them are not steady cycles, see Engine._observe_cycle: two of the four count)
    FIRST_CHECK, LAST_CHECK, CHECK_STEPS = 32, 1024, 4

    def __init__(self, k: int, mode: str, costs: StepCosts | None = None):
        self.k, self.mode, self.costs = k, mode, costs
        self.spec = DraftShape(k, k)  # a speculative step's shape
        self.batch = AcceptanceEstimate(k, decay=self.DECAY)
        self.per_request: dict[int, AcceptanceEstimate] = {}  # by request index
        self.plain_streak = 0
        self.probe_interval = self.FIRST_PROBE
        self.phase: str | None = None  # a probe in progress: PROBE_DRAFTED, then PROBE_VERIFYING
        self.probe_mark = self.probe_steps = self.probe_waits = 0
        self._last_key: tuple | None = None
        self._last_prefer = False
        self.drafting = False  # drafting won the last comparison (probes and checks aside)
        self.losses = 0  # comparisons lost in a row while drafting (see STOP_AFTER)
        self.held = 0  # steps drafting was held on by a lost comparison without new figures
        self.chosen: Counter[int] = Counter()  # drafts proposed -> steps
        self.lost_probes = 0  # probes lost in a row
        self.rest_left = 0  # steps the drafter still rests
        self.rest_length = 0  # steps of the last rest (0: none since a probe last won)
        self.rest_steps = 0  # steps rested, in all
        self.rests_now = False  # the step just chosen rests the drafter
        self.cold: set[int] = set()  # requests whose drafter state lags (see the module doc)
        self.draft_streak, self.check_left = 0, 0
        self.check_intervals: dict[int, int] = {}  # per padded size: drafting steps to a check

    @property
    def check_interval(self) -> int:
        """The largest interval between plain checks so far (a figure for reports)."""
        return max(self.check_intervals.values(), default=self.FIRST_CHECK)

    @property
    def adaptive(self) -> bool:
        return self.mode == AUTO and self.k > 0 and self.costs is not None

    def observe(self, request_index: int, verified: int, accepted: int) -> None:
        """A verify row's outcome (accepted drafts before the first rejection, counted before
        any stop token or length limit cut them)."""
        if verified == 0 or not self.adaptive or request_index in self.cold:
            return
        own = self.per_request.get(request_index)
        if own is None:
            # the batch's rates as its prior, weighted by what they know (up to OWN_PRIOR rows)
            weight = max(1, min(self.OWN_PRIOR, self.batch.samples))
            own = AcceptanceEstimate(
                self.k, decay=self.DECAY, rates=self.batch.rates, prior_weight=weight
            )
            self.per_request[request_index] = own
        self.batch.observe(verified, accepted)
        own.observe(verified, accepted)

    def idle(self) -> None:
        """No request runs: the next batch starts afresh (drafting must win by MARGIN)."""
        self.drafting, self.losses = False, 0

    def forget(self, request_index: int) -> None:
        self.per_request.pop(request_index, None)
        self.cold.discard(request_index)

    def mark_cold(self, request_indices) -> None:
        """These requests ran a step while the drafter rested: their drafter state lags."""
        for index in request_indices:
            self.cold.add(index)
            self.per_request.pop(index, None)

    def mark_warm(self, request_index: int) -> None:
        """This request's context starts again with the drafter at work."""
        self.cold.discard(request_index)

    def expected_tokens(self, request_indices: list[int]) -> float:
        total = 0.0
        cold = self.cold
        for index in request_indices:
            if index in cold:  # lagging drafter state: count on nothing being accepted
                total += 1.0
                continue
            own = self.per_request.get(index)
            use = own if own is not None and own.samples >= self.MIN_SAMPLES else self.batch
            total += use.expected_tokens()
        return total

    def prefers_drafting(
        self, request_indices: list[int], bs: int, margin: float | None = None
    ) -> bool:
        """Expected tokens per second of speculative steps (k, k) against plain steps (0, 0) at
        this batch size, drafting by at least `margin` (MARGIN unless given)."""
        bs = max(bs, 1)
        spec = self.expected_tokens(request_indices) / self.costs(self.spec, bs)
        plain = len(request_indices) / self.costs(DraftShape(0, 0), bs)
        return spec > (self.MARGIN if margin is None else margin) * plain

    def pays_at_smallest_batch(self) -> bool:
        """Whether the batch-wide acceptance would pay for drafting at batch size 1 (by
        MARGIN)."""
        spec = self.batch.expected_tokens() / self.costs(self.spec, 1)
        return spec > self.MARGIN / self.costs(DraftShape(0, 0), 1)

    def choose(
        self, request_indices: list[int], bs: int, proposes: bool = True, cheaply: bool = False
    ) -> int:
        """Drafts the step proposes (0 or k) for a batch of these requests run at size bs;
        `rests_now` then says whether the step rests the drafter. `proposes` False: a step of
        prefill chunks alone, which starts no probe and no plain check, and leaves a probe in
        progress where it was; it proposes none (see the module doc) unless `cheaply` (its
        per-sequence drafting replays a graph) and drafting wins."""
        self.rests_now = False
        drafts = self._choose(request_indices, bs, proposes)
        if not proposes and not cheaply:
            drafts = 0
        self.chosen[drafts] += 1
        return drafts

    def _choose(self, request_indices: list[int], bs: int, proposes: bool = True) -> int:
        if not self.adaptive:
            return self.k
        if self.rest_left:
            self.rest_left -= 1
            self.rest_steps += 1
            self.rests_now = True
            return 0
        if self.rest_length and request_indices and not self._any_warm(request_indices):
            # a rest ended, but every request ran some of it (cold): no probe can learn from
            # them and a plain step would record catch-up entries nothing drafts from, so the
            # rest goes on until a request starts warm (the last ~340 steps of the 8B job with
            # a dummy head, benchmarks/results/adaptive.md, wave 9)
            self.phase = None
            self.rest_steps += 1
            self.rests_now = True
            return 0
        if self.phase is not None and not proposes:
            return 0  # a step of prefill chunks alone verifies nothing: the probe waits
        if self.phase == PROBE_DRAFTED:  # the probe's drafts must be verified once
            self.phase, self.probe_mark, self.probe_steps = PROBE_VERIFYING, self.batch.samples, 1
            self.probe_waits = 0
            return self.k
        if self.phase == PROBE_VERIFYING:
            # a small batch verifies on until the probe has PROBE_ROWS rows (one row is noise)
            steps = self.probe_steps
            if steps * max(bs, 1) < self.PROBE_ROWS and steps < self.PROBE_ROWS:
                self.probe_steps += 1
                return self.k
            if self.batch.samples == self.probe_mark:
                # its outcome is not read back yet (a step launched ahead); after PROBE_WAITS
                # steps it never will be (its step ran plain: drafts dropped because a row held
                # none, or a DP peer's plain step): the probe is abandoned
                self.probe_waits += 1
                if self.probe_waits > self.PROBE_WAITS:
                    self.phase = None
                return 0
        if not request_indices:
            self.idle()
            return 0
        # nothing learnt and the same requests at the same size: the same comparison (steps stay
        # cheap on the host: plain steps of a small model take a fraction of a millisecond)
        margin = self.MARGIN
        if self.drafting:
            margin = self.ONE_ROW_STAY_MARGIN if bs == 1 else self.STAY_MARGIN
        key = (self.batch.samples, hash(tuple(request_indices)), bs, len(self.cold),
               self.costs.version, margin)  # fmt: skip
        if key != self._last_key:
            prefer = self.prefers_drafting(request_indices, bs, margin)
            if prefer or not self.drafting:
                self.losses = 0
            else:  # drafting lost on new figures: it stops once STOP_AFTER did in a row
                self.losses += 1
                prefer = self.losses < self.STOP_AFTER
            self._last_key, self._last_prefer, self.held = key, prefer, 0
        elif self.losses and self._last_prefer:
            # a lost comparison holds drafting on to see the next verify row; one that is not
            # read back within PROBE_WAITS steps never comes (the rows are cold, or steps draft
            # nothing) and counts as lost, so drafting cannot go on without new figures
            self.held += 1
            if self.held > self.PROBE_WAITS:
                self._last_prefer = False
        prefer = self.drafting = self._last_prefer
        if self.phase == PROBE_VERIFYING:
            self.phase = None
            if not prefer:  # the probe lost: wait longer before the next one
                self.probe_interval = min(2 * self.probe_interval, self.LAST_PROBE)
                self.lost_probes += 1
                known = self.batch.samples >= self.REST_MIN_SAMPLES
                lost = self.lost_probes >= self.REST_AFTER
                if lost and known and not self.pays_at_smallest_batch():
                    # rests double while they keep being followed by a lost probe (one suffices)
                    length = 2 * self.rest_length if self.rest_length else self.REST_STEPS
                    self.rest_length = self.rest_left = min(length, self.LAST_REST)
                    self.lost_probes = self.REST_AFTER - 1
                    return self._choose(request_indices, bs)
        if prefer:
            self.plain_streak, self.probe_interval, self.lost_probes = 0, self.FIRST_PROBE, 0
            self.rest_length = 0
            return self._check_plain(bs) if proposes else self.k
        self.draft_streak, self.check_left = 0, 0
        self.plain_streak += 1
        # a probe teaches something only through warm requests, and starts with a step that
        # proposes
        warm = proposes and self._any_warm(request_indices)
        if self.plain_streak >= self.probe_interval and warm:
            self.plain_streak, self.phase = 0, PROBE_DRAFTED
            return self.k
        return 0

    def _check_plain(self, bs: int) -> int:
        """Drafts of a step while drafting wins: k, but now and then CHECK_STEPS plain steps
        when step costs are observed (a plain step's real cost, host included, can exceed what
        its replay time says, and drafting is judged against it). The interval is kept per
        padded size: a size drafting reaches later gets its first check soon (its plain cost is
        otherwise the replay plus a host share lent by the drafting shape, too large there)."""
        if not self.costs.learns:
            return self.k
        if self.check_left:
            self.check_left -= 1
            return 0
        size = self.costs.measured_size(self.spec, max(bs, 1))
        if size is None:
            return self.k  # past the largest size no cycle is observed: a check teaches nothing
        self.draft_streak += 1
        interval = self.check_intervals.get(size, self.FIRST_CHECK)
        if self.draft_streak < interval:
            return self.k
        self.draft_streak = 0
        self.check_intervals[size] = min(2 * interval, self.LAST_CHECK)
        self.check_left = self.CHECK_STEPS - 1
        return 0

    def _any_warm(self, request_indices: list[int]) -> bool:
        cold = self.cold
        return not cold or any(index not in cold for index in request_indices)

    def summary(self) -> dict[int, int]:
        """Steps by drafts proposed (steps that rested the drafter among the 0s)."""
        return dict(sorted(self.chosen.items()))
