"""Whether a draft LM of another vocabulary size shares the target's tokenizer (--algo
draft-model). One tokenizer family often ships checkpoints whose embedding tables are padded to
different sizes (Qwen2.5-0.5B/1.5B/3B-Instruct: vocab_size 151936; -7B and up: 152064; both
151,665 real tokens): the draft model then drafts losslessly in the target's vocabulary
(drafter/draft_model.py). A different tokenizer must not slip through on that allowance, so when
the sizes differ `check_draft_tokenizer` asks for evidence from the checkpoints' tokenizer files.

The token -> id map of a folder is read without the `tokenizers` package, from the first of
tokenizer.json (its model's vocab and added_tokens), vocab.json, vocab.txt, tokenizer.model
(SentencePiece protobuf, or tiktoken's `base64 rank` lines), plus added_tokens.json and
tokenizer_config.json's added_tokens_decoder. tokenizer_config.json alone carries no vocabulary
and counts as no tokenizer files.

- both folders have one: the maps must agree on every id below the smaller vocab_size;
- only one has one (typically the draft folder holds just config.json and weights): the
  difference must look like padding, both vocab_size values at least that tokenizer's length
  (its largest id + 1);
- neither has one: refused, nothing shows the two share a tokenizer."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

from speculant.errors import SpeculantError

_SPM_PIECES = 1  # ModelProto.pieces
_SPM_PIECE = 1  # SentencePiece.piece


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message: bytes for length-delimited
    fields, ints for the rest."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<q", data, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
            if pos > len(data):
                raise ValueError("truncated field")
        elif wire == 5:
            value, pos = struct.unpack_from("<i", data, pos)[0], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _sentencepiece(data: bytes) -> dict[int, str]:
    pieces = []
    for number, wire, value in _fields(data):
        if number == _SPM_PIECES and wire == 2:
            piece = next((v for n, w, v in _fields(value) if n == _SPM_PIECE and w == 2), b"")
            pieces.append(piece.decode("utf-8"))
    if not pieces:
        raise ValueError("no pieces")
    return dict(enumerate(pieces))


def _tiktoken(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        if line.strip():
            token, rank = line.split()
            out[int(rank)] = base64.b64decode(token).decode("latin-1")
    return out


def _model_file(path: Path) -> dict[int, str]:
    data = path.read_bytes()
    try:
        return _sentencepiece(data)
    except (ValueError, UnicodeDecodeError, struct.error):
        return _tiktoken(data.decode("utf-8"))


def _read_json(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tokenizer_json(path: Path) -> dict[int, str]:
    data = _read_json(path)
    vocab = (data.get("model") or {}).get("vocab")
    out: dict[int, str] = {}
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        out = {int(i): t for t, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [piece, score] by id
        out = {i: entry[0] for i, entry in enumerate(vocab)}
    for added in data.get("added_tokens") or []:
        out[int(added["id"])] = added["content"]
    return out


def token_map(folder: str | Path) -> dict[int, str] | None:
    """id -> token of the tokenizer files in `folder` (None: no vocabulary there). A file that
    cannot be read is refused naming it."""
    folder = Path(folder)
    readers = (
        ("tokenizer.json", _tokenizer_json),
        ("vocab.json", lambda p: {int(i): t for t, i in _read_json(p).items()}),
        ("vocab.txt", lambda p: dict(enumerate(p.read_text("utf-8").splitlines()))),
        ("tokenizer.model", _model_file),
    )
    out = None
    for name, read in readers:
        path = folder / name
        if not path.is_file():
            continue
        try:
            out = read(path)
            extra = folder / "added_tokens.json"
            if extra.is_file():
                out.update({int(i): t for t, i in _read_json(extra).items()})
            config = folder / "tokenizer_config.json"
            if config.is_file():
                decoder = _read_json(config).get("added_tokens_decoder") or {}
                out.update({int(i): entry["content"] for i, entry in decoder.items()})
        except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            raise SpeculantError(
                f"cannot read the tokenizer in {str(folder)!r} ({name}: {exc}); re-export it"
            ) from exc
        break
    return out


def _short(token: str | None) -> str:
    text = repr(token) if token is not None else "no token"
    return text if len(text) <= 40 else text[:37] + "..."


def check_draft_tokenizer(target: str, draft: str, target_vocab: int, draft_vocab: int) -> None:
    """Refuse (one line) a draft LM whose vocab_size differs from the target's unless their
    tokenizer files show one tokenizer (module docstring); the same size is not checked."""
    if draft_vocab == target_vocab:
        return
    sizes = (
        f"draft LM {draft!r} (config.json vocab_size {draft_vocab}) and target {target!r} "
        f"(vocab_size {target_vocab})"
    )
    fix = (
        "a draft model of another vocabulary size must share the target's tokenizer (one "
        "family's checkpoints padded to different sizes, e.g. Qwen2.5-0.5B-Instruct for "
        "Qwen2.5-7B-Instruct)"
    )
    target_map, draft_map = token_map(target), token_map(draft)
    if target_map is None and draft_map is None:
        raise SpeculantError(
            f"{sizes} have no tokenizer files to show they share one tokenizer; {fix}: add "
            "the checkpoints' tokenizer.json to the folders, or pick a draft model of the "
            "same vocab_size"
        )
    common = min(target_vocab, draft_vocab)
    if target_map is not None and draft_map is not None:
        ids = sorted(i for i in set(target_map) | set(draft_map) if 0 <= i < common)
        for i in ids:
            if target_map.get(i) != draft_map.get(i):
                raise SpeculantError(
                    f"{sizes} have different tokenizers (token id {i}: "
                    f"{_short(draft_map.get(i))} vs {_short(target_map.get(i))}); {fix}: pick "
                    "a draft model of the target's family"
                )
        return
    known = target_map if target_map is not None else draft_map
    owner = target if target_map is not None else draft
    length = max(known, default=-1) + 1
    if common < length:
        raise SpeculantError(
            f"{sizes}: only {owner!r} has tokenizer files, and its {length} tokens do not fit "
            f"vocab_size {common}, so the difference is not padding of one tokenizer; {fix}: "
            "add the draft's tokenizer.json to its folder, or pick a draft model of the "
            "target's family"
        )
