"""Stage 1: the training corpus, Python source files of the running Python installation.

Files: every `*.py` under the standard library and site-packages (sysconfig paths), at most
`max_file_bytes` each, valid UTF-8. A file is named `stdlib/<path>` or `site-packages/<path>`,
so names do not depend on where Python is installed. The sorted name list is hashed (sha256)
into every model card. A file is held out, never trained on, when sha256(name) % 20 == 0; the
first lines of held-out files become the prompt sets (`{"prompt": ...}` per line, the format of
`speculant generate --prompts`). Token ids are made by worker processes (`tokenize_files`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HELDOUT_MODULUS = 20  # 1 in 20 files is held out
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}


@dataclass(frozen=True)
class SourceFile:
    name: str  # "stdlib/json/decoder.py" or "site-packages/torch/nn/init.py"
    path: str  # absolute path on this machine
    size: int


def name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def is_heldout(name: str) -> bool:
    """The held-out split: stable across machines with the same installation."""
    return name_hash(name) % HELDOUT_MODULUS == 0


def source_roots() -> list[tuple[str, Path]]:
    """(label, directory) of the standard library and site-packages of this interpreter."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and all(root.resolve() != r.resolve() for _, r in roots):
            roots.append(("site-packages", root))
    return roots


def list_files(max_file_bytes: int = 200_000) -> list[SourceFile]:
    """Every *.py of the installation up to `max_file_bytes`, sorted by name, without copies
    reached twice through links or nested roots."""
    found: dict[str, SourceFile] = {}
    seen_real: set[str] = set()
    for label, root in source_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            # the stdlib walk must not descend into site-packages (it is its own root)
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for filename in filenames:
                if not filename.endswith(".py"):
                    continue
                path = os.path.join(dirpath, filename)
                try:
                    real, size = os.path.realpath(path), os.path.getsize(path)
                except OSError:
                    continue
                if size == 0 or size > max_file_bytes or real in seen_real:
                    continue
                seen_real.add(real)
                name = f"{label}/{os.path.relpath(path, root)}"
                found.setdefault(name, SourceFile(name, path, size))
    return sorted(found.values(), key=lambda f: f.name)


def select_files(
    files: list[SourceFile], max_files: int = 0, max_mb: float = 0.0
) -> list[SourceFile]:
    """A deterministic subset: files in order of their name hash until `max_files` or `max_mb`
    is reached (0 = no limit); returned sorted by name. The held-out share is unchanged."""
    if not max_files and not max_mb:
        return files
    chosen, total = [], 0
    for f in sorted(files, key=lambda f: name_hash(f.name + "/select")):
        if (max_files and len(chosen) >= max_files) or (max_mb and total >= max_mb * 1e6):
            break
        chosen.append(f)
        total += f.size
    return sorted(chosen, key=lambda f: f.name)


