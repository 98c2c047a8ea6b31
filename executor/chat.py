"""Chat prompts: a conversation rendered with the target checkpoint's own chat template.

A `Chat` (a list of {"role", "content"} messages, OpenAI's form) is a prompt like a text or token
ids; the engine renders it with the template the checkpoint ships (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`, the default of a list of named ones: where and in
which order transformers' tokenizers read them), ending with the assistant's turn
(`add_generation_prompt`), and tokenizes the result without adding special tokens (the template
writes BOS itself), as transformers' `apply_chat_template(..., tokenize=True)` does. The
template runs in jinja2's sandbox with what Hugging Face templates use: `bos_token`, `eos_token`
and the other named special tokens (tokenizer_config.json's, and a model's own `*_token` keys;
special_tokens_map.json's where the config lists no `added_tokens_decoder`, as transformers
reads them), `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, loop
controls, and the `{% generation %}` block (rendered as its content). Messages reach it as
transformers 5 passes them: keys whose value is null dropped (OpenAI's `"tool_calls": null`,
an assistant's `"content": null` beside its tool calls), and `reasoning` / `thinking` copied to
`reasoning_content` (and the reverse for `thinking`).

A message's content may also be a list of text parts (OpenAI's form: {"type": "text", "text":
...}, or plain strings), read as vLLM reads them: a template that loops over a message's content
(`{% for part in message['content'] %}`, the multimodal templates' form) gets the parts as
{"type": "text", "text": ...} objects, as transformers would pass them; any other template gets
the parts' texts joined by newlines, where transformers would print the list itself. Parts of
other types (images, audio) are refused: the targets here read text only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from speculant.errors import SpeculantError, shown

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, in order


@dataclass(frozen=True)
class Chat:
    """A conversation to continue: messages in order, each a dict with a "role" and a
    "content", a text or a list of text parts (other keys, such as "name", reach the template
    as they are)."""

    messages: tuple[dict, ...]
    template_kwargs: dict

    def __init__(self, messages: Sequence[dict], template_kwargs: dict | None = None):
        """`template_kwargs`: more variables for the chat template (vLLM's
        `chat_template_kwargs`, e.g. {"enable_thinking": False} for Qwen3's), passed as
        transformers' `apply_chat_template(..., **kwargs)` passes them."""
        if (problem := template_kwargs_problem(template_kwargs)) is not None:
            raise SpeculantError(f"Chat template_kwargs {problem}")
        object.__setattr__(self, "template_kwargs", dict(template_kwargs or {}))
        if isinstance(messages, dict):
            raise SpeculantError(
                "Chat takes a list of messages, not one message; wrap it in a list: "
                'Chat([{"role": "user", "content": ...}])'
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise SpeculantError(
                f"Chat messages are of type {type(messages).__name__}; give a list of "
                '{"role": ..., "content": ...} messages (a text goes to generate as it is)'
            )
        object.__setattr__(self, "messages", tuple(messages))


def template_kwargs_problem(kwargs: Any) -> str | None:
    """What is wrong with chat template kwargs (None or an object of named values), or None."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k for k in kwargs):
        return (
            f"is {shown(kwargs)}; give an object of template variables, e.g. "
            '{"enable_thinking": false}'
        )
    if "messages" in kwargs:
        return "names 'messages', which is the conversation itself; leave it out"
    return None


def messages_problem(messages: Any) -> str | None:
    """What is wrong with `messages` as a conversation, or None."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return 'must be a non-empty list of {"role": ..., "content": ...} objects'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not an object"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f'message {i} has no "role" string (system, user, assistant, ...)'
        if content is None and (message.get("tool_calls") or role == "assistant"):
            continue  # an assistant's turn without text (OpenAI's null content; the key is
            # dropped as transformers 5 drops null keys, the template reads what it reads)
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                text = part_text(part)
                if text is None:
                    kind = part.get("type") if isinstance(part, dict) else None
                    return (
                        f'message {i}\'s content part {j} is of type "{kind}"; the targets here '
                        'read text only: give text parts, {"type": "text", "text": ...}'
                        if isinstance(kind, str) and kind != "text"
                        else f"message {i}'s content part {j} is not a text part; give "
                        '{"type": "text", "text": "..."} or a string'
                    )
                texts.append(text)
            content = "".join(texts)
        elif not isinstance(content, str):
            return (
                f'message {i} has a "content" of type {type(content).__name__}; give the '
                "text as a string or a list of text parts"
            )
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"message {i}'s content holds a lone surrogate at character {exc.start}, not "
                "valid Unicode text; fix the text (pair the \\u escapes)"
            )
    return None


def part_text(part: Any) -> str | None:
    """The text of one content part (a string, or {"type": "text", "text": str}), else None."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return None


@lru_cache(maxsize=8)
def loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's content (vLLM's "openai" content format):
    a for loop over `X['content']` or `X.content` (through filters such as selectattr), or over
    a name set from one."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _environment().parse(template)
    except jinja2.exceptions.TemplateError:
        return False  # rendering reports it

    def is_content(node) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return isinstance(node, nodes.Getattr) and node.attr == "content"

    aliases = {
        a.target.name
        for a in tree.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and is_content(a.node)
    }
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, (nodes.Filter, nodes.Test)) and it.node is not None:
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return True
    return False


def _template_messages(template: str, chat: Chat) -> list[dict]:
    """The messages as the template gets them: null keys dropped, reasoning aliased, list
    contents as text-part objects for a template that loops over content, else joined into one
    text (see the module doc)."""
    parts = loops_over_content(template)
    messages = []
    for message in chat.messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        content = message.get("content")
        if isinstance(content, list):
            texts = [part_text(p) for p in content]
            message["content"] = (
                [p if isinstance(p, dict) else {"type": "text", "text": p} for p in content]
                if parts
                else "\n".join(texts)
            )
        messages.append(message)
    return messages


def _text_of(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpeculantError(f"cannot read {str(file)!r} ({exc}); re-export it") from None
    if not isinstance(value, dict):
        raise SpeculantError(f"{str(file)!r} is not a JSON object; re-export the tokenizer")
    return value


def _template_in(value: Any, file: Path) -> str | None:
    """The default template of a `chat_template` value: a string, or a list of named ones."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise SpeculantError(
            f"{str(file)!r} names chat templates {sorted(map(str, named))} but none 'default'"
        )
    raise SpeculantError(
        f"{str(file)!r}: chat_template is a {type(value).__name__}, not text; write the template "
        'there as a string (or a list of {"name", "template"} objects with a \'default\')'
    )


