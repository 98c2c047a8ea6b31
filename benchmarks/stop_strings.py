"""Time the stop-string watcher (executor/stop_strings.py `StopStrings`) over long outputs of a
SentencePiece tokenizer with byte fallback in Llama 2's layout (tokenizer.json: '▁' for spaces,
byte tokens <0x00>..<0xFF>, decoder Replace / ByteFallback / Fuse / Strip), CPU only, no model:
a run of `--tokens` byte tokens that form no character (<0xE2>, a character's first byte, and
<0x80>, a stray continuation byte; the decode shows one U+FFFD each), then words ending in the
stop string; and `--tokens` tokens of plain text. Each is timed replayed (the decoder's steps per
token, executor/detokenize.py) and on the window (`--window`: two decodes of recent tokens per
token, what every non-byte-level tokenizer took before), the text checked against the
tokenizer's own decode.

    python benchmarks/stop_strings.py [--tokens 8000] [--window] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

from _common import run_info
from tokenizers import Tokenizer

from speculant.executor.detokenize import INCOMPLETE
from speculant.executor.stop_strings import StopStrings

WORDS = ["▁the", "▁end", "▁of", "▁a", "▁line", "▁stop", "▁here", "ing", "s", "."]


def llama2_layout() -> Tokenizer:
    """Llama 2's tokenizer.json layout with a small vocabulary (no merges needed to decode)."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(pieces[:3])]  # fmt: skip
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}  # fmt: skip
    model = {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
             "vocab": {t: i for i, t in enumerate(pieces)}, "merges": []}  # fmt: skip
    spec = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": None,
            "post_processor": None, "decoder": decoder, "model": model}  # fmt: skip
    return Tokenizer.from_str(json.dumps(spec))


def timed(tokenizer: Tokenizer, ids: list[int], stops: list[str], window: bool) -> dict:
    watcher = StopStrings(tokenizer, stops)
    if window:
        watcher.stream = None
    started = time.perf_counter()
    taken = len(ids)
    for j, token in enumerate(ids, start=1):
        if watcher.add(token) is not None:
            taken = j
            break
    seconds = time.perf_counter() - started
    whole = tokenizer.decode(ids[:taken])
    same = (
        whole.rstrip(INCOMPLETE) == watcher.text
        if watcher.matched is None
        else (
            whole.startswith(watcher.text)
            and whole[len(watcher.text) :].startswith(watcher.matched)
        )
    )
    return {"seconds": round(seconds, 4), "tokens": taken, "stop": watcher.matched,
            "text_is_decode": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--window", action="store_true", help="the window path, as before")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    tokenizer = llama2_layout()
    word = [tokenizer.token_to_id(t) for t in WORDS]
    cases = {
        f"<0x{b:02X}> x {args.tokens}, then a stop": (
            [tokenizer.token_to_id(f"<0x{b:02X}>")] * args.tokens + word, ["stop"])
        for b in (0xE2, 0x80)
    }  # fmt: skip
    cases[f"{args.tokens} words"] = ([word[i % len(word)] for i in range(args.tokens)], ["§"])
    results = {}
    for name, (ids, stops) in cases.items():
        results[name] = timed(tokenizer, ids, stops, args.window)
        print(f"{'window' if args.window else 'replayed'}: {name}: {results[name]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info("cpu"), "window": args.window, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
