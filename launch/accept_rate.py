"""`speculant accept-rate`: the acceptance-rate regression check releases are gated on.

Runs speculative decoding over a prompt set, checks greedy output against plain greedy output
token for token (any mismatch fails), reports the acceptance length (mean tokens emitted per
verify step) and the per-position acceptance rates, and compares them with a baseline report:
a metric below `baseline * (1 - rtol)` is a regression. Exit status: 0 pass, 1 regression or
lossless failure, 2 bad input (one line, like every speculant error).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from speculant import ASSETS, bundled
from speculant.config import MAX_DIST_TIMEOUT_S, MAX_DRAFT_TOKENS, check_rows_for_dp
from speculant.errors import SpeculantError, shown
from speculant.executor.request import (
    FLOAT32_MAX,
    GREEDY_TEMPERATURE,
    INT64_MAX,
    INT64_MIN,
)
from speculant.launch.paths import (
    check_outside_checkpoints,
    check_readable_file,
    check_writable,
    read_input,
    same_file,
    shown_path,
    write_errors_named,
    write_whole,
)
from speculant.launch.threads import check_threads, set_cpu_threads

BUNDLED_DRAFTS = {"eagle3": "eagle3", "dflash": "dflash", "draft-model": "draft_lm"}
# A baseline is comparable only when these match (the seed only for sampled runs: greedy output
# does not depend on it).
RUN_KEYS = (
    "algo", "num_draft_tokens", "num_prompts", "max_new_tokens", "temperature", "speculation",
    "seed", "dtype",
)  # fmt: skip
# How far below the baseline a metric may fall (--rtol) before it counts as a regression.
DEFAULT_RTOL = 0.05
# What a baseline written before a field existed measured: every run had this value then.
WRITTEN_BEFORE = {"speculation": "fixed"}
# Fields a baseline written before they existed lacks, whose value then is not known: such a
# baseline is compared without them (the engines' dtype: recorded since 2026-12-07).
UNKNOWN_BEFORE = ("dtype",)
# What --plot writes, by the path's extension (matplotlib writes each without extra software;
# a path without an extension is written as PNG, under exactly that name).
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")
# Per-line settings of a --prompts file that accept-rate refuses: every prompt of a gated run
# uses the same flags (a baseline compares runs of one length and temperature).
PER_LINE_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "seed": "--seed",
    "top_k": None,  # accept-rate samples from the full distribution
    "top_p": None,
    "min_p": None,
    "stop": None,  # every prompt runs its whole --max-new-tokens
    "logprobs": None,  # the report measures acceptance
    "n": None,  # every prompt runs once
}
# Why a per-line setting without a flag is refused.
NO_FLAG_WHY = {
    "stop": "every prompt runs its whole --max-new-tokens, past any stop",
    "logprobs": "it reports acceptance, not log-probabilities",
    "n": "it runs every prompt once; repeat a line to run it again",
}


def bundled_prompts() -> Path:
    """The bundled held-out prompt set (first lines of Python files never trained on)."""
    path = ASSETS / "prompts" / "heldout_prompts.jsonl"
    if not path.is_file():
        raise SpeculantError(
            f"the bundled prompt set {str(path)!r} is missing; reinstall or pass --prompts"
        )
    return path


@dataclass
class AcceptReport:
    """What one accept-rate run measured (the JSON report and the baseline format)."""

    algo: str
    target: str
    draft: str
    num_prompts: int
    num_draft_tokens: int
    max_new_tokens: int
    temperature: float
    acceptance_length: float
    per_position_acceptance: list[float]
    lossless: bool | None  # greedy only: speculative output == plain output for every prompt
    mismatched_prompts: list[int] = field(default_factory=list)
    num_verify_steps: int = 0
    num_plain_steps: int = 0  # request decode steps that verified no draft (--speculation auto)
    speculation: str = "fixed"
    seed: int = 0  # the first prompt's seed (--seed); prompt i samples with seed + i
    output_tokens: int = 0
    seconds: float = 0.0
    date: str = ""
    # sha256 of the prompts as read (`prompts_fingerprint`): a baseline of other prompts, even
    # as many, is refused (a baseline written before this field is compared without it)
    prompts_sha256: str = ""
    # the dtype the engines ran in (`--dtype auto` resolved: float32 on a CPU, the checkpoint's
    # on a GPU): a baseline of another precision is refused (one written before 2026-12-07 has
    # none and is compared)
    dtype: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prompts_fingerprint(specs: list) -> str:
    """sha256 of the prompts (texts, token ids or conversations), in order."""
    import hashlib

    def plain(prompt: Any) -> Any:
        return {"messages": list(prompt.messages)} if hasattr(prompt, "messages") else prompt

    text = json.dumps([plain(spec.prompt) for spec in specs], sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_prompts(baseline: dict, fingerprint: str, source: str) -> None:
    """Refuse a baseline measured on other prompts (when it records which: written since
    2026-12-06)."""
    measured = baseline.get("prompts_sha256")
    if isinstance(measured, str) and measured and measured != fingerprint:
        raise SpeculantError(
            f"baseline {source} was measured on other prompts (sha256 {measured[:12]}..., "
            f"these {fingerprint[:12]}...); run with the --prompts it was measured on or write "
            "a new baseline"
        )


def acceptance(outputs: list) -> tuple[float, list[float], int] | None:
    """Acceptance length and per-position rates over the requests that ran a verify step, each
    weighted by its verify steps (a request that ran longer counts more; one that finished at
    prefill has no acceptance), and the total number of verify steps; None when none ran."""
    stats = [s for s in (out.stats or {} for out in outputs) if s.get("num_verify_steps")]
    steps = sum(s["num_verify_steps"] for s in stats)
    if steps == 0:
        return None
    length = sum(s["accept_len"] * s["num_verify_steps"] for s in stats) / steps
    k = len(stats[0]["per_position_acceptance"])
    per_position = [
        sum(s["per_position_acceptance"][j] * s["num_verify_steps"] for s in stats) / steps
        for j in range(k)
    ]
    return length, per_position, steps


def aggregate(outputs: list, specs: list | None = None) -> tuple[float, list[float], int]:
    """`acceptance`, or an error saying why no request ran a verify step (`specs`, the
    cli.PromptSpec of each output, name the --prompts line meant)."""
    measured = acceptance(outputs)
    if measured is None:
        raise SpeculantError(no_verify_reason(outputs, specs or []))
    return measured


def no_verify_reason(outputs: list, specs: list) -> str:
    """Why no request ran a verify step, and what helps. --max-new-tokens is at least 2 (_check)
    and every prompt ignores EOS, so a request that ended at prefill (one token) was capped by
    the context: the engine caps its max_new_tokens at max_model_len - len(prompt), 1 for a
    prompt one token short of the context, whatever --max-new-tokens says. A request that
    decoded without drafting (--speculation auto) verified nothing either."""
    if any((out.stats or {}).get("num_plain_steps") for out in outputs):
        return (
            "no verify step ran: --speculation auto decoded every step without drafts; run "
            "with --speculation fixed (the gate) to measure acceptance"
        )
    if not outputs or any(len(out.token_ids) > 1 for out in outputs):
        return "no verify step ran (every request finished at prefill); raise --max-new-tokens"
    index = max(range(len(outputs)), key=lambda i: len(outputs[i].prompt_token_ids))
    prompt_len = len(outputs[index].prompt_token_ids)
    context = prompt_len + len(outputs[index].token_ids)  # where its output was capped
    where = f" ({specs[index].where})" if index < len(specs) else ""
    return (
        f"no verify step ran: the longest prompt{where} has {prompt_len} tokens and the "
        f"target's context holds {context} (max_model_len), so every prompt filled it with the "
        f"prefill's token, leaving no room for a verify step; use prompts of at most "
        f"{context - 2} tokens"
    )


@dataclass
class Regression:
    metric: str
    baseline: float
    current: float

    @property
    def change(self) -> float:
        return (self.current - self.baseline) / self.baseline if self.baseline else 0.0


def check_run_shape(baseline: dict, run: dict, source: str) -> None:
    """Refuse a baseline measured with other settings (`run` holds some of RUN_KEYS)."""
    for key, value in run.items():
        if key == "seed" and not run.get("temperature"):
            continue  # greedy: the seed changes nothing
        if key in UNKNOWN_BEFORE and not (baseline.get(key) and value):
            continue  # not recorded by this baseline (written before the field) or this run
        if key not in baseline and key not in WRITTEN_BEFORE:
            raise SpeculantError(f"baseline {source} lacks {key!r}; write it with --write-baseline")
        measured = baseline.get(key, WRITTEN_BEFORE.get(key))
        if measured != value:
            shown = repr(measured)  # a field no check reads may hold anything: one short line
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise SpeculantError(
                f"baseline {source} was measured with {key}={shown}, this run has "
                f"{value!r}; run with the same settings or write a new baseline"
            )


def compare(report: AcceptReport, baseline: dict, rtol: float, source: str) -> list[Regression]:
    """Metrics that fell below baseline * (1 - rtol). Refuses a baseline of another run shape."""
    check_run_shape(baseline, {key: getattr(report, key) for key in RUN_KEYS}, source)
    check_same_prompts(baseline, report.prompts_sha256, source)
    pairs = [("acceptance_length", baseline["acceptance_length"], report.acceptance_length)]
    pairs += [
        (f"per_position_acceptance[{i}]", b, c)
        for i, (b, c) in enumerate(
            zip(baseline["per_position_acceptance"], report.per_position_acceptance, strict=True)
        )
    ]
    return [Regression(m, b, c) for m, b, c in pairs if c < b * (1 - rtol)]


def format_table(report: AcceptReport, baseline: dict | None, regressions: list) -> str:
    """A markdown table of every metric, with the baseline and a REGRESSED mark when given."""
    regressed = {r.metric for r in regressions}
    rows = [("acceptance_length", report.acceptance_length)]
    rows += [
        (f"per_position_acceptance[{i}]", v) for i, v in enumerate(report.per_position_acceptance)
    ]
    base = {"acceptance_length": (baseline or {}).get("acceptance_length")}
    for i, v in enumerate((baseline or {}).get("per_position_acceptance", [])):
        base[f"per_position_acceptance[{i}]"] = v
    lines = ["| metric | current | baseline | |", "| --- | --- | --- | --- |"]
    for metric, value in rows:
        b = base.get(metric)
        shown = "-" if b is None else f"{b:.4f}"
        mark = "REGRESSED" if metric in regressed else ""
        lines.append(f"| {metric} | {value:.4f} | {shown} | {mark} |")
    return "\n".join(lines)


def plot_format(path: str) -> str:
    """The format --plot writes `path` in, from its extension (PNG without one); an extension
    matplotlib does not write is refused naming the flag and the ones it does."""
    suffix = Path(path).suffix
    if not suffix:
        return "png"
    if suffix[1:].lower() not in PLOT_FORMATS:
        raise SpeculantError(
            f"--plot {path!r}: cannot draw a {suffix!r} file; end the path with one of "
            + ", ".join("." + f for f in PLOT_FORMATS)
            + " (a path without an extension is written as PNG)"
        )
    return suffix[1:].lower()


def check_plot(path: str | None) -> None:
    """--plot needs a format matplotlib writes, and matplotlib: refuse before any model loads
    rather than after the run."""
    if path:
        plot_format(path)
    if path and importlib.util.find_spec("matplotlib") is None:
        raise SpeculantError(
            f"--plot {path} needs matplotlib; pip install 'speculant[plot]' or drop --plot"
        )


def _pyplot():
    """pyplot on the file-only Agg backend; matplotlib's INFO lines (its font cache) stay out."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(report: dict) -> str:
    return f"{report['algo']} k={report['num_draft_tokens']}"


