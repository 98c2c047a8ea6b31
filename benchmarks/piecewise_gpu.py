"""Piecewise graphs of extend steps ([piecewise]) on one GPU, on the Llama-3.1-8B shape with dummy
bf16 weights: prefill-only steps of 16 / 256 / 2048 tokens and a mixed step (64 decode rows +
one 512-token chunk), each as a graph replay, an eager forward padded to its bucket and the
eager unpadded forward (today's path): median step time (`ModelRunner.extend`: forward, logits,
sampling) and token equality (the greedy next tokens, and the largest hidden-state difference).
Then a small generate job with and without the graphs (same engine), `clear_graphs` memory
before / after and a recapture, and the start-up figures (every bucket captured). Every item
records its own error and the script goes on.

`--stage drafters`: the drafters' N-token part of extend steps through their own piecewise graphs
([piecewise] item 2), on the 8B target (its graphs on throughout) with an EAGLE-3 dummy head of
the 8B shape, a DFLASH dummy (z-lab's 5-layer Qwen3-8B-DFlash shape) and a draft model of the
Qwen3-0.6B shape (the target's vocabulary): prefill-only extend steps of 16 and 256 tokens
(`ModelRunner.extend`: target, sampling, the drafter's catch-up and drafts), the drafter's
graphs on vs off (eagerly, unpadded), the N-token part's graphs with the per-sequence part
eager (`per_sequence_eager`: before executor/propose_graphs.py), the target alone (no drafter)
for scale, and EAGLE-3's whole head over the chunk (eager, before the restructure); drafts and
tokens compared.
Buckets 16 and 256 only, so each engine starts quickly.

    python benchmarks/piecewise_gpu.py --json OUT.json [--shape llama8b] [--iters 20]
    python benchmarks/piecewise_gpu.py --json OUT.json --stage drafters [--iters 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_info  # noqa: E402
from graphs import SHAPES, write_config  # noqa: E402
from spec_step import write_dflash, write_head  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402
from speculant.executor.engine import ScratchRequest  # noqa: E402
from speculant.executor.model_runner import SeqInput  # noqa: E402
from speculant.executor.sampling import GREEDY  # noqa: E402

CONTEXT = 512  # the decode rows' cached context in the mixed step


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int) -> tuple[float, object]:
    """Median ms of `fn` (synchronized) over iters runs after 3 warm-ups; its last result."""
    for _ in range(3):
        out = fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out


class Modes:
    """Switch one engine's extend forwards between graphs, padded eager and unpadded eager."""

    def __init__(self, eng: Engine):
        self.eng, self.pw = eng, eng.piecewise

    def set(self, mode: str) -> None:
        self.eng.runner.piecewise = None if mode == "eager" else self.pw
        self.pw.use_graphs = mode == "graph" and self.pw.graphs_possible
        self.pw.pad = mode != "eager"