def read_text(path: str) -> str | None:
    """A file's text, or None when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


# ---------------------------------------------------------------------------- tokenization

_WORKER_TOKENIZER = None


def _init_worker(tokenizer_file: str) -> None:
    global _WORKER_TOKENIZER  # one tokenizer per worker process
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_file(tokenizer_file)


def _tokenize_chunk(paths: list[str]) -> list[tuple[np.ndarray | None, str]]:
    texts = [read_text(p) for p in paths]
    ok = [t for t in texts if t is not None]
    encode = getattr(_WORKER_TOKENIZER, "encode_batch_fast", _WORKER_TOKENIZER.encode_batch)
    encoded = iter(encode(ok, add_special_tokens=False)) if ok else iter(())
    out = []
    for text in texts:
        if text is None:
            out.append((None, ""))
        else:
            ids = np.asarray(next(encoded).ids, dtype=np.uint16)
            out.append((ids, hashlib.sha256(text.encode()).hexdigest()))
    return out


def tokenize_files(
    files: list[SourceFile], tokenizer_file: str, workers: int, chunk: int = 64
) -> list[tuple[np.ndarray | None, str]]:
    """(token ids or None if unreadable, content sha256) per file, in order, computed by
    `workers` spawned processes (each with its own tokenizer, Rust threads off)."""
    paths = [f.path for f in files]
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by the workers
    if workers <= 1:
        _init_worker(tokenizer_file)
        parts = [_tokenize_chunk(c) for c in chunks]
    else:
        ctx = mp.get_context("spawn")  # the parent's tokenizer threads must not be forked
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_file,)) as pool:
            parts = pool.map(_tokenize_chunk, chunks, chunksize=1)
    return [item for part in parts for item in part]


# ---------------------------------------------------------------------------- the corpus


@dataclass
class Corpus:
    """Token streams (files joined by EOS) and what the model cards need."""

    train: np.ndarray  # uint16
    heldout: np.ndarray  # uint16
    train_files: list[str]
    heldout_files: list[str]
    heldout_texts: dict[str, str] = field(repr=False, default_factory=dict)
    file_list_sha256: str = ""
    content_sha256: str = ""
    unreadable: int = 0
    train_bytes: int = 0

    def card(self) -> dict:
        return {
            "file_list_sha256": self.file_list_sha256,
            "content_sha256": self.content_sha256,
            "files": len(self.train_files) + len(self.heldout_files),
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "train_tokens": int(self.train.size),
            "heldout_tokens": int(self.heldout.size),
            "train_mb": round(self.train_bytes / 1e6, 1),
            "heldout_rule": f"sha256(name) % {HELDOUT_MODULUS} == 0",
        }


def card_line(card: dict) -> str:
    """The corpus row of a model card, from `Corpus.card()`."""
    return (
        f"{card['files']} Python files ({card['train_files']} train, {card['heldout_files']} "
        f"held out by {card['heldout_rule']}), {card['train_tokens']:,} train tokens; "
        f"file list sha256 `{card['file_list_sha256']}`"
    )


def build_corpus(files: list[SourceFile], tokenizer_file: str, eos_id: int, workers: int) -> Corpus:
    """Tokenize every file, drop unreadable ones, hash the list, join the streams."""
    results = tokenize_files(files, tokenizer_file, workers)
    kept = [
        (f, ids, digest) for f, (ids, digest) in zip(files, results, strict=True) if ids is not None
    ]
    names = "\n".join(f.name for f, _, _ in kept)
    content = hashlib.sha256()
    for f, _, digest in kept:
        content.update(f"{f.name}\0{digest}\n".encode())
    eos = np.array([eos_id], dtype=np.uint16)
    train = [x for f, ids, _ in kept if not is_heldout(f.name) for x in (ids, eos)]
    heldout = [x for f, ids, _ in kept if is_heldout(f.name) for x in (ids, eos)]
    heldout_files = [f for f, _, _ in kept if is_heldout(f.name)]
    return Corpus(
        train=np.concatenate(train) if train else np.zeros(0, np.uint16),
        heldout=np.concatenate(heldout) if heldout else np.zeros(0, np.uint16),
        train_files=[f.name for f, _, _ in kept if not is_heldout(f.name)],
        heldout_files=[f.name for f in heldout_files],
        heldout_texts={f.name: read_text(f.path) or "" for f in heldout_files},
        file_list_sha256=hashlib.sha256(names.encode()).hexdigest(),
        content_sha256=content.hexdigest(),
        unreadable=len(files) - len(kept),
        train_bytes=sum(f.size for f, _, _ in kept if not is_heldout(f.name)),
    )


# ---------------------------------------------------------------------------- prompt sets


def prompt_of(text: str, tokenizer, tokens: int) -> str | None:
    """The first whole lines of `text` holding at least `tokens` tokens, or None when the file
    is too short to leave a continuation of at least a quarter of that."""
    if len(tokenizer.encode(text).ids) < tokens * 5 // 4:
        return None
    prefix = ""
    for line in text.splitlines(keepends=True):
        prefix += line
        if len(prefix) >= 2 * tokens and len(tokenizer.encode(prefix).ids) >= tokens:
            break
    return prefix if prefix.strip() else None


def heldout_prompts(corpus: Corpus, tokenizer, count: int, tokens: int) -> list[dict]:
    """`count` prompts from held-out files, spread over packages: files are taken round-robin
    over their top-level package, each package in name-hash order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(corpus.heldout_files, key=name_hash):
        parts = name.split("/")
        package = "stdlib" if parts[0] == "stdlib" else parts[1].removesuffix(".py")
        groups.setdefault(package, []).append(name)
    prompts: list[dict] = []
    queues = [groups[k] for k in sorted(groups)]
    while len(prompts) < count and any(queues):
        for queue in queues:
            if queue and len(prompts) < count:
                text = prompt_of(corpus.heldout_texts[queue.pop(0)], tokenizer, tokens)
                if text is not None:
                    prompts.append({"prompt": text})
    return prompts


def write_prompt_sets(
    corpus: Corpus, tokenizer, data_out: Path, count: int, small: int, tokens: int
) -> dict[str, int]:
    """heldout_prompts.jsonl (`count` prompts) and heldout_prompts_small.jsonl (its first
    `small`), one `{"prompt": ...}` per line; returns the number of lines of each file."""
    data_out.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(corpus, tokenizer, count, tokens)
    sizes = {}
    for filename, rows in (
        ("heldout_prompts.jsonl", prompts),
        ("heldout_prompts_small.jsonl", prompts[:small]),
    ):
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (data_out / filename).write_text(lines)
        sizes[filename] = len(rows)
    return sizes