def plot(
    report: AcceptReport, path: str, baseline: dict | None = None, out: str | None = None
) -> None:
    """Bars of per-position acceptance, each with its value, and the baseline's rates as a
    dashed line when given; drawn in `path`'s format into `out` (default `path`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rates = report.per_position_acceptance
    positions = range(1, len(rates) + 1)
    bars = ax.bar(positions, rates, label=f"this run: accept_len {report.acceptance_length:.2f}")
    ax.bar_label(bars, fmt="%.2f", padding=2)
    if baseline:
        base = baseline["per_position_acceptance"]
        label = f"baseline: accept_len {baseline['acceptance_length']:.2f}"
        ax.plot(range(1, len(base) + 1), base, "o--", color="black", label=label)
    title = f"{_label(report.to_json())}, {report.num_prompts} prompts"
    _finish(plt, fig, ax, path, len(rates), title, out)


def plot_compare(reports: list[tuple[str, dict]], path: str, out: str | None = None) -> None:
    """One per-position acceptance curve per (label, report), each point with its value; in
    `path`'s format into `out` (default `path`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, report in reports:
        rates = report["per_position_acceptance"]
        positions = range(1, len(rates) + 1)
        ax.plot(
            positions, rates, "o-", label=f"{label}: accept_len {report['acceptance_length']:.2f}"
        )
        for x, y in zip(positions, rates, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)  # fmt: skip
    k = max(len(r["per_position_acceptance"]) for _, r in reports)
    _finish(plt, fig, ax, path, k, "per-position acceptance", out)