def step_case(eng: Engine, modes: Modes, name: str, seqs_fn, iters: int) -> dict:
    """One extend step in the three modes: time, next tokens, hidden states."""
    info_n = len(seqs_fn())
    info = eng._sampling_info([ScratchRequest(SamplingParams())] * info_n)
    result = {"case": name, "tokens": sum(len(s.tokens) for s in seqs_fn())}
    outputs = {}
    for mode in ("graph", "padded_eager", "eager"):
        modes.set(mode)
        try:
            ms, out = timed(lambda: eng.runner.extend(seqs_fn(), info, GREEDY), iters)
            hidden = eng.runner.forward_packed(seqs_fn(), info)[0].float().clone()
            outputs[mode] = (out.tokens[:, 0].tolist(), hidden)
            result[f"{mode}_ms"] = round(ms, 3)
        except Exception as exc:  # noqa: BLE001 - record and go on
            result[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
    modes.set("graph")
    if "graph" in outputs:
        g_tokens, g_hidden = outputs["graph"]
        for mode in ("padded_eager", "eager"):
            if mode in outputs:
                tokens, hidden = outputs[mode]
                result[f"tokens_equal_{mode}"] = tokens == g_tokens
                result[f"max_hidden_diff_{mode}"] = float((hidden - g_hidden).abs().max())
        if "eager_ms" in result and "graph_ms" in result:
            result["speedup"] = round(result["eager_ms"] / result["graph_ms"], 2)
    result["bucket"] = eng.piecewise.bucket(result["tokens"], info_n)
    return result


def prefill_seqs(row: int, n: int, vocab: int):
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
    return lambda: [SeqInput(row, 0, tokens, samples=True)]


def mixed_seqs(eng: Engine, rows: list[int], chunk_row: int, vocab: int):
    """64 verify rows (one token each at CONTEXT, plain decoding) and a 512-token chunk; the
    rows' cache lengths are reset each call (a verify step grows them)."""
    gen = torch.Generator().manual_seed(1)
    chunk = torch.randint(3, vocab, (512,), generator=gen).tolist()
    last = torch.randint(3, vocab, (len(rows),), generator=gen).tolist()
    T = eng.tokens_per_req
    index = torch.tensor(rows, device=eng.device)

    def seqs():
        eng.kv.cache_lens[index] = CONTEXT
        pairs = zip(rows, last, strict=True)
        rows_in = [SeqInput(r, CONTEXT, [t] * T, verify=True) for r, t in pairs]
        return rows_in + [SeqInput(chunk_row, 0, chunk, samples=True)]

    return seqs


def run(args) -> dict:
    report: dict = {"shape": args.shape, "items": {}}
    shape = dict(SHAPES[args.shape])
    target = write_config(shape)
    vocab = shape["vocab_size"]
    start = time.perf_counter()
    eng = Engine(
        target, device=args.device, dtype="bfloat16", load_format="dummy", max_num_seqs=128,
        max_model_len=min(4096, shape["max_position_embeddings"]), piecewise=True,
    )  # fmt: skip
    pw = eng.piecewise
    report["startup"] = {
        "wall_s": round(time.perf_counter() - start, 2),
        "startup_s": round(eng.startup_seconds, 2),
        "decode_capture_s": round(eng.decode_capture_seconds, 2),
        "piecewise_capture_s": round(pw.capture_seconds, 2),
        "piecewise_sizes": pw.sizes,
        "piecewise_capture_order": list(pw.capture_order),
        "piecewise_graph_gib": round(pw.memory_bytes / 2**30, 3),
        "decode_graph_gib": round(eng.graphs.graph_memory_bytes / 2**30, 3),
        "max_num_batched_tokens": eng.max_num_batched_tokens,
        "use_graphs": pw.use_graphs,
    }
    print("startup", report["startup"], flush=True)
    modes = Modes(eng)
    items = report["items"]

    def item(name, fn):
        try:
            items[name] = fn()
        except Exception as exc:  # noqa: BLE001 - every item reports on its own
            items[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            traceback.print_exc()
        print(name, items[name], flush=True)

    kv = eng.kv
    row = kv.allocate(2048 + 8)
    for n in (16, 256, 2048):
        item(f"prefill_{n}", lambda n=n: step_case(eng, modes, f"prefill {n}", prefill_seqs(
            row, n, vocab), args.iters))  # fmt: skip
    kv.free(row)

    def mixed():
        rows = [kv.allocate(CONTEXT + 16) for _ in range(64)]
        chunk_row = kv.allocate(512 + 16)
        try:
            for r in rows:  # fill the rows' contexts (eager, once)
                eng.runner.forward_prefill([r], [[5] * CONTEXT], [0])
            return step_case(
                eng, modes, "64 decode rows + 512 chunk", mixed_seqs(eng, rows, chunk_row, vocab),
                args.iters,
            )  # fmt: skip
        finally:
            for r in [*rows, chunk_row]:
                kv.free(r)

    item("mixed_64x1_plus_512", mixed)

    def job():
        gen = torch.Generator().manual_seed(3)
        lengths = torch.randint(16, 1500, (32,), generator=gen).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        params = SamplingParams(max_new_tokens=48, ignore_eos=True)
        out = {}
        for mode in ("graph", "eager", "graph"):
            modes.set(mode)
            before = eng.extend_steps
            t0 = time.perf_counter()
            tokens = [o.token_ids for o in eng.generate(prompts, params)]
            out[f"{mode}_s"] = round(time.perf_counter() - t0, 3)
            out[f"{mode}_extend_steps"] = eng.extend_steps - before
            out.setdefault("tokens", {})[mode] = tokens
        modes.set("graph")
        tokens = out.pop("tokens")
        out["tokens_equal"] = tokens["graph"] == tokens["eager"]
        pairs = zip(tokens["graph"], tokens["eager"], strict=True)
        out["differing_requests"] = sum(a != b for a, b in pairs)
        out["replays"] = pw.stats.replays
        return out

    item("generate_32_requests", job)

    def clear_and_recapture():
        seqs = prefill_seqs(kv.allocate(256 + 8), 256, vocab)
        info = eng._sampling_info([ScratchRequest(SamplingParams())])
        first = eng.runner.extend(seqs(), info, GREEDY).tokens[:, 0].tolist()
        memory = eng.clear_graphs()
        t0 = time.perf_counter()
        eng.capture_graphs()
        recapture_s = time.perf_counter() - t0
        again = eng.runner.extend(seqs(), info, GREEDY).tokens[:, 0].tolist()
        return {
            "reserved_before_gib": round(memory["reserved_before"] / 2**30, 3),
            "reserved_after_gib": round(memory["reserved_after"] / 2**30, 3),
            "freed_gib": round((memory["reserved_before"] - memory["reserved_after"]) / 2**30, 3),
            "captured_gib": round(
                (pw.memory_bytes + eng.graphs.graph_memory_bytes) / 2**30, 3
            ),
            "recapture_s": round(recapture_s, 2),
            "tokens_equal_after_recapture": first == again,
            "replays_after": pw.stats.replays,
        }

    item("clear_graphs", clear_and_recapture)
    report["stats"] = eng.stats()
    return report


# Qwen3-0.6B's layers (28 x hidden 1024, 16 heads, 8 KV heads of 128) on the target's vocabulary
QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
DRAFTER_SIZES = (16, 256)


def drafter_specs(shape: dict) -> dict[str, dict]:
    """Engine options of each drafter (dummy weights) for the target `shape`."""
    lm = {**QWEN3_06B, "vocab_size": shape["vocab_size"],
          "max_position_embeddings": shape["max_position_embeddings"]}  # fmt: skip
    if shape["hidden_size"] < 1024:  # the small shape (a CPU dry run): a small draft LM too
        lm.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)
    head = Path(write_head(shape)) / "config.json"
    config = json.loads(head.read_text())
    config["draft_vocab_size"] = min(config["draft_vocab_size"], shape["vocab_size"])
    head.write_text(json.dumps(config))
    return {
        "eagle3": dict(algo="eagle3", draft=str(head.parent), num_draft_tokens=3),
        "dflash": dict(
            algo="dflash", draft=write_dflash({**shape, "head_dim": 128}, block_size=8),
            num_draft_tokens=7,
        ),
        "draft_model": dict(algo="draft-model", draft=write_config(lm), num_draft_tokens=3),
    }  # fmt: skip


def drafter_case(eng: Engine, n: int, row: int, vocab: int, iters: int) -> dict:
    """A prefill-only extend step of n tokens: the drafter's graphs on, off (eager, unpadded),
    no drafter at all, and for EAGLE-3 the whole head over the chunk (eager, before the
    restructure); ms, drafts and tokens."""
    runner, dpw = eng.runner, eng.piecewise.drafter
    drafter, per_sequence = runner.drafter, eng.piecewise.per_sequence
    seqs = prefill_seqs(row, n, vocab)
    info = eng._sampling_info([ScratchRequest(SamplingParams())])
    result, outputs = {"tokens": n, "bucket": dpw.bucket(n)}, {}
    # (mode, the N-token part's graphs, the per-sequence part's graphs)
    modes = [("drafter_graph", dpw, per_sequence), ("per_sequence_eager", dpw, None),
             ("drafter_eager", None, None), ("target_only", None, None)]  # fmt: skip
    if hasattr(drafter, "head"):
        modes.append(("whole_head_eager", None, None))
    for mode, attached, attached_rows in modes:
        drafter.piecewise, drafter.per_sequence = attached, attached_rows
        runner.drafter = None if mode == "target_only" else drafter
        if mode == "whole_head_eager":
            drafter.propose = drafter.propose_whole_head  # the head over every position
        try:
            replays = dpw.stats.replays
            ms, out = timed(lambda: runner.extend(seqs(), info, GREEDY), iters)
            result[f"{mode}_ms"] = round(ms, 3)
            outputs[mode] = (out.tokens[:, 0].tolist(), out.drafts.tolist())
            if mode == "drafter_graph":
                result["drafter_replays"] = dpw.stats.replays - replays
        except Exception as exc:  # noqa: BLE001 - record and go on
            result[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
        finally:
            drafter.piecewise, drafter.per_sequence, runner.drafter = dpw, per_sequence, drafter
            vars(drafter).pop("propose", None)  # the class's again
    if "drafter_graph" in outputs and "drafter_eager" in outputs:
        g_tokens, g_drafts = outputs["drafter_graph"]
        e_tokens, e_drafts = outputs["drafter_eager"]
        result["tokens_equal"] = g_tokens == e_tokens
        result["drafts_equal"] = g_drafts == e_drafts
        if "per_sequence_eager" in outputs:
            result["drafts_equal_per_sequence_eager"] = outputs["per_sequence_eager"][1] == e_drafts
        if g_drafts != e_drafts:
            result["drafts"] = {"graph": g_drafts, "eager": e_drafts}
        if "whole_head_eager" in outputs:
            result["drafts_equal_whole_head"] = outputs["whole_head_eager"][1] == e_drafts
    if "drafter_graph_ms" in result and "drafter_eager_ms" in result:
        ratio = result["drafter_eager_ms"] / result["drafter_graph_ms"]
        result["drafter_speedup"] = round(ratio, 2)
        if "target_only_ms" in result:
            base = result["target_only_ms"]
            result["drafter_graph_extra_ms"] = round(result["drafter_graph_ms"] - base, 3)
            result["drafter_eager_extra_ms"] = round(result["drafter_eager_ms"] - base, 3)
            if "per_sequence_eager_ms" in result:
                extra = result["per_sequence_eager_ms"] - base
                result["per_sequence_eager_extra_ms"] = round(extra, 3)
    return result


def run_drafters(args) -> dict:
    """The drafters stage: one engine per drafter, one after another (each freed after)."""
    shape = dict(SHAPES[args.shape])
    target, vocab = write_config(shape), shape["vocab_size"]
    report: dict = {"shape": args.shape, "sizes": list(DRAFTER_SIZES), "drafters": {}}
    for name, spec in drafter_specs(shape).items():
        entry = report["drafters"][name] = {}
        eng = None
        try:
            start = time.perf_counter()
            eng = Engine(
                target, device=args.device, dtype="bfloat16", load_format="dummy",
                max_num_seqs=8, max_model_len=2048, max_num_batched_tokens=2048,
                piecewise_sizes=list(DRAFTER_SIZES), capture_sizes=[1],
                kv_cache_memory_fraction=0.5, **spec,
            )  # fmt: skip
            pw, dpw = eng.piecewise, eng.piecewise.drafter
            entry["startup"] = {
                "wall_s": round(time.perf_counter() - start, 2),
                "target_capture_s": round(pw.capture_seconds, 2),
                "drafter_capture_s": round(dpw.capture_seconds, 2),
                "drafter_capture_order": list(dpw.capture_order),
                "drafter_graph_gib": round(dpw.memory_bytes / 2**30, 3),
                "use_graphs": [pw.use_graphs, dpw.use_graphs],
                **(
                    {"per_sequence_capture_s": round(eng.piecewise.per_sequence.capture_seconds, 3),
                     "per_sequence_sizes": eng.piecewise.per_sequence.sizes}  # fmt: skip
                    if eng.piecewise.per_sequence is not None
                    else {}
                ),
            }
            print(name, "startup", entry["startup"], flush=True)
            row = eng.kv.allocate(max(DRAFTER_SIZES) + 16)
            for n in DRAFTER_SIZES:
                try:
                    entry[f"prefill_{n}"] = drafter_case(eng, n, row, vocab, args.iters)
                except Exception as exc:  # noqa: BLE001 - every case reports on its own
                    entry[f"prefill_{n}"] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    traceback.print_exc()
                print(name, f"prefill_{n}", entry[f"prefill_{n}"], flush=True)
            eng.kv.free(row)
        except Exception as exc:  # noqa: BLE001 - the next drafter still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"[:1000]
            traceback.print_exc()
        finally:
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--stage", choices=("target", "drafters"), default="target")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = run(args) if args.stage == "target" else run_drafters(args)
    except Exception as exc:  # noqa: BLE001 - the engine itself failed: still write the JSON
        traceback.print_exc()
        report = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    report = {**run_info(args.device, argv), **report}
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    raise SystemExit(main())
