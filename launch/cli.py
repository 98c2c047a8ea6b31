"""The `speculant` command: `speculant generate --target DIR --prompt TEXT`.

Everything a user can get wrong (flags, the prompts file) is checked before any model
loads; errors print as one line `speculant: error: ...` and exit with status 2.
"""

from __future__ import annotations

import os
import signal
import sys

# Ctrl-C or SIGTERM in the command's first moments, while the imports below run (numpy's), are
# recorded here, before any of them, and raised by main once it can stop the run
# (launch/spawn.py, stop_on_sigterm): raised inside an import, a signal breaks it (a
# half-imported numpy) or is swallowed, and an unhandled SIGTERM would kill the process. Only
# when this process is the command, not when a test or a program imports this module: `python
# -m speculant`, the `speculant` script, a rank.
# ruff: noqa: E402
EARLY_STOPS: list[int] = []
COMMAND_MODULES = ("speculant.__main__", "speculant.launch.spawn", "speculant.launch.torchrun")


def _record_early_stop(signum: int, frame: object) -> None:
    EARLY_STOPS.append(signum)


def _started_as_command() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return getattr(spec, "name", None) in COMMAND_MODULES or script == "speculant"


if _started_as_command():
    for _sig in (signal.SIGINT, signal.SIGTERM):
        if _sig == signal.SIGTERM or signal.getsignal(_sig) is not signal.SIG_IGN:
            try:  # an ignored Ctrl-C (a background job) stays ignored
                signal.signal(_sig, _record_early_stop)
            except ValueError:  # not the main thread: no handler to set
                pass

import argparse
import contextlib
import json
import logging
import re
import shlex
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

from speculant.config import (
    MAX_CATCH_UP_DEPTH,
    MAX_DIST_TIMEOUT_S,
    MAX_DRAFT_TOKENS,
    MAX_PAGE_SIZE,
    check_rows_for_dp,
)
from speculant.errors import PromptError, SpeculantError, shown
from speculant.executor.chat import Chat, messages_problem, template_kwargs_problem
from speculant.executor.request import (
    FLOAT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    stop_problem,
)
from speculant.launch import accept_rate
from speculant.launch.paths import (
    check_outside_checkpoints,
    check_readable_file,
    check_writable,
    open_output,
    read_input,
    same_file,
    tolerant_stderr,
    write_errors_named,
    write_lines,
)
from speculant.launch.threads import check_threads, set_cpu_threads

# Keys a --prompts line may carry besides its prompt; they override the CLI values.
SAMPLING_KEYS = (
    "max_new_tokens", "n", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "logprobs",
)  # fmt: skip
PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
CHAT_KWARGS_KEY = "chat_template_kwargs"  # with "messages": more template variables (vLLM's)
DEFAULT_PROMPT = "def fibonacci(n):"  # the bundled default run's prompt (a Python-code model)
DEFAULT_MAX_NUM_SEQS = {"cpu": 64, "cuda": 512}  # as executor/engine.py's defaults


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, like every other speculant error."""

    argv: Sequence[str] = ()  # what this parser (or subcommand's) parses, for error's hint

    def parse_known_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # `--flag=--`: argparse before Python 3.13 drops a "--" value as if it ended the flags,
        # which gave `--stop=--` the value [] (the form error() suggests for such a value)
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)

    def error(self, message: str) -> NoReturn:
        missing = re.match(r"argument (?:\S+/)?(--[\w-]+): expected one argument$", message)
        if missing:  # a value that starts with "-", which argparse takes for a flag?
            flag, argv = missing.group(1), list(self.argv)
            after = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
            if after and after[-1].startswith("-"):
                value = after[-1]
                if len(value) <= 40 and value.isprintable():
                    quoted = shlex.quote(value)
                    message += f" ({quoted} looks like a flag); pass it as {flag}={quoted}"
                else:  # too long to print whole: the form alone
                    message += f" ({shown(value)} looks like a flag); join it: {flag}=VALUE"
        from speculant.launch.spawn import tell_torchrun

        line = f"speculant: error: {message} (see `{self.prog} --help`)"
        tell_torchrun(line)
        # every rank of a torchrun node parses the same flags: its local rank 0 says it
        hold_for_local_rank0()
        self.exit(2, line + "\n" if says_user_errors() else None)


def says_user_errors() -> bool:
    """Whether this process prints a user error: not another local rank of a torchrun node,
    whose ranks all run the same checks (the node's local rank 0 says it once; the others only
    leave it in their torchrun error file)."""
    return "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"


USER_ERROR_HOLD_S = 5.0


def tell_peers(exc: BaseException, line: str) -> bool:
    """A user error on a rank of a multi-rank job: recorded for a local launcher (which names
    the first rank that failed on its own) and, once the job's process groups are up, reported
    to the others through the job's store, so that ranks failing in collectives with this one
    name it (spawn.report_failure). Returns whether it was reported."""
    from speculant.launch.spawn import record_own_failure, report_failure

    record_own_failure(line.removeprefix("speculant: error: "))
    dist = sys.modules.get("torch.distributed")  # not imported: no process group yet
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    report_failure(exc)
    return True


def say_unless_local_rank0_did(exc: BaseException, line: str) -> None:
    """A torchrun rank that is not its node's local rank 0 and reported a user error: local
    rank 0 says the error every rank meets alike, so this one says it (naming its rank) only
    when local rank 0 did not report the same failure within USER_ERROR_HOLD_S (a file only
    this rank's node cannot read)."""
    from speculant.launch.spawn import failure_summary, peer_report

    local_rank0 = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", "0"))
    if peer_report(local_rank0, USER_ERROR_HOLD_S) != failure_summary(exc):
        rank = os.environ["RANK"]
        print(line.replace("error: ", f"error: rank {rank}: ", 1), file=sys.stderr, flush=True)


def hold_for_local_rank0() -> None:
    """On a user error every rank meets alike, a torchrun rank that does not say it waits (up
    to USER_ERROR_HOLD_S) before it exits: torchrun stops the other ranks at the first exit,
    and when that was this rank's, local rank 0 was stopped before it printed the line (a
    loaded machine: no line at all). torchrun's SIGTERM, once rank 0 has exited, ends the
    wait."""
    if says_user_errors():
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(USER_ERROR_HOLD_S)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default (where it has a value and the help does not say it)
    and keeps the examples' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


GENERATE_EXAMPLES = """examples:
  speculant generate                                   # bundled model + EAGLE-3, default prompt
  speculant generate --prompt "def quicksort(arr):" --algo dflash
  speculant generate --target DIR --draft DIR --algo eagle3 --num-draft-tokens 3 \\
      --prompts prompts.jsonl --output out.jsonl
  speculant generate --target DIR --tp 2 --dp 2 --device cpu --prompt "Hello"
"""


def _digits_problem(text: str) -> None:
    """Refuse a whole number of more digits than Python converts (4300), saying so."""
    if text.strip().lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(f"{shown(text)} has too many digits; use a smaller number")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        _digits_problem(text)
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a positive integer")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        _digits_problem(text)
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer >= 0")
    return value


def _logprobs_count(text: str) -> int:
    """An argparse type: alternatives per token, 0..MAX_LOGPROBS."""
    value = _nonnegative_int(text)
    if value > MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is too large; use an integer in 0..{MAX_LOGPROBS} (alternatives a "
            "token)"
        )
    return value


def _int(text: str) -> int:
    """An argparse type: any whole number, named in its error even when it is 5000 digits."""
    try:
        return int(text)
    except ValueError:
        _digits_problem(text)
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None


def _int_up_to(high: int, unit: str) -> Callable[[str], int]:
    """An argparse type: a whole number in 1..high, `unit` naming what it counts."""

    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > high:
            raise argparse.ArgumentTypeError(
                f"{shown(text)} is too large; use an integer in 1..{high} ({unit})"
            )
        return value

    return parse


def _int_in(low: int, high: int | None, unit: str) -> Callable[[str], int]:
    """An argparse type: a whole number in low..high (no upper bound when `high` is None),
    `unit` saying what it counts: the range the engine takes, refused while parsing (before
    any rank starts or model loads)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low or (high is not None and value > high):
            allowed = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(
                f"{shown(text)} is out of range; use {allowed} ({unit})"
            )
        return value

    return parse


def _path(fix: str) -> Callable[[str], str]:
    """An argparse type: a path that is not empty (`--output ""` is a mistake, not "none");
    `fix` says what to pass instead."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"the path is empty (''); {fix}")
        return text

    return parse


def _capture_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive integers such as 1,2,4,8"
        )
    return sizes