def _finish(plt, fig, ax, path: str, k: int, title: str, out: str | None = None) -> None:
    ax.set_xticks(range(1, k + 1))  # positions are integers: draft token 1..k
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.12)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out or path, format=plot_format(path))  # exactly there, also without a suffix
    plt.close(fig)


ACCEPT_EXAMPLES = """examples:
  speculant accept-rate                                # bundled model + EAGLE-3, held-out prompts
  speculant accept-rate --algo dflash --report dflash.json --plot dflash.png
  speculant accept-rate --baseline B.json --rtol 0.05  # exit 1 on a regression
  speculant accept-rate --compare eagle3.json dflash.json --plot compare.png
"""


def add_parser(commands, formatter_class: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """Register `speculant accept-rate` on the CLI's subcommands."""
    from speculant.launch.cli import _int  # (cli imports this module) as `generate` reads ints

    p = commands.add_parser(
        "accept-rate",
        help="measure acceptance rates, check losslessness, compare to a baseline",
        description="Speculative decoding over a prompt set: acceptance length and per-position\n"
        "rates, greedy output checked against plain greedy, compared with a baseline.",
        epilog=ACCEPT_EXAMPLES,
        formatter_class=formatter_class,
    )
    p.add_argument("--target", metavar="DIR", help="default: the bundled target")
    p.add_argument("--draft", metavar="DIR", help="default: the bundled drafter for --algo")
    p.add_argument("--algo", choices=sorted(BUNDLED_DRAFTS), default="eagle3", help="drafter kind")
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='{"prompt": ...} or {"prompt_token_ids": [...]} per line (default: the bundled '
        "held-out prompt set)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=_int,
        metavar="K",
        help="tokens drafted per step (default: 3; dflash: the checkpoint's block size - 1)",
    )
    p.add_argument("--max-new-tokens", type=_int, default=64, metavar="N", help="per prompt")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--seed", type=_int, default=0, metavar="S", help="per-prompt seeds start here")
    p.add_argument("--baseline", metavar="B.json", help="fail (exit 1) on a regression vs this")
    p.add_argument(  # None: not given (it needs --baseline), DEFAULT_RTOL then
        "--rtol",
        type=float,
        metavar="R",
        help=f"allowed relative drop below --baseline (default: {DEFAULT_RTOL})",
    )
    p.add_argument("--write-baseline", metavar="B.json", help="save this run as the baseline")
    p.add_argument("--report", metavar="R.json", help="write the JSON report")
    p.add_argument(
        "--plot",
        metavar="R.png",
        help="chart of per-position acceptance (with --baseline: the baseline's too; with "
        "--compare: one curve per report), in the format its extension names (.png, .pdf, "
        ".svg, ...; PNG without one); needs matplotlib",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="R.json",
        help="run nothing: compare these --report files in a table (and --plot)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: the checkpoint's (float32 on the CPU)",
    )
    p.add_argument(
        "--max-num-seqs", type=_int, default=32, metavar="N", help="requests in flight at most"
    )
    p.add_argument(
        "--threads",
        type=_int,
        metavar="N",
        help="CPU: torch intra-op threads (default: OMP_NUM_THREADS if set, else one per 50 M "
        "parameters, at most the cores free)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--speculation",
        choices=["fixed", "auto"],
        default="fixed",
        help="fixed (the gate: every step drafts K) or auto (steps draft K or none; the report "
        "counts the plain steps) (default: %(default)s)",
    )
    p.add_argument("--tp", type=_int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=_int, default=1, help="data-parallel size")
    p.add_argument("--dist-timeout", type=_int, default=300, metavar="S", help="collective timeout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens <= 1:
        raise SpeculantError(
            f"--max-new-tokens {args.max_new_tokens} leaves no verify step; use 2 or more"
        )
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise SpeculantError(
            f"--num-draft-tokens {args.num_draft_tokens} drafts nothing to measure; use 1 or "
            "more, or leave it out for the drafter's default"
        )
    if args.num_draft_tokens is not None and args.num_draft_tokens > MAX_DRAFT_TOKENS:
        raise SpeculantError(
            f"--num-draft-tokens {args.num_draft_tokens} is more than the engine drafts; use "
            f"1..{MAX_DRAFT_TOKENS}, or leave it out for the drafter's default"
        )
    if not 0 <= args.temperature <= FLOAT32_MAX:  # NaN fails too; the device takes float32
        raise SpeculantError(
            f"--temperature {args.temperature} must be a finite number in 0..{FLOAT32_MAX:.4g}"
        )
    if args.temperature < GREEDY_TEMPERATURE:  # greedy as in SamplingParams: checked lossless
        args.temperature = 0.0
    if not INT64_MIN <= args.seed <= INT64_MAX - 2**32:  # per-prompt seeds count up from it
        raise SpeculantError(f"--seed {args.seed} must be in {INT64_MIN}..{INT64_MAX - 2**32}")
    if args.tp < 1 or args.dp < 1:
        raise SpeculantError(f"--tp {args.tp} / --dp {args.dp} must be positive integers")
    if args.rtol is not None and not 0 <= args.rtol < 1:
        raise SpeculantError(f"--rtol {args.rtol} must be in [0, 1)")
    if args.rtol is not None and not args.baseline:  # nothing to compare with: it would do nothing
        raise SpeculantError(
            f"--rtol {args.rtol} is the allowed drop below --baseline, which is not given; pass "
            "--baseline B.json or drop --rtol"
        )
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL
    for flag in ("threads", "max_num_seqs", "dist_timeout"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SpeculantError(f"--{flag.replace('_', '-')} {value} must be a positive integer")
    if args.dist_timeout > MAX_DIST_TIMEOUT_S:  # torch's timeouts overflow past it (as generate)
        raise SpeculantError(
            f"--dist-timeout {args.dist_timeout} is too large; use an integer in "
            f"1..{MAX_DIST_TIMEOUT_S} (seconds)"
        )
    check_threads(args.threads)  # before any model loads
    check_rows_for_dp(args.max_num_seqs, args.dp)
    for flag in ("target", "draft", "prompts", "baseline", "report", "write_baseline", "plot"):
        if getattr(args, flag, None) == "":
            raise SpeculantError(
                f"--{flag.replace('_', '-')} is an empty path (''); give a path or leave it out"
            )
    for flag in ("target", "draft"):
        value = getattr(args, flag)
        if value and not Path(value).is_dir():
            raise SpeculantError(f"--{flag} {value!r} is not a directory; pass a checkpoint dir")
    if os.environ.get("RANK", "0") != "0":
        return  # only rank 0 reads the baseline and writes the reports
    if args.baseline:
        check_readable_file(args.baseline, "--baseline", "write one first with --write-baseline")
    for flag in OUTPUT_FLAGS:
        if value := getattr(args, flag[2:].replace("-", "_")):
            check_writable(value, flag, OUTPUT_EXAMPLES[flag])
    prompts = args.prompts or str(ASSETS / "prompts" / "heldout_prompts.jsonl")
    check_distinct_files(  # first: an input destroyed matters more than a missing package
        [("--prompts", prompts), ("--baseline", args.baseline)],
        [(f, getattr(args, f[2:].replace("-", "_"))) for f in OUTPUT_FLAGS],
    )
    check_outside_checkpoints(
        [(f, getattr(args, f[2:].replace("-", "_"))) for f in OUTPUT_FLAGS],
        [("--target", args.target or str(bundled("target"))),
         ("--draft", args.draft or str(bundled(BUNDLED_DRAFTS[args.algo])))],
    )  # fmt: skip
    check_plot(args.plot)


# What accept-rate writes, in the order it writes them, with a file name each takes (what an
# error about a directory given there suggests).
OUTPUT_EXAMPLES = {"--report": "report.json", "--write-baseline": "baseline.json",
                   "--plot": "out.png"}  # fmt: skip
OUTPUT_FLAGS = tuple(OUTPUT_EXAMPLES)


def check_distinct_files(inputs: list, outputs: list) -> None:
    """Refuse, before any model loads, an output (flag, path) that is an input's file or another
    output's: the same file on disk (links and other spellings count: paths.same_file), or the
    same path not written yet. Writing it would destroy the input (a --prompts file overwritten
    by the report) or the other output. Pairs whose path is None are left out."""

    inputs = [(flag, path, True) for flag, path in inputs if path]
    outputs = [(flag, path, False) for flag, path in outputs if path]
    for i, (flag, path, _) in enumerate(outputs):
        for other_flag, other, is_input in inputs + outputs[:i]:
            fresh = not is_input and not os.path.exists(path)  # neither is written yet
            if same_file(path, other) or (
                fresh and os.path.realpath(path) == os.path.realpath(other)
            ):
                harm = "destroy that input" if is_input else "overwrite that output"
                raise SpeculantError(
                    f"{flag} {path!r} is the {other_flag} file {other!r} (the same file on "
                    f"disk): writing it would {harm}; pick another {flag}"
                )


def _is_number(value: Any, low: float, high: float = math.inf) -> bool:
    """A JSON number (not a bool) in [low, high], finite (NaN fails too)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and low <= value <= high
        and math.isfinite(value)
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# field -> (valid?, what a valid one is); a --compare report needs the first four, a baseline all.
REPORT_FIELDS: dict[str, tuple[Any, str]] = {
    "algo": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "num_draft_tokens": (_is_count, "an integer >= 1"),
    "acceptance_length": (lambda v: _is_number(v, 0), "a finite number >= 0"),
    "per_position_acceptance": (
        lambda v: isinstance(v, list) and all(_is_number(r, 0, 1) for r in v),
        "a list of rates, numbers in [0, 1]",
    ),
    "num_prompts": (_is_count, "an integer >= 1"),
    "max_new_tokens": (_is_count, "an integer >= 1"),
    "temperature": (lambda v: _is_number(v, 0), "a finite number >= 0"),
}
COMPARE_FIELDS = ("algo", "num_draft_tokens", "acceptance_length", "per_position_acceptance")


def _shown(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rewrite_fix(flag: str) -> str:
    """What fixes a bad --baseline or --compare file: writing it again."""
    return "write it again with " + ("--report" if flag == "--compare" else "--write-baseline")


def check_report_fields(report: Any, path: str, flag: str) -> None:
    """Every field `flag` (--baseline, --compare) uses: present, of its type and range, and as
    many rates as `num_draft_tokens`; refused naming the file and the field, before any model
    loads (rather than a KeyError or TypeError after the run)."""
    fix = _rewrite_fix(flag)
    if not isinstance(report, dict):
        raise SpeculantError(
            f"{flag} {path!r} is not an accept-rate report (a JSON {type(report).__name__}, "
            f"not an object); {fix}"
        )
    for key in COMPARE_FIELDS if flag == "--compare" else REPORT_FIELDS:
        valid, expected = REPORT_FIELDS[key]
        if key not in report:
            raise SpeculantError(f"{flag} {path!r} lacks the field {key!r}; {fix}")
        if not valid(report[key]):
            raise SpeculantError(
                f"{flag} {path!r}: field {key!r} is {_shown(report[key])}, not {expected}; {fix}"
            )
    rates, k = report["per_position_acceptance"], report["num_draft_tokens"]
    if len(rates) != k:
        raise SpeculantError(
            f"{flag} {path!r}: field 'per_position_acceptance' holds {len(rates)} rate(s) but "
            f"'num_draft_tokens' is {k}; {fix}"
        )


def _read_baseline(path: str, flag: str = "--baseline") -> dict:
    """A --baseline or --compare report file, read and checked (check_report_fields); JSON that
    cannot be read (too deeply nested, a number of too many digits) is refused naming the flag
    and the file, as a --prompts line is (launch/cli.py), not a traceback or a bare message."""
    from speculant.launch.cli import _json_int, _NumberTooLong

    fix = _rewrite_fix(flag)
    try:
        baseline = json.loads(read_input(path).decode("utf-8"), parse_int=_json_int)
        # inside: a value nested a little less deeply than json reads can still be too deep
        # for json to write in the message that refuses it (a few frames further down)
        check_report_fields(baseline, path, flag)
    except UnicodeDecodeError as exc:
        raise SpeculantError(f"{flag} {path} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise SpeculantError(f"{flag} {path} is not valid JSON ({exc})") from exc
    except _NumberTooLong as exc:
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise SpeculantError(
            f"{flag} {path!r}: the number {shown(str(exc))} has more than {limit} digits, "
            f"more than can be read; a report's numbers are far smaller: {fix}"
        ) from None
    except RecursionError:
        raise SpeculantError(
            f"{flag} {path!r} holds JSON nested too deeply to read, which no report is; {fix}"
        ) from None
    return baseline


# The accept-rate flags --compare uses; any other given with it is refused (compare runs
# nothing, so a --baseline, --prompts or --tp there would be silently ignored).
COMPARE_USES = ("compare", "plot", "debug")


def check_compare_flags(args: argparse.Namespace) -> None:
    """Refuse flags given with --compare that it does not use, naming them: a flag set to
    anything but its default (a flag given with its default value changes nothing)."""
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    unused = [
        "--" + dest.replace("_", "-")
        for dest, default in vars(parser.parse_args([])).items()
        if dest not in COMPARE_USES and getattr(args, dest, default) != default
    ]
    if unused:
        raise SpeculantError(
            f"--compare runs no model and does not use {', '.join(unused)}; drop "
            + ("it" if len(unused) == 1 else "them")
            + " (--compare takes report files and --plot), or leave out --compare to measure"
        )


def compare_reports(args: argparse.Namespace, stdout: TextIO) -> int:
    """--compare: a table of several reports' acceptance (and with --plot one curve per
    report); no model loads."""
    check_compare_flags(args)
    for path in args.compare:
        check_readable_file(path, "--compare", "write it with --report")
    if args.plot:
        check_writable(args.plot, "--plot", OUTPUT_EXAMPLES["--plot"])
    check_distinct_files([("--compare", path) for path in args.compare], [("--plot", args.plot)])
    check_plot(args.plot)
    reports = [_read_baseline(path, "--compare") for path in args.compare]
    labels = [_label(report) for report in reports]
    if len(set(labels)) < len(labels):  # the same algo and k twice: the files tell them apart
        stems = [Path(path).stem for path in args.compare]
        labels = [f"{label} ({stem})" for label, stem in zip(labels, stems, strict=True)]
    k = max(len(report["per_position_acceptance"]) for report in reports)
    lines = ["| metric | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
    rows = [("acceptance_length", [r["acceptance_length"] for r in reports])]
    for i in range(k):
        rates = [r["per_position_acceptance"] for r in reports]
        rows.append(
            (f"per_position_acceptance[{i}]", [r[i] if i < len(r) else None for r in rates])
        )
    for metric, values in rows:
        shown = ["-" if v is None else f"{v:.4f}" for v in values]
        lines.append(f"| {metric} | " + " | ".join(shown) + " |")
    print("\n".join(lines), file=stdout)
    if args.plot:
        curves = list(zip(labels, reports, strict=True))
        with write_errors_named(args.plot, "--plot"):
            write_whole(args.plot, lambda out: plot_compare(curves, args.plot, out=out))
    return 0


def _line_number(path: str, index: int) -> str:
    """`FILE:LINE` of the prompt at `index` (blank lines hold none, as read_prompts_file reads
    them); a pipe cannot be read again: `FILE: prompt N` there."""
    if os.path.isfile(path):
        lines = Path(path).read_bytes().splitlines()
        for lineno, raw in enumerate(lines, start=1):
            if raw.decode("utf-8-sig" if lineno == 1 else "utf-8", errors="replace").strip():
                if index == 0:
                    return f"{path}:{lineno}"
                index -= 1
    return f"{path}: prompt {index + 1}"


def check_no_per_line_settings(specs: list, path: str) -> None:
    """accept-rate runs every prompt with its flags; a --prompts line that sets its own
    max_new_tokens, n, temperature, seed, top_k, top_p, min_p, stop or logprobs is refused, not
    silently ignored."""
    for index, spec in enumerate(specs):
        if not spec.overrides:
            continue
        key = next(k for k in PER_LINE_FLAGS if k in spec.overrides)
        where, flag = _line_number(path, index), PER_LINE_FLAGS[key]
        if flag:
            raise SpeculantError(
                f"{where}: accept-rate takes {key} from its flag {flag} for every prompt, not "
                f"from a --prompts line; remove {key!r} from the line (and pass {flag})"
            )
        why = NO_FLAG_WHY.get(key, "every prompt samples from the full distribution")
        raise SpeculantError(
            f"{where}: accept-rate takes no {key} ({why}); remove {key!r} from the line"
        )


@dataclass
class AcceptJob:
    """What rank 0 (or the Ray driver) read and checked before any model loads."""

    specs: list  # cli.PromptSpec; [] on ranks other than 0 (rank 0's are broadcast)
    baseline: dict | None
    target: str
    draft: str


def prepare_accept(args: argparse.Namespace) -> AcceptJob:
    """Check the flags, read the prompts and the baseline (rank 0 only), and refuse a baseline
    of another run shape, all before any model loads."""
    from speculant.launch.cli import read_prompts_file  # the same prompt format as generate

    if args.compare:
        raise SpeculantError("--compare runs no model; run it as `speculant accept-rate --compare`")
    _check(args)
    target = args.target or str(bundled("target"))
    draft = args.draft or str(bundled(BUNDLED_DRAFTS[args.algo]))
    if os.environ.get("RANK", "0") != "0":
        return AcceptJob([], None, target, draft)
    baseline = _read_baseline(args.baseline) if args.baseline else None
    if args.baseline:  # a rank's copy of a streamed baseline: later messages name the user's
        args.baseline = shown_path(args.baseline)
    prompts = args.prompts or str(bundled_prompts())
    specs = read_prompts_file(prompts)
    check_no_per_line_settings(specs, prompts)
    if baseline:  # every setting the baseline fixes, before loading models
        known = dict(
            algo=args.algo,
            num_draft_tokens=draft_tokens(args, draft),
            num_prompts=len(specs),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            speculation=getattr(args, "speculation", "fixed"),
            seed=args.seed,
        )
        check_run_shape(baseline, known, args.baseline)
        check_same_prompts(baseline, prompts_fingerprint(specs), args.baseline)
    return AcceptJob(specs, baseline, target, draft)


def draft_tokens(args: argparse.Namespace, draft: str) -> int:
    """k as the Engine will resolve it (executor.build.check_spec: --num-draft-tokens, else the
    drafter's config.json: speculators' speculative_tokens, DFLASH's block - 1, else the
    default), read from the config files alone: no model loads."""
    from speculant.config import SpecConfig
    from speculant.executor.build import check_spec

    spec = SpecConfig(
        algo=args.algo,
        draft=draft,
        num_draft_tokens=args.num_draft_tokens,
        speculation=getattr(args, "speculation", "fixed"),
    )
    check_spec(spec)
    return spec.num_draft_tokens


def run_accept_rate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Validate, run plain and speculative decoding, report, compare; returns the exit status."""
    if args.compare:
        return compare_reports(args, stdout)
    job = prepare_accept(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    world = args.tp * args.dp
    if world > 1 and "RANK" not in os.environ:  # start the ranks; each re-runs this command
        from speculant.launch.spawn import launch_cli

        return launch_cli(args.argv, world, args.device, stderr)
    measured = measure_in_rank(args, job)
    if measured is None:  # rank 0 holds every output and reports
        return 0
    return report_accept(args, job, *measured, stdout=stdout, stderr=stderr)


def _repeated_kv_cache_line(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("KV cache:")


def _generate(engine: Any, prompts: list, params: list, name: str, show: bool) -> list:
    """`engine.generate` under a progress bar called `name` (accept-rate runs two), counting
    requests as they finish on any rank."""
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc=name, unit="req", disable=not show) as bar:
        return engine.generate(prompts, params, on_output=lambda out: bar.update(1))


def measure_in_rank(
    args: argparse.Namespace, job: AcceptJob, use_tqdm: bool = True
) -> tuple[list, list | None, float, str] | None:
    """One rank's part (spawn, torchrun and Ray actors all run this): speculative decoding,
    then plain decoding when greedy. Joins the job in the environment when tp * dp > 1.
    Returns (outputs, plain outputs or None, seconds, the engines' dtype) on rank 0 (or the one
    process), None on the other ranks."""
    from speculant import Engine, SamplingParams
    from speculant.launch.cli import job_options, prompts_named  # cli imports this module

    pctx = None
    if args.tp * args.dp > 1:
        from speculant.comm.groups import ParallelContext

        pctx = ParallelContext.from_env(
            args.tp, args.dp, args.device, args.dist_timeout, job_options(args)
        )
    if args.device == "cpu":
        set_cpu_threads(args.threads, [job.target, job.draft], args.tp * args.dp)
    show = use_tqdm and (pctx is None or pctx.rank == 0)
    common = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        pctx=pctx,
    )
    params = [
        SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed + i,
            ignore_eos=True,  # every prompt runs the same number of steps
        )
        for i in range(len(job.specs))
    ]
    prompts = [s.prompt for s in job.specs]
    spec_engine = Engine(
        job.target,
        algo=args.algo,
        draft=job.draft,
        num_draft_tokens=args.num_draft_tokens,
        speculation=getattr(args, "speculation", "fixed"),
        **common,
    )
    dtype = str(spec_engine.dtype).removeprefix("torch.")
    if job.baseline is not None:  # rank 0: the k and dtype the engine resolved, before any run
        resolved = {"num_draft_tokens": spec_engine.config.spec.num_draft_tokens, "dtype": dtype}
        check_run_shape(job.baseline, resolved, args.baseline)
    start = time.perf_counter()
    with prompts_named(job.specs):  # errors about a prompt name its --prompts line
        outputs = _generate(spec_engine, prompts, params, "speculative", show)
    seconds = time.perf_counter() - start
    del spec_engine
    plain = None  # greedy runs are checked against plain greedy output
    if args.temperature == 0:
        speculant_log = logging.getLogger("speculant")
        speculant_log.addFilter(_repeated_kv_cache_line)  # the same pool as the one above
        try:
            plain_engine = Engine(job.target, **common)
        finally:
            speculant_log.removeFilter(_repeated_kv_cache_line)
        plain = _generate(plain_engine, prompts, params, "plain reference", show)
    if pctx is not None:
        pctx.close()
        if pctx.rank != 0:
            return None
    return outputs, plain, seconds, dtype