def _special_tokens(config: dict, map_file: Path) -> dict[str, str]:
    """The named special tokens a template gets, as transformers 5 names them: the standard
    ones of tokenizer_config.json, and a model's own `*_token` keys there (a dict
    `extra_special_tokens` over them). Where the config lists no `added_tokens_decoder` (the
    legacy layout), special_tokens_map.json's standard ones replace the config's, its dict
    `extra_special_tokens` replaces model tokens, and its other `*_token` keys add those the
    config lacks."""

    def named(items) -> tuple[dict, dict]:
        standard = {k: v for k, v in items if k in SPECIAL_TOKEN_KEYS}
        own = {k: v for k, v in items if k not in SPECIAL_TOKEN_KEYS and k.endswith("_token")}
        return standard, own

    standard, own = named(config.items())
    if isinstance(extra := config.get("extra_special_tokens"), dict):
        own.update(extra)
    if "added_tokens_decoder" not in config and map_file.is_file():
        legacy = _read_json(map_file)
        map_standard, map_own = named(legacy.items())
        standard.update(map_standard)
        if isinstance(extra := legacy.get("extra_special_tokens"), dict):
            own.update(extra)
        own = {**map_own, **own}
    return {k: t for k, v in {**own, **standard}.items() if (t := _text_of(v)) is not None}


def named_special_tokens(path: str | Path) -> dict[str, str]:
    """The named special tokens of a checkpoint folder (`bos_token`, `eos_token`, ...; as
    `_special_tokens` reads them), {} without tokenizer files."""
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    return _special_tokens(config, folder / "special_tokens_map.json")


def load_chat_template(path: str | Path) -> tuple[str, dict[str, str]] | None:
    """(template, special tokens) of a checkpoint folder, or None when it has no template."""
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    specials = named_special_tokens(folder)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), specials
        except (OSError, UnicodeDecodeError) as exc:
            raise SpeculantError(f"cannot read {str(jinja_file)!r} ({exc})") from None
    template = _template_in(config.get("chat_template"), config_file)
    return (template, specials) if template else None


@lru_cache(maxsize=1)
def _environment():
    """jinja2's sandbox as Hugging Face templates expect it (see the module doc)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: its content
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        where = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
        raise SpeculantError(
            f"the chat template does not parse ({where}{exc.message}); fix the template "
            "(chat_template.jinja or tokenizer_config.json's chat_template)"
        ) from None


def render_chat(template: str, specials: dict[str, str], chat: Chat) -> str:
    """The text of `chat` with the assistant's turn opened, as the template writes it."""
    import jinja2

    compiled = _compiled(template)  # a template that does not parse says so, unwrapped
    try:
        return compiled.render(
            **{
                "tools": None,  # passed as transformers passes them: `tools is not none` false
                "documents": None,
                "add_generation_prompt": True,
                **specials,
                **chat.template_kwargs,
                "messages": _template_messages(template, chat),
            }
        )
    except jinja2.exceptions.TemplateError as exc:
        raise SpeculantError(f"the chat template refused the conversation: {exc}") from None
    except RecursionError:
        raise SpeculantError("the chat template recursed without end on the conversation") from None
    except Exception as exc:  # the template's own mistake at render time (1 // 0, "a" + 1)
        raise SpeculantError(
            f"the chat template failed on the conversation ({type(exc).__name__}: {exc}); fix "
            "the template (chat_template.jinja or tokenizer_config.json's chat_template)"
        ) from None