def _piecewise_sizes(text: str) -> list[int]:
    """`none` (no piecewise graphs: []) or sizes as for --capture-sizes."""
    return [] if text.strip().lower() == "none" else _capture_sizes(text)


def build_parser(
    prog: str = "speculant",
    description: str = "Speculative-decoding inference engine.",
    launcher_flags: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of the `speculant` command; a launcher that runs the same commands
    (launch/ray.py) passes its own `prog`, `description` and `launcher_flags`, which adds its
    flags to the top level and to each command, so that every --help shows them."""
    parser = _Parser(prog=prog, description=description)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    gen = commands.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions, speculatively with --algo. With no --target, the\n"
        "bundled Python-code model and its EAGLE-3 head complete a default prompt.",
        epilog=GENERATE_EXAMPLES,
        formatter_class=HelpFormatter,
    )

    src = gen.add_argument_group("model")
    src.add_argument(
        "--target",
        type=_path("pass a checkpoint directory, or leave --target out for the bundled model"),
        metavar="DIR",
        help="HF checkpoint dir of the target model (default: the bundled code model, with its "
        "EAGLE-3 head unless --algo/--draft say otherwise, and a default prompt)",
    )
    src.add_argument(
        "--demo-model",
        action="store_true",
        help="use a tiny random-weight Llama built into ~/.cache/speculant (gibberish output)",
    )
    src.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    src.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: the checkpoint's (float32 on the CPU)",
    )
    src.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights of the checkpoint's shapes",
    )

    inp = gen.add_argument_group("prompts and output").add_mutually_exclusive_group()
    inp.add_argument("--prompt", metavar="TEXT", help="one text prompt")
    inp.add_argument(
        "--prompts",
        type=_path("pass a .jsonl file, or --prompt TEXT"),
        metavar="FILE.jsonl",
        help='one JSON object per line: {"prompt": "..."}, {"prompt_token_ids": [...]} or '
        '{"messages": [{"role": "user", "content": "..."}]} (the target\'s chat template), '
        f"optionally with {', '.join(SAMPLING_KEYS)}",
    )
    gen.add_argument(
        "--output",
        type=_path(
            "pass a file path such as out.jsonl, or leave --output out to print the completions"
        ),
        metavar="OUT.jsonl",
        help="write one JSON line per request",
    )

    samp = gen.add_argument_group("sampling (a --prompts line may override each)")
    samp.add_argument(
        "--max-new-tokens", type=_int, default=64, metavar="N", help="tokens to generate at most"
    )
    samp.add_argument(
        "--n",
        type=_int,
        default=1,
        metavar="N",
        help="completions of each prompt (vLLM's n; each with its own seed, so sampled ones are "
        "independent); written as N lines (sample_index 0..N-1) or printed as [i:j]",
    )
    samp.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    samp.add_argument("--top-k", type=_int, default=0, metavar="K", help="0 (or -1) = off")
    samp.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus, in (0, 1]")
    samp.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="keep only tokens at least P times as likely as the most likely, in [0, 1] (0 = off;"
        " applied before top-k and top-p, as vLLM does)",
    )
    samp.add_argument(
        "--seed",
        type=_int,
        metavar="S",
        help="the engine seed: request i samples with a seed made of S and i (a --prompts "
        "line's own seed wins); default 0",
    )
    samp.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    samp.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end a request where TEXT appears in its output (repeat for several; a --prompts "
        'line\'s "stop", a string or a list, replaces them); the text is cut before it (a '
        "TEXT that starts with '-': --stop=TEXT)",
    )
    samp.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the stop string (or the stop token's text) at the end of the output text",
    )
    samp.add_argument(
        "--logprobs",
        type=_logprobs_count,
        metavar="N",
        help="write each output token's log-probability under the target and those of the N "
        "most likely tokens at its position (0: the token's alone); a --prompts line's "
        '"logprobs" wins',
    )
    samp.add_argument(
        "--max-logprobs",
        type=_logprobs_count,
        metavar="N",
        help="the most alternatives any request may ask for (the steps compute that many); "
        'default: the largest --logprobs or --prompts "logprobs" asks, none when no request '
        "asks (needed under torchrun, where only rank 0 reads the prompts)",
    )

    eng = gen.add_argument_group("engine")
    eng.add_argument(
        "--page-size",
        type=_int_up_to(MAX_PAGE_SIZE, "tokens a KV page"),
        metavar="N",
        default=16,
        help=f"tokens per KV page, at most {MAX_PAGE_SIZE}",
    )
    eng.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        metavar="N",
        help="requests in flight at most (default: 512 on a GPU, 64 on the CPU; one process "
        "with fewer prompts: their number)",
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        metavar="N",
        help="tokens one forward takes at most: decode rows (k + 1 tokens each) first, then "
        "prefill chunks (long prompts are split over steps) (default: 8192 on a GPU, 2048 on "
        "the CPU, at least --max-num-seqs x (k + 1))",
    )
    eng.add_argument(
        "--max-model-len",
        type=_int_in(2, None, "context tokens: the prompt and at least one output token"),
        metavar="N",
        help="default: from the checkpoint",
    )
    eng.add_argument(
        "--num-pages",
        type=_int_in(2, None, "KV pages; page 0 is reserved"),
        metavar="N",
        help="KV pages (default: CPU: --max-num-seqs full-length requests; GPU: from the "
        "memory fraction)",
    )
    eng.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.85,
        metavar="F",
        help="GPU: share of free memory for the KV cache",
    )
    eng.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="keep prefilled KV pages and reuse them for prompts that start the same (shared "
        "system prompts, few-shot examples, repeated prompts)",
    )
    eng.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        help="CPU: torch intra-op threads, at most the CPUs this process may use (default: "
        "OMP_NUM_THREADS if set, else one per 50 M parameters, at most the cores free)",
    )
    eng.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size")
    eng.add_argument("--dp", type=_positive_int, default=1, help="data-parallel size")
    eng.add_argument(
        "--dist-timeout",
        type=_int_up_to(MAX_DIST_TIMEOUT_S, "seconds, about 11.6 days at most"),
        default=300,
        metavar="S",
        help=f"seconds a rank waits for the others before the run fails (at most "
        f"{MAX_DIST_TIMEOUT_S})",
    )

    spec = gen.add_argument_group("speculative decoding and CUDA graphs")
    spec.add_argument(
        "--draft",
        type=_path("pass a drafter checkpoint directory, or leave --draft out"),
        metavar="DIR",
        help="drafter checkpoint dir",
    )
    spec.add_argument(
        "--algo",
        choices=["eagle3", "draft-model", "dflash"],
        help="drafter kind (default: plain decoding; eagle3 for the bundled model)",
    )
    spec.add_argument(
        "--num-draft-tokens",
        type=_int_in(0, MAX_DRAFT_TOKENS, "tokens drafted a step; 0: plain decoding"),
        metavar="K",
        help="tokens drafted per step (default: 3; dflash: the checkpoint's block size - 1; "
        "0: plain decoding)",
    )
    spec.add_argument(
        "--speculation",
        choices=["fixed", "auto"],
        default="fixed",
        help="fixed: every step drafts K tokens; auto: each step drafts K or none, whichever "
        "this machine's measured step times and the live acceptance make faster (default: "
        "%(default)s)",
    )
    spec.add_argument(
        "--sampled-verify",
        choices=["rejection", "match"],
        default="rejection",
        help="how sampled requests verify drafts: rejection sampling (accepts the most drafts), "
        "or match: a draft is accepted when it equals the token plain sampling draws there, "
        "so seeded output equals the plain run's for any drafter, K and --speculation "
        "(default: %(default)s)",
    )
    spec.add_argument(
        "--catch-up-depth",
        type=_int_in(0, MAX_CATCH_UP_DEPTH, "plain steps between catch-ups; 0: every step"),
        default=8,
        metavar="N",
        help="with --speculation auto: steps that draft nothing record the drafter's inputs "
        "and catch it up every N such steps, or before one that drafts (0: every step; "
        "default: %(default)s)",
    )
    spec.add_argument(
        "--capture-sizes",
        type=_capture_sizes,
        metavar="1,2,4,8",
        help="batch sizes to capture a CUDA graph for (default: 1, 2, 4, 8, 16, ... 160, 176, "
        "192, ... 256, 288, 320, ... 512, at most --max-num-seqs)",
    )
    spec.add_argument(
        "--max-capture-size", type=_positive_int, metavar="N", help="capture no larger batch"
    )
    spec.add_argument(
        "--disable-graph-padding",
        action="store_true",
        help="replay only exact captured sizes (else pad up to the next one)",
    )
    spec.add_argument(
        "--piecewise-sizes",
        type=_piecewise_sizes,
        metavar="16,32,...",
        help="token counts to capture graphs of prefill and mixed steps for (default: 16, 32, "
        "64, 96, ... 2048, at most --max-num-batched-tokens; larger steps run eagerly, their "
        "launches hidden by their compute; none: run them all eagerly)",
    )
    spec.add_argument(
        "--piecewise-capture",
        choices=["eager", "lazy"],
        default="eager",
        help="capture those graphs at start (eager) or at each size's first use (lazy)",
    )
    spec.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    spec.add_argument("--eager-padding", action="store_true", help="pad eager batches (testing)")
    spec.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one rank: launch the next decode step before reading the current one back, while "
        "the batch cannot change (--no-overlap: read every step back first)",
    )
    spec.add_argument(
        "--attention-backend",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="attention and fused kernels (default: triton on CUDA when installed, else torch)",
    )

    moe = gen.add_argument_group("mixture-of-experts targets (experts split over all ranks)")
    moe.add_argument(
        "--moe-backend",
        choices=["auto", "local", "all2all", "deepep"],
        default="auto",
        help="how tokens reach their experts' rank (default: local on one rank, else DeepEP "
        "low-latency on CUDA when installed and the hidden size fits, else all2all)",
    )
    moe.add_argument(
        "--moe-max-tokens-per-rank",
        type=_positive_int,
        metavar="N",
        help="most tokens one rank dispatches at once (default and minimum: one decode step, "
        "max_num_seqs // dp * (k + 1)); larger forwards run in chunks",
    )

    gen.add_argument("--debug", action="store_true", help="show tracebacks")
    accept_rate.add_parser(commands, HelpFormatter)
    if launcher_flags is not None:
        for each in (parser, *commands.choices.values()):
            launcher_flags(each)
    return parser


@dataclass
class PromptSpec:
    """One request from the command line or a --prompts line, with its sampling overrides."""

    prompt: str | list[int] | Chat
    overrides: dict[str, Any] = field(default_factory=dict)
    where: str = "--prompt"  # what an error about it names: FILE:LINE of a --prompts line


@contextlib.contextmanager
def prompts_named(specs: Sequence[PromptSpec]) -> Iterator[None]:
    """Errors the engine finds in prompt i (executor/engine's PromptError: "prompt i has ...")
    name where the user wrote it: the --prompts FILE:LINE (blank lines counted), or --prompt."""
    try:
        yield
    except PromptError as exc:
        raise prompt_named(exc, specs) from None


def prompt_named(exc: PromptError, specs: Sequence[PromptSpec]) -> SpeculantError:
    """`exc` as it names where the user wrote prompt i (`exc` itself when i is not in specs)."""
    if not 0 <= exc.index < len(specs):
        return exc
    detail = exc.detail.removeprefix(":").strip()
    return SpeculantError(f"{specs[exc.index].where}: the prompt {detail}")


# Values travel to the device as float32 and int64: finite numbers, integers that fit int64.
_SAMPLING_RULES = {
    "max_new_tokens": (int, lambda v: v > 0, "a positive integer"),
    "n": (int, lambda v: 1 <= v <= MAX_N, f"an integer in 1..{MAX_N}"),
    "temperature": (
        (int, float),
        lambda v: 0 <= v <= FLOAT32_MAX,
        f"a finite number in 0..{FLOAT32_MAX:.4g} (float32; 0 = greedy)",
    ),
    "top_k": (int, lambda v: -1 <= v <= INT64_MAX, f"an integer in 0..{INT64_MAX} (0 or -1 = off)"),
    "top_p": ((int, float), lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": ((int, float), lambda v: 0 <= v <= 1, "a number in [0, 1] (0 = off)"),
    "seed": (int, lambda v: INT64_MIN <= v <= INT64_MAX, f"an integer in {INT64_MIN}..{INT64_MAX}"),
    "logprobs": (int, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in 0..{MAX_LOGPROBS}"),
}


def sampling_problem(key: str, value: Any) -> str | None:
    """What a valid `key` looks like, if `value` is not one; None when it is fine."""
    kind, ok, expected = _SAMPLING_RULES[key]
    if key in ("seed", "logprobs") and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
        return expected
    return None


def read_prompts_file(path: str) -> list[PromptSpec]:
    """Parse a --prompts JSONL file; any bad line (JSON, UTF-8, fields) is an error naming
    file:line."""
    check_readable_file(path, "prompts file")
    try:
        data = read_input(path)
    except OSError as exc:
        raise SpeculantError(f"prompts file {path!r} cannot be read ({exc.strerror})") from None
    specs = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        try:  # a UTF-8 byte-order mark at the start is not part of the first line
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise SpeculantError(
                f"{path}:{lineno}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column "
                f"{exc.start + 1}); save the file as UTF-8"
            ) from None
        if line.strip():
            specs.append(_parse_prompt_line(line, f"{path}:{lineno}"))
    if not specs:
        raise SpeculantError(f"prompts file {path!r} has no prompts; add one JSON object per line")
    return specs


def text_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized (a lone surrogate: a JSON escape \\ud800 without its
    pair, or a byte the terminal could not decode), None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds {text[exc.start]!r} at character {exc.start}, a lone surrogate that is not "
            "valid Unicode text"
        )
    return None


class _NumberTooLong(ValueError):
    """A JSON integer of more digits than Python converts (sys.get_int_max_str_digits)."""


def _json_int(text: str) -> int:
    """json's parse_int: int(), naming the number when it has too many digits to convert."""
    try:
        return int(text)
    except ValueError:
        raise _NumberTooLong(text) from None


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object of a --prompts line."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _parse_prompt_line(line: str, where: str) -> PromptSpec:
    try:
        obj = json.loads(line, parse_int=_json_int, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise SpeculantError(
            f"{where}: the key {exc.args[0]!r} is given twice; keep one (JSON readers differ "
            "on which one counts)"
        ) from None
    except json.JSONDecodeError as exc:
        raise SpeculantError(
            f"{where}: not valid JSON ({exc.msg}); write one object per line"
        ) from None
    except _NumberTooLong as exc:
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise SpeculantError(
            f"{where}: the number {shown(str(exc))} has more than {limit} digits, more than "
            "can be read; token ids and sampling values are far smaller: fix that number"
        ) from None
    except RecursionError:
        raise SpeculantError(
            f"{where}: JSON nested too deeply to read; write one flat object per line"
        ) from None
    if not isinstance(obj, dict):
        raise SpeculantError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(PROMPT_KEYS) - set(SAMPLING_KEYS) - {CHAT_KWARGS_KEY})
    if unknown:
        allowed = ", ".join(PROMPT_KEYS + (CHAT_KWARGS_KEY,) + SAMPLING_KEYS)
        raise SpeculantError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {allowed}")
    if sum(key in obj for key in PROMPT_KEYS) != 1:
        raise SpeculantError(
            f"{where}: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"
        )
    if "messages" in obj:
        if problem := messages_problem(obj["messages"]):
            raise SpeculantError(f"{where}: 'messages' {problem}")
    if CHAT_KWARGS_KEY in obj:
        if "messages" not in obj:
            raise SpeculantError(
                f"{where}: '{CHAT_KWARGS_KEY}' applies to a 'messages' conversation only"
            )
        if problem := template_kwargs_problem(obj[CHAT_KWARGS_KEY]):
            raise SpeculantError(f"{where}: '{CHAT_KWARGS_KEY}' {problem}")
    prompt = obj.get("prompt", obj.get("prompt_token_ids"))
    if "prompt" in obj and not (isinstance(prompt, str) and prompt):
        raise SpeculantError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if "prompt" in obj and (problem := text_problem(prompt)):
        raise SpeculantError(f"{where}: 'prompt' {problem}; fix the text (pair the \\u escapes)")
    if "prompt_token_ids" in obj and not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        raise SpeculantError(
            f"{where}: 'prompt_token_ids' must be a non-empty list of token ids >= 0, "
            f"got {prompt!r}"
        )
    overrides = {k: obj[k] for k in SAMPLING_KEYS if k in obj}
    for key, value in overrides.items():
        if key == "stop" and (problem := stop_problem(value)):
            raise SpeculantError(f"{where}: 'stop' {problem}")
        if key != "stop" and (expected := sampling_problem(key, value)):
            raise SpeculantError(f"{where}: {key}={value!r} is invalid; use {expected}")
    if "messages" in obj:
        prompt = Chat(obj["messages"], obj.get(CHAT_KWARGS_KEY))
    return PromptSpec(prompt, overrides, where)


def reads_inputs() -> bool:
    """Whether this process reads the prompts and writes the outputs: a single process, or
    global rank 0 of a job (spawn, torchrun); the other ranks get rank 0's prompts."""
    return os.environ.get("RANK", "0") == "0"


def _prepare(args: argparse.Namespace) -> list[PromptSpec]:
    """All checks that need no model; returns the requests to run ([] on ranks other than 0).
    Sets --max-logprobs, when not given, to --logprobs (every rank sees that flag) and raises it
    to what the --prompts lines ask (passed on to the ranks a local launch starts)."""
    specs = _prepare_specs(args)
    given = args.max_logprobs
    if given is None:
        args.max_logprobs = args.logprobs
    elif args.logprobs is not None and args.logprobs > given:
        raise SpeculantError(
            f"--logprobs {args.logprobs} is more than --max-logprobs {given} allows; raise "
            f"--max-logprobs to {args.logprobs} or leave it out"
        )
    asked = [(s.where, s.overrides.get("logprobs", args.logprobs)) for s in specs]
    asked = [(where, n) for where, n in asked if n is not None]
    if asked:
        where, needed = max(asked, key=lambda item: item[1])
        if args.max_logprobs is None or args.max_logprobs < needed:
            if given is not None or "RANK" in os.environ:
                # a value given is the user's limit; a rank of a torchrun job cannot raise it
                # alone (the other ranks do not read the prompts, and all must compute alike)
                limit = f"is {given}" if given is not None else "is not given"
                if given is None and args.logprobs is not None:
                    limit = f"is {args.logprobs}, from --logprobs"
                raise SpeculantError(
                    f"{where}: logprobs={needed} is more than --max-logprobs allows (it "
                    f"{limit}); pass --max-logprobs {needed}"
                )
            args.max_logprobs = needed
            args.argv = [*getattr(args, "argv", []), "--max-logprobs", str(needed)]  # local ranks
        if not args.output:
            where = "--logprobs" if args.logprobs is not None else asked[0][0]
            raise SpeculantError(
                f"{where}: log-probabilities are written in --output lines, and none is given "
                "(printed completions show their text alone); pass --output FILE.jsonl"
            )
    return specs


def _prepare_specs(args: argparse.Namespace) -> list[PromptSpec]:
    """`_prepare`'s checks and the requests they read."""
    if args.demo_model and args.target:
        raise SpeculantError("pass either --target DIR or --demo-model, not both")
    bundled_run = args.bundled_run = not args.demo_model and not args.target
    args.bundled_draft = False  # whether the drafter is a bundled one (its summary line says so)
    if bundled_run:  # the default run: the bundled code model, EAGLE-3 unless told otherwise
        args.target = str(accept_rate.bundled("target"))
        if args.algo is None and args.draft is None:
            args.algo = "eagle3"
        if args.algo is not None and args.draft is None:
            args.draft = str(accept_rate.bundled(accept_rate.BUNDLED_DRAFTS[args.algo]))
            args.bundled_draft = True
    if not args.demo_model:
        if not Path(args.target).is_dir():
            raise SpeculantError(
                f"--target {args.target!r} is not a directory; pass a HF checkpoint directory"
            )
    if args.draft and not Path(args.draft).is_dir():
        raise SpeculantError(
            f"--draft {args.draft!r} is not a directory; pass a drafter checkpoint"
        )
    if args.num_draft_tokens is not None and args.num_draft_tokens < 0:
        raise SpeculantError(f"--num-draft-tokens {args.num_draft_tokens} must be >= 0")
    if not 0 < args.kv_cache_memory_fraction <= 1:  # NaN fails too
        raise SpeculantError(
            f"--kv-cache-memory-fraction {args.kv_cache_memory_fraction} must be in (0, 1]"
        )
    check_threads(args.threads)
    check_rows_for_dp(args.max_num_seqs, args.dp)  # before any rank starts
    if args.stop is not None and (problem := stop_problem(args.stop)):
        raise SpeculantError(f"--stop {problem}")
    for key in _SAMPLING_RULES:  # stop: above
        if expected := sampling_problem(key, getattr(args, key)):
            flag = "--" + key.replace("_", "-")
            raise SpeculantError(f"{flag} {getattr(args, key)} is invalid; use {expected}")
    if not reads_inputs():
        return []  # rank 0 reads the prompts and sends them to every rank (executor/dp.py)
    if args.output:
        check_writable(args.output, "--output")
    elif problem := stdout_problem(sys.stdout):
        raise SpeculantError(
            f"stdout {problem}, so the completions printed there would be lost; pass --output "
            "FILE to write them to a file (or run with stdout open)"
        )
    check_outside_checkpoints(
        [("--output", args.output)], [("--target", args.target), ("--draft", args.draft)]
    )
    if args.output and args.prompts and same_file(args.output, args.prompts):
        raise SpeculantError(
            f"--output {args.output!r} is the --prompts file {args.prompts!r} (the same file on "
            "disk): writing it would destroy the prompts; pick another --output"
        )
    if args.prompts:
        return read_prompts_file(args.prompts)
    if args.prompt is None and bundled_run:
        return [PromptSpec(DEFAULT_PROMPT)]
    if args.prompt is None:
        raise SpeculantError("no prompt given; pass --prompt TEXT or --prompts FILE.jsonl")
    if not args.prompt:
        raise SpeculantError("--prompt is empty; give some text")
    if problem := text_problem(args.prompt):
        raise SpeculantError(f"--prompt {problem}; pass UTF-8 text")
    return [PromptSpec(args.prompt)]


def stdout_problem(stream: TextIO | None) -> str | None:
    """Why nothing can be printed on `stream` (this process's stdout): closed (`>&-`: Python
    then drops every print), or open for reading only (`1<file`); None when it is open for
    writing, or is no file (a test's capture): a write that fails later is named then."""
    if stream is None or getattr(stream, "closed", False):
        return "is closed"
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: not a file
        return None
    try:
        import fcntl
    except ImportError:  # Windows: no flags to read
        return None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:  # EBADF: the descriptor was closed
        return "is closed"
    return "is open for reading only" if flags & os.O_ACCMODE == os.O_RDONLY else None


@contextlib.contextmanager
def stdout_errors_named() -> Iterator[None]:
    """Turn an OSError while printing completions (stdout on a full disk, /dev/full, a closed
    pipe) into the one-line error naming stdout and the fix."""
    try:
        yield
    except OSError as exc:
        raise SpeculantError(
            f"writing completions to stdout failed ({(exc.strerror or str(exc)).lower()}); pass "
            "--output FILE to write them to a file"
        ) from None


@contextlib.contextmanager
def output_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive lock on the --output file while this run writes it (`fcntl.flock`,
    non-blocking; the kernel drops it when the process ends, however it ends): a second run
    writing the same file is refused at once, before any model loads. Regular files only
    (`/dev/stdout` stays shareable); a file this creates and leaves empty is removed."""
    try:
        import fcntl
    except ImportError:  # no flock here (Windows): unlocked
        fcntl = None
    if not path or fcntl is None:
        yield
        return
    existed = os.path.exists(path)
    if existed and not os.path.isfile(path):  # a device or a FIFO (whose open would block
        yield  # until it has a reader: paths.open_output says so when it does)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        raise SpeculantError(
            f"--output {path!r} cannot be opened for writing ({exc.strerror}); pick another path"
        ) from None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SpeculantError(
                    f"--output {path!r} is being written by another run (it holds the file's "
                    "lock); wait for that run to end or pick another path"
                ) from None
        yield
    finally:
        created = os.fstat(fd)
        with contextlib.suppress(OSError):
            if not existed and created.st_size == 0 and os.stat(path).st_ino == created.st_ino:
                os.unlink(path)  # nothing was written: leave no empty file behind
        os.close(fd)


def default_max_num_seqs(
    num_requests: int, capture_sizes: list[int] | None, device: str = "cpu"
) -> int:
    """One process's --max-num-seqs when none is given: no more slots than requests (a KV cache
    and a set of graphs sized for them, not for the device default), with room for explicit
    capture sizes."""
    default = DEFAULT_MAX_NUM_SEQS["cuda" if device.startswith("cuda") else "cpu"]
    return min(default, max(num_requests, *(capture_sizes or [1])))


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed if args.seed is not None else 0,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,  # None: the engine's default for the device
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=args.enable_prefix_caching,
        draft=args.draft,
        algo=args.algo,
        num_draft_tokens=args.num_draft_tokens,
        speculation=args.speculation,
        catch_up_depth=args.catch_up_depth,
        sampled_verify=args.sampled_verify,
        capture_sizes=args.capture_sizes,
        max_capture_size=args.max_capture_size,
        disable_graph_padding=args.disable_graph_padding,
        enforce_eager=args.enforce_eager,
        eager_padding=args.eager_padding,
        piecewise_sizes=args.piecewise_sizes,
        piecewise_capture=args.piecewise_capture,
        overlap=args.overlap,
        max_logprobs=args.max_logprobs,
        attention_backend=args.attention_backend,
        tp=args.tp,
        dp=args.dp,
        moe_backend=args.moe_backend,
        moe_max_tokens_per_rank=args.moe_max_tokens_per_rank,
    )


def summary_line(outputs: list, seconds: float, adaptive: bool = False) -> str:
    """`requests=N prompt_tokens=.. output_tokens=.. time=..s tokens/s=.. [accept_len=..]`,
    and with `adaptive` (--speculation auto) how many rows drafted and how many did not."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(len(out.token_ids) for out in outputs)
    line = (
        f"requests={len(outputs)} prompt_tokens={prompt_tokens} output_tokens={output_tokens} "
        f"time={seconds:.2f}s tokens/s={output_tokens / max(seconds, 1e-9):.1f}"
    )
    preemptions = sum(out.stats.get("num_preemptions", 0) for out in outputs)
    if preemptions:
        line += f" preemptions={preemptions}"
    measured = accept_rate.acceptance(outputs)  # over the requests that verified
    if measured is not None:
        accept_len, per_position, _ = measured
        line += f" accept_len={accept_len:.2f}"
        if per_position:
            line += " per_position=" + ",".join(f"{r:.2f}" for r in per_position)
    plain_steps = sum(out.stats.get("num_plain_steps", 0) for out in outputs)
    if adaptive:  # --speculation auto: how often rows drafted k and how often none
        verify_steps = sum(out.stats.get("num_verify_steps", 0) for out in outputs)
        line += f" drafted_rows={verify_steps} plain_rows={plain_steps}"
    return line


def run_generate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Validate, load the engine, generate, write outputs and print the summary."""
    specs = _prepare(args)
    if args.tp * args.dp > 1 and "RANK" not in os.environ:  # start the ranks, one per GPU
        from speculant.launch.spawn import launch_cli

        _check_tp(args)  # before a process starts: each would load torch to find out

        device = _engine_kwargs(args)["device"]
        return launch_cli(
            args.argv, args.tp * args.dp, device, stderr, output=args.output, stdout=stdout
        )
    from speculant.launch.spawn import rank_spool

    out_file = None
    finished: list = []  # without --output: printed at the end, or when the run stops or fails
    spool = None if args.output else rank_spool()  # rank 0 under launch_cli: its launcher's
    on_printed = None if spool is None else spool.printed

    def on_output(out: Any) -> None:  # written and flushed as requests end (rank 0 writes)
        nonlocal out_file
        if args.output:
            with write_errors_named(args.output, "--output"):
                out_file = out_file or open_output(args.output)
                write_lines(out_file, [out.json_line()])
        else:
            finished.append(out)
            if spool is not None:  # the launcher prints it if this rank cannot
                spool.add(out.key, completion_line(out, specs))

    with output_lock(args.output if reads_inputs() else None):  # held until the file is done
        try:
            outputs, seconds = generate_in_rank(args, specs, on_output=on_output)
        except BaseException:  # Ctrl-C, SIGTERM, a peer rank gone: what finished is printed
            if finished:
                done = sorted(finished, key=lambda o: o.key)
                try:
                    print_completions(done, stdout, specs, on_printed=on_printed)
                except SpeculantError as exc:  # stdout full: said, and the stop still ends it
                    print(f"speculant: error: {exc}", file=sys.stderr)
            raise
        finally:
            if out_file is not None:
                with write_errors_named(args.output, "--output"):  # close flushes the buffer
                    out_file.close()
    if outputs is not None:  # rank 0 (or the one process) reports
        kept = dict(write_file=False, specs=specs, on_printed=on_printed)
        report_outputs(args, outputs, seconds, stdout, stderr, **kept)
    return 0


def _check_tp(args: argparse.Namespace) -> None:
    """--tp against the target's attention heads and MLP width (config.json), as its layers
    will check it in every rank."""
    if args.tp == 1 or args.demo_model:
        return
    from speculant.config import ModelConfig
    from speculant.models.layers import heads_tp_problem

    cfg = ModelConfig.from_dir(args.target)
    dense = len(cfg.moe_layer_ids) < cfg.num_layers  # (experts divide by expert parallelism)
    mlp = cfg.intermediate_size if dense else None
    if problem := heads_tp_problem(cfg.num_heads, cfg.num_kv_heads, args.tp, mlp):
        raise SpeculantError(problem)


# a rank's own (its inputs and outputs, logging, threads, timeout): the only flags whose value
# may differ between the ranks of a job
RANK_OWN_FLAGS = frozenset(
    ("argv", "prompt", "prompts", "output", "baseline", "compare", "plot", "report", "rtol",
     "write_baseline", "debug", "threads", "dist_timeout")
)  # fmt: skip


def job_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags every rank of a job must share, as `--flag` -> value."""
    return {
        "--" + key.replace("_", "-"): value
        for key, value in sorted(vars(args).items())
        if key not in RANK_OWN_FLAGS
    }


def generate_in_rank(
    args: argparse.Namespace,
    specs: list[PromptSpec],
    on_output: Any = None,
    use_tqdm: bool = True,
) -> tuple[list | None, float]:
    """One rank's `generate` (spawn, torchrun and Ray actors all run this): build the engine,
    joining the job in the environment when tp * dp > 1, and generate. Rank 0's `specs` count
    (the others pass []). Returns the outputs in input order and the seconds generation took on
    rank 0 (or the one process), (None, seconds) on the other ranks."""
    from speculant import Engine, SamplingParams  # after the checks: loads torch and the core

    options = job_options(args)  # before --demo-model names this node's folder
    if args.demo_model:
        from speculant.launch.demo import build_demo_model

        args.target = str(build_demo_model())
        print(f"demo model (random weights, gibberish output): {args.target}", file=sys.stderr)
    kwargs = _engine_kwargs(args)
    if args.max_num_seqs is None and args.tp * args.dp == 1:
        requests = sum(s.overrides.get("n", args.n) for s in specs)  # each completion is one
        args.max_num_seqs = default_max_num_seqs(requests, args.capture_sizes, args.device)
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.device == "cpu":
        set_cpu_threads(args.threads, [args.target, args.draft], args.tp * args.dp)
    pctx = None  # one process; else this process is one rank of the job
    if args.tp * args.dp > 1:
        from speculant.comm.groups import ParallelContext
        from speculant.launch.spawn import fault_point

        pctx = ParallelContext.from_env(args.tp, args.dp, args.device, args.dist_timeout, options)
    engine = Engine(target=args.target, pctx=pctx, **kwargs)
    if pctx is not None:
        fault_point(pctx.rank)
    base = dict(
        max_new_tokens=args.max_new_tokens,
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        stop=tuple(args.stop or ()),
        include_stop_str_in_output=args.include_stop_str_in_output,
        logprobs=args.logprobs,
    )  # --seed is the engine's (_engine_kwargs): request i samples with a seed made of it and i
    params = [SamplingParams(**{**base, **s.overrides}, ignore_eos=args.ignore_eos) for s in specs]
    start = time.perf_counter()
    with prompts_named(specs):  # a bar only when there is more than one request to count
        outputs = engine.generate(
            [s.prompt for s in specs], params, use_tqdm=use_tqdm and len(specs) > 1,
            on_output=on_output,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    if (pctx is None or pctx.rank == 0) and len(specs) > 1:  # a job: how the scheduler ran it
        stats = engine.stats()

        def text(value) -> str:  # a dict (drafts chosen -> steps) as 0:120,3:880
            if isinstance(value, dict):
                return ",".join(f"{k}:{v}" for k, v in value.items())
            return str(value)

        # under DP each rank schedules its own share: this line is rank 0's (the summary line's
        # preemptions are the job's)
        where = "scheduler: " if args.dp == 1 else f"scheduler (DP rank 0 of {args.dp}): "
        print(where + " ".join(f"{k}={text(v)}" for k, v in stats.items()), file=sys.stderr)
    if pctx is not None:
        pctx.close()
    return (outputs if pctx is None or pctx.rank == 0 else None), seconds


def report_outputs(
    args: argparse.Namespace,
    outputs: list,
    seconds: float,
    stdout: TextIO,
    stderr: TextIO,
    write_file: bool = True,
    specs: list[PromptSpec] | None = None,
    on_printed: Callable[[tuple[int, int]], None] | None = None,
) -> None:
    """Rank 0's (or the Ray driver's) report: the --output file (when `write_file`; a single
    process wrote it as requests finished), or else one `[index] prompt+completion` per request
    (the text prompt from `specs`, so the program reads whole; `on_printed` as for
    print_completions); then the summary line."""
    if args.output and write_file:
        with (
            write_errors_named(args.output, "--output"),
            open_output(args.output) as out_file,
        ):
            write_lines(out_file, (out.json_line() for out in outputs))
    elif not args.output:
        print_completions(outputs, stdout, specs, on_printed=on_printed)
    if getattr(args, "bundled_draft", False) and (line := bundled_drafter_line(args, outputs)):
        print(line, file=stderr)
    adaptive = getattr(args, "speculation", None) == "auto"
    print(summary_line(outputs, seconds, adaptive), file=stderr)  # the last line, as scripts expect


def print_completions(
    outputs: list,
    stdout: TextIO,
    specs: list[PromptSpec] | None,
    on_printed: Callable[[tuple[int, int]], None] | None = None,
) -> None:
    """One `[index] prompt+completion` line per output (the text prompt from `specs`). With
    `on_printed` (rank 0 of a spawn job: its launcher's spool, launch/spawn.py), each line is
    flushed and then its index passed to it: the launcher prints only the lines not passed."""
    with stdout_errors_named():
        for out in outputs:
            print(completion_line(out, specs), file=stdout)
            if on_printed is not None:
                stdout.flush()
                on_printed(out.key)
        stdout.flush()  # a write that fails fails here, not at exit


def completion_line(out: Any, specs: list[PromptSpec] | None) -> str:
    """`[index] prompt+completion` (the text prompt from `specs`), or `[index] [token ids]`;
    `[index:j]` for completion j of a prompt that asked for several (n)."""
    shown = out.text if out.text is not None else out.token_ids
    prompt = specs[out.index].prompt if specs else None
    if isinstance(prompt, str) and out.text is not None:
        shown = prompt + out.text
    if out.n > 1:  # one of the prompt's n completions
        return f"[{out.index}:{out.sample_index}] {shown}"
    return f"[{out.index}] {shown}"


DRAFTER_NAMES = {"eagle3": "EAGLE-3 head", "dflash": "DFLASH drafter", "draft-model": "draft LM"}


def bundled_drafter_line(args: argparse.Namespace, outputs: list) -> str | None:
    """What the bundled run's drafter did, in words (None for a plain run or no verify step)."""
    measured = accept_rate.acceptance(outputs)
    if args.algo not in DRAFTER_NAMES or measured is None or not measured[1]:
        return None
    accept_len, per_position, steps = measured
    others = "|".join(algo for algo in DRAFTER_NAMES if algo != args.algo)
    # one request verifies once a forward; several share each forward, one row each
    verified = f"its {steps} forwards" if len(outputs) == 1 else f"{steps} verify rows"
    return (
        f"speculant: the bundled {DRAFTER_NAMES[args.algo]} drafts {len(per_position)} tokens a "
        f"step; the target accepted {accept_len - 1:.2f} of them on average, so each of "
        f"{verified} emitted {accept_len:.2f} tokens instead of 1 (--algo {others}: the other "
        "bundled drafters)"
    )


def started_by_torchrun() -> bool:
    """This process is a worker torchrun's agent started with `speculant ...` itself (`-m
    speculant`, the console script) rather than through `-m speculant.launch.torchrun`: no
    speculant launcher (spawn, torchrun's module, a Ray actor) set up its rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "SPECULANT_RANK_DEVICE" not in os.environ


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `speculant` command; returns the exit status."""
    from speculant.launch.spawn import (
        close_progress_bars,
        stop_on_sigterm,
        stopped_line,
        tell_torchrun,
    )

    tolerant_stderr()  # a stderr that fails (`| head`, a full disk) stops no run: diagnostics
    if started_by_torchrun():  # one rank of the job, set up as the torchrun module sets it up
        from speculant.launch import torchrun  # (ends with its agent, one line a failure)

        torchrun.main(argv)  # never returns

    # Ctrl-C and SIGTERM stop the run (exit 130, 143). Until the try below is entered they are
    # only recorded (as they were while this module imported: EARLY_STOPS); then raised.
    restore_signals = stop_on_sigterm(armed=False, pending=EARLY_STOPS)
    EARLY_STOPS.clear()  # passed on: this module's recorder no longer runs
    args = argparse.Namespace(debug=False, output=None)
    try:
        try:
            args = build_parser().parse_args(argv)
            args.argv = list(sys.argv[1:] if argv is None else argv)  # what the ranks re-run
            for stream in (sys.stdout, sys.stderr):  # a completion the terminal cannot show
                if hasattr(stream, "reconfigure"):  # is escaped
                    stream.reconfigure(errors="backslashreplace")
            if not logging.getLogger().handlers:  # ours alone log INFO; libraries' stay quiet
                logging.basicConfig(level=logging.WARNING, format="speculant: %(message)s")
                level = logging.DEBUG if args.debug else logging.INFO
                logging.getLogger("speculant").setLevel(level)
            stop_on_sigterm()  # from here a stop raises (at once, one that came before)
            if args.command == "accept-rate":
                code = accept_rate.run_accept_rate(args, sys.stdout, sys.stderr)
            else:
                code = run_generate(args, sys.stdout, sys.stderr)
        except (SpeculantError, ValueError, OSError) as exc:
            if args.debug:
                raise
            close_progress_bars()
            # every rank checks rank 0's prompts: rank 0's line names the --prompts line
            if not (isinstance(exc, PromptError) and not reads_inputs()):
                line = f"speculant: error: {exc}".splitlines()[0]
                told = tell_peers(exc, line)
                if says_user_errors():
                    print(line, file=sys.stderr)
                elif told:  # one rank's own (a shard only its node cannot read)?
                    say_unless_local_rank0_did(exc, line)
                tell_torchrun(line)
                hold_for_local_rank0()
            code = 2
        restore_signals()  # inside the try: a stop up to here still ends as a stop
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        close_progress_bars()  # so that this line is the last on stderr
        output = getattr(args, "output", None) if reads_inputs() else None  # rank 0 writes it
        line, code = stopped_line(exc, output, ranks=False)
        print(line, file=sys.stderr)
    finally:
        restore_signals()
    if code in (130, 143) and _started_as_command():
        # the process ends now with this status: a second Ctrl-C or SIGTERM must not kill it
        # first (at exit Python puts back the default handlers, which would: status -2)
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is _record_early_stop:
                signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":  # python -m speculant.launch.cli, as python -m speculant
    sys.exit(main())