def report_accept(
    args: argparse.Namespace,
    job: AcceptJob,
    outputs: list,
    plain: list | None,
    seconds: float,
    dtype: str = "",
    *,
    stdout: TextIO,
    stderr: TextIO,
) -> int:
    """Rank 0's (or the Ray driver's) part: aggregate, compare with the baseline, print the
    table and the verdict, then write the reports; returns the exit status."""
    baseline = job.baseline
    length, per_position, steps = aggregate(outputs, job.specs)
    lossless, mismatched = None, []
    if plain is not None:
        mismatched = [
            i
            for i, (a, b) in enumerate(zip(outputs, plain, strict=True))
            if a.token_ids != b.token_ids
        ]
        lossless = not mismatched
    report = AcceptReport(
        algo=args.algo,
        target=job.target,
        draft=job.draft,
        num_prompts=len(job.specs),
        num_draft_tokens=len(per_position),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        acceptance_length=length,
        per_position_acceptance=per_position,
        lossless=lossless,
        mismatched_prompts=mismatched,
        num_verify_steps=steps,
        num_plain_steps=sum((o.stats or {}).get("num_plain_steps", 0) for o in outputs),
        speculation=getattr(args, "speculation", "fixed"),
        seed=args.seed,
        output_tokens=sum(len(o.token_ids) for o in outputs),
        seconds=seconds,
        date=time.strftime("%Y-%m-%d"),
        prompts_sha256=prompts_fingerprint(job.specs),
        dtype=dtype,
    )
    regressions, not_comparable = [], None
    if baseline:
        try:
            regressions = compare(report, baseline, args.rtol, args.baseline)
        except SpeculantError as exc:  # a setting only the run told (checked before, if known)
            not_comparable, baseline = str(exc), None  # the table and the files keep the run
    table_error = None
    try:
        print(format_table(report, baseline, regressions), file=stdout, flush=True)
    except OSError as exc:  # stdout closed (`| head`) or full: the verdict and the files follow
        table_error = (
            f"speculant: error: printing the table to stdout failed "
            f"({(exc.strerror or str(exc)).lower()}); --report FILE keeps the same figures"
        )
    summary = (
        f"algo={report.algo} k={report.num_draft_tokens} prompts={report.num_prompts} "
        f"accept_len={length:.3f} per_position="
        + ",".join(f"{r:.2f}" for r in per_position)
        + f" speculation={report.speculation} verify_steps={steps} "
        f"plain_steps={report.num_plain_steps}"
        + (f" lossless={lossless}" if lossless is not None else "")
    )
    print(summary, file=stderr)
    status = 0
    if lossless is False:
        print(
            f"speculant: FAIL: greedy speculative output differs from plain greedy output for "
            f"prompts {mismatched[:10]}",
            file=stderr,
        )
        status = 1
    if regressions:
        worst = min(regressions, key=lambda r: r.change)
        print(
            f"speculant: FAIL: {len(regressions)} metric(s) regressed beyond rtol={args.rtol} "
            f"(worst: {worst.metric} {worst.baseline:.4f} -> {worst.current:.4f}, "
            f"{worst.change:+.1%})",
            file=stderr,
        )
        status = 1
    if table_error:
        print(table_error, file=stderr)
        status = status or 2
    if not_comparable:  # no verdict against the baseline: bad input, 1 on a lossless FAIL
        print(f"speculant: error: {not_comparable}".splitlines()[0], file=stderr)
        status = status or 2
    # The files come after the verdict: a failed write is one more line, and the status stays
    # 1 on a FAIL (2 only when the run itself passed).
    text = json.dumps(report.to_json(), indent=2) + "\n"
    writes = [
        ("--report", args.report, lambda out: Path(out).write_text(text)),
        ("--write-baseline", args.write_baseline, lambda out: Path(out).write_text(text)),
        ("--plot", args.plot, lambda out: plot(report, args.plot, baseline, out=out)),
    ]
    for flag, path, write in writes:
        if path and (line := _write_output(flag, path, write)):
            print(line, file=stderr)
            status = status or 2
    return status


def _write_output(flag: str, path: str, write) -> str | None:
    """Run `write(path)`; the one-line error naming the flag and the path when it fails."""
    try:
        with write_errors_named(path, flag):
            write_whole(path, write)  # a failed write leaves the file as it was
    except SpeculantError as exc:
        return f"speculant: error: {exc}".splitlines()[0]
    except ValueError as exc:  # matplotlib refusing what it was given
        return f"speculant: error: {flag} {path!r}: writing failed ({exc})".splitlines()[0]
    return None
