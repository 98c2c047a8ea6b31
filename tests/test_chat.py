"""Chat prompts (executor/chat.py): a conversation rendered with the target's own chat template
gives the token ids transformers' `apply_chat_template(..., add_generation_prompt=True,
tokenize=True)` gives, for templates in the published styles (Llama 3 headers, ChatML, one
using `raise_exception`, `tojson`, loop controls and a `{% generation %}` block), from each place
a checkpoint keeps its template; `Engine.chat`, `Engine.generate([Chat])` and a `--prompts`
line `{"messages": [...]}` (one process and `--dp 2`) generate what the same ids give; bad
conversations and a target without a template are one line naming the line and the fix."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculant import Chat, Engine, SamplingParams, SpeculantError
from speculant.executor import chat
from speculant.launch import cli

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if loop.index0 > 3 %}{% break %}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
    "{% endif %}{% endfor %}{% if tools is not none %}TOOLS{% endif %}"
    "{% if documents is not none %}DOCUMENTS{% endif %}"
    "{% if add_generation_prompt %}{{ eos_token }}assistant:{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "def f(x):"}],
    [
        {"role": "user", "content": '  héllo ✓ "quoted" <tag>  '},
        {"role": "assistant", "content": "import os"},
        {"role": "user", "content": "and then?"},
    ],
    [{"role": "user", "content": str(i)} for i in range(6)],  # past STRICT's break
]


# templates that loop over a message's content parts (multimodal templates' forms: plain, through
# selectattr, through a name set from the content)
PARTS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS_SELECTATTR = (
    "{{- bos_token }}{%- for message in messages %}{{- message.role + ': ' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for c in message.content | selectattr('type', 'equalto', 'text') %}{{- c.text + '|' }}"
    "{%- endfor %}{%- endif %}\n{%- endfor %}{%- if add_generation_prompt %}A:{%- endif %}"
)
PARTS_ALIAS = (
    "{% for m in messages %}{% set body = m['content'] %}{{ m['role'] }}="
    "{% if body is string %}{{ body }}{% else %}{% for p in body %}<{{ p.text }}>{% endfor %}"
    "{% endif %};{% endfor %}{% if add_generation_prompt %}assistant={% endif %}"
)
PARTED = [
    {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
    {"role": "user", "content": [{"type": "text", "text": "def f(x):"}, "return x",
                                 {"type": "text", "text": " ✓"}]},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": []},
]  # fmt: skip


def with_template(src: Path, dst: Path, where: str, template: str) -> Path:
    """A copy of checkpoint `src` whose chat template is `template`, kept `where`."""
    shutil.copytree(src, dst)
    eos = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}  # the old form
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": eos}  # fmt: skip
    if where == "tokenizer_config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                   {"name": "default", "template": template}]  # fmt: skip
    elif where == "jinja":
        config["chat_template"] = "not this one"  # the .jinja file comes first
        (dst / "chat_template.jinja").write_text(template)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def transformers_ids(folder: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize(
    "template, where",
    [(LLAMA3, "tokenizer_config"), (CHATML, "jinja"), (STRICT, "named")],
    ids=["llama3-config", "chatml-jinja", "strict-named"],
)
def test_chat_ids_equal_transformers(llama_dir, tmp_path, template, where):
    folder = with_template(llama_dir, tmp_path / "t", where, template)
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    for messages in CONVERSATIONS:
        ours = engine._chat_ids(0, Chat(messages))
        assert ours == transformers_ids(folder, messages), messages
    if template is STRICT:
        with pytest.raises(SpeculantError, match="System role not supported"):
            engine.generate([Chat([{"role": "system", "content": "x"}])])


def test_a_tokenizer_saved_truncating_or_padding_encodes_whole_prompts(llama_dir, tmp_path):
    """A tokenizer.json saved with truncation or padding on (as a fine-tune that tokenized its
    data with them saves it) still encodes a whole prompt, as transformers does (it turns both
    off for a call that asks for neither): a chat and a text prompt were cut to the saved
    length, or padded with pad ids, silently."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    long = [{"role": "user", "content": "a message long enough to pass eight tokens " * 3}]
    for name, setting in (("truncation", {"max_length": 8}), ("padding", {"length": 96})):
        folder = with_template(llama_dir, tmp_path / name, "jinja", CHATML)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        if name == "truncation":
            tokenizer.enable_truncation(**setting)
        else:
            tokenizer.enable_padding(**setting)
        tokenizer.save(str(folder / "tokenizer.json"))
        engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
        assert engine._chat_ids(0, Chat(long)) == transformers_ids(folder, long), name
        text = long[0]["content"]
        expected = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
        assert engine._make_request(0, text, SamplingParams()).prompt_ids == expected, name


@pytest.mark.parametrize("split", [True, False])
def test_split_special_tokens_as_transformers_reads_it(llama_dir, tmp_path, split):
    """tokenizer_config.json's `split_special_tokens: true`: a text prompt that spells a
    special token encodes it as text, as transformers (and vLLM through it) does; it was read as
    the special token. A chat's ids equal transformers' either way."""
    from transformers import AutoTokenizer

    folder = with_template(llama_dir, tmp_path / "t", "jinja", CHATML)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "split_special_tokens": split})
    )
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    text = "a<|endoftext|>b"
    ours = engine._make_request(0, text, SamplingParams()).prompt_ids
    assert ours == AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    eos = engine.tokenizer.token_to_id("<|endoftext|>")
    assert (eos in ours) is not split
    messages = [{"role": "user", "content": text}]
    assert engine._chat_ids(0, Chat(messages)) == transformers_ids(folder, messages)


THINKING = CHATML.replace(
    "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}{{ greeting | default('') }}",
)


def test_chat_template_kwargs_as_transformers_passes_them(llama_dir, tmp_path, capsys):
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking`): the template gets them as
    transformers' apply_chat_template(..., **kwargs) gives them (ids equal), from
    `Engine.chat(..., chat_template_kwargs=...)`, `Chat(messages, kwargs)` and a --prompts
    line's "chat_template_kwargs"; a bad value is one line naming it."""
    from transformers import AutoTokenizer

    folder = with_template(llama_dir, tmp_path / "t", "jinja", THINKING)
    assert THINKING != CHATML
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    messages = [{"role": "user", "content": "hi"}]
    reference = AutoTokenizer.from_pretrained(str(folder))
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True, "greeting": "Hm"}):
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert engine._chat_ids(0, Chat(messages, kwargs)) == expected, kwargs
    params = SamplingParams(max_new_tokens=4)
    off = {"enable_thinking": False}
    via_chat = engine.chat(messages, params, chat_template_kwargs=off)[0]
    assert via_chat.prompt_token_ids == engine._chat_ids(0, Chat(messages, off))
    assert via_chat.prompt_token_ids != engine.chat(messages, params)[0].prompt_token_ids
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text(json.dumps({"messages": messages, "chat_template_kwargs": off}) + "\n")
    argv = ["generate", "--device", "cpu", "--target", str(folder), "--prompts", str(prompts),
            "--output", str(out), "--max-new-tokens", "4"]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["token_ids"] == via_chat.token_ids  # greedy
    with pytest.raises(SpeculantError, match="chat_template_kwargs is 'x'; give an object"):
        engine.chat(messages, params, chat_template_kwargs="x")
    prompts.write_text(json.dumps({"prompt": "hi", "chat_template_kwargs": off}) + "\n")
    assert cli.main(argv) == 2
    assert "'chat_template_kwargs' applies to a 'messages' conversation only" in (
        capsys.readouterr().err
    )


# what OpenAI-style clients send and transformers 5 passes on: null keys dropped (a literal
# "None", a `len(None)`, a refused null assistant content otherwise), reasoning under its other
# names
FIELDS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m['name'] is defined %} name={{ m['name'] }}{% endif %}\n"
    "{% if 'tool_calls' in m %}{{ m.tool_calls | length }} call(s):"
    "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% endif %}"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.content is defined %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ mask_token }}{{ image_token }}<|im_start|>assistant\n"
    "{% endif %}"
)
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
FIELD_CONVERSATIONS = [
    [{"role": "user", "content": "hi", "name": None}],
    [{"role": "user", "content": "hi", "tool_calls": None, "name": "ann"}],
    [{"role": "user", "content": "add"}, {"role": "assistant", "content": None,
                                          "tool_calls": [CALL]}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                        "reasoning": "because"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                        "thinking": "hm", "reasoning_content": None}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
     {"role": "user", "content": "again"}],
]  # fmt: skip


@pytest.mark.parametrize("legacy", [False, True], ids=["config", "special_tokens_map"])
def test_chat_fields_and_special_tokens_as_transformers_passes_them(llama_dir, tmp_path, legacy):
    """Null message keys dropped, reasoning aliased, every named special token (mask_token, a
    model's own `image_token`; special_tokens_map.json's in the legacy layout, with no
    added_tokens_decoder) given to the template: ids equal transformers'."""
    from tokenizers import Tokenizer

    folder = with_template(llama_dir, tmp_path / "t", "tokenizer_config", FIELDS)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|mask|>", "<|image|>"])  # as published tokenizers hold them
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    named = {"bos_token": "<|endoftext|>", "mask_token": "<|mask|>", "image_token": "<|image|>"}
    if legacy:  # the config names none of them; the map does
        for key in named:
            config.pop(key, None)
        (folder / "special_tokens_map.json").write_text(json.dumps(named))
    else:
        config.update(named)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    for messages in FIELD_CONVERSATIONS:
        ours = engine._chat_ids(0, Chat(messages))
        assert ours == transformers_ids(folder, messages), messages
    ids = engine._chat_ids(0, Chat(FIELD_CONVERSATIONS[3]))
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<think>because</think>" in text and "<|mask|><|image|>" in text, text
    assert "None" not in text


NAMED = (
    "{% for m in messages %}{{ m.content }}{% endfor %}|img={{ image_token }}|aud={{ "
    "audio_token }}|bos={{ bos_token }}|mask={{ mask_token }}"
)


@pytest.mark.parametrize(
    "config, special_map",
    [
        ({"image_token": "<A>"}, {"image_token": "<B>"}),  # the config's own token stays
        ({}, {"extra_special_tokens": {"image_token": "<X>"}}),
        ({"image_token": "<A>"}, {"extra_special_tokens": {"image_token": "<X>"}}),
        ({"extra_special_tokens": {"image_token": "<E>"}, "image_token": "<A>"}, {}),
        ({"bos_token": "<s1>"}, {"bos_token": "<s2>", "audio_token": "<au>", "mask_token": "<m>"}),
        ({"added_tokens_decoder": {}, "bos_token": "<s1>"}, {"bos_token": "<s2>"}),  # not legacy
    ],
)
def test_named_special_tokens_take_transformers_precedence(tmp_path, config, special_map):
    """Which file's value a template's named token takes (tokenizer_config.json's standard and
    own `*_token` keys, its and special_tokens_map.json's `extra_special_tokens`, the map in the
    legacy layout only): the text transformers renders."""
    from transformers import AutoTokenizer

    import speculant

    shutil.copy(speculant.bundled("target") / "tokenizer.json", tmp_path / "tokenizer.json")
    written = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": NAMED, **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(written))
    if special_map:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
    messages = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert chat.render_chat(*chat.load_chat_template(tmp_path), Chat(messages)) == theirs


def test_engine_chat_generates_what_the_rendered_ids_give(llama_dir, tmp_path):
    folder = with_template(llama_dir, tmp_path / "t", "tokenizer_config", LLAMA3)
    engine = Engine(str(folder), device="cpu", max_num_seqs=4, max_model_len=512)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = [engine.generate([transformers_ids(folder, c)], params)[0] for c in CONVERSATIONS]
    for outs in (engine.chat(CONVERSATIONS, params), engine.generate(map_chat(), params)):
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in expected]
    assert engine.chat(CONVERSATIONS[0], params)[0].token_ids == expected[0].token_ids  # one
    assert pickle.loads(pickle.dumps(Chat(CONVERSATIONS[1]))) == Chat(CONVERSATIONS[1])


@pytest.mark.parametrize("template", [PARTS, PARTS_SELECTATTR, PARTS_ALIAS, CHATML, LLAMA3])
def test_content_parts_as_vllm_reads_them(llama_dir, tmp_path, template):
    """A template that loops over content gets the parts (ids equal transformers' with the same
    list); any other gets the parts' texts joined by newlines (ids equal transformers' with
    that text, where transformers itself would print the list)."""
    folder = with_template(llama_dir, tmp_path / "t", "jinja", template)
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    loops = template in (PARTS, PARTS_SELECTATTR, PARTS_ALIAS)
    assert chat.loops_over_content(template) is loops
    as_transformers_gets_it = [
        {**m, "content": [p if isinstance(p, dict) else {"type": "text", "text": p}
                          for p in m["content"]] if loops
         else "\n".join(p if isinstance(p, str) else p["text"] for p in m["content"])}
        if isinstance(m["content"], list) else m
        for m in PARTED
    ]  # fmt: skip
    assert engine._chat_ids(0, Chat(PARTED)) == transformers_ids(folder, as_transformers_gets_it)
    assert PARTED[1]["content"][1] == "return x"  # the caller's messages are not changed


def map_chat() -> list[Chat]:
    return [Chat(c) for c in CONVERSATIONS]


def test_chat_refusals(llama_dir, tmp_path):
    engine = Engine(str(llama_dir), device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(SpeculantError, match="prompt 0 is a chat but .* has no chat template"):
        engine.chat(CONVERSATIONS[0])
    with pytest.raises(SpeculantError, match='message 0 has no "role" string'):
        engine.chat([{"content": "x"}])
    with pytest.raises(SpeculantError, match="message 1's content part 0 is not a text part"):
        engine.chat([{"role": "user", "content": "x"}, {"role": "user", "content": [{}]}])
    with pytest.raises(SpeculantError, match='message 0 has a "content" of type int'):
        engine.chat([{"role": "user", "content": 3}])
    with pytest.raises(SpeculantError, match='message 0 has a "content" of type NoneType'):
        engine.chat([{"role": "user", "content": None}])  # null text only for an assistant
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(SpeculantError, match='content part 1 is of type "image_url"; the targets'):
        engine.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, image]}])
    with pytest.raises(SpeculantError, match="message 0's content holds a lone surrogate"):
        engine.chat([{"role": "user", "content": "a\ud800b"}])  # was the tokenizer's exception


def test_chat_takes_only_conversations(llama_dir, tmp_path):
    """A `Chat` is one conversation; a text (or a list of texts) is refused, not generated
    untemplated character by character."""
    folder = with_template(llama_dir, tmp_path / "t", "jinja", CHATML)
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=512)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    expected = engine.chat(CONVERSATIONS[0], params)
    assert [o.token_ids for o in engine.chat(Chat(CONVERSATIONS[0]), params)] == [
        o.token_ids for o in expected
    ]
    with pytest.raises(SpeculantError, match="conversations is of type str"):
        engine.chat("hello", params)
    with pytest.raises(SpeculantError, match="conversations is of type dict"):
        engine.chat(CONVERSATIONS[0][0], params)
    with pytest.raises(SpeculantError, match="prompt 1 is of type str, not a conversation"):
        engine.chat([CONVERSATIONS[0], "hello"], params)
    # generate takes one Chat as it takes one text
    assert [o.token_ids for o in engine.generate(Chat(CONVERSATIONS[0]), params)] == [
        o.token_ids for o in expected
    ]
    # a Chat of something other than a list of messages: one line naming it
    with pytest.raises(SpeculantError, match="not one message; wrap it in a list"):
        Chat(CONVERSATIONS[0][0])
    for bad in (None, 5, "hello"):
        with pytest.raises(SpeculantError, match=f"Chat messages are of type {type(bad).__name__}"):
            Chat(bad)


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "failed on the conversation "
         "(TypeError: "),
        ("{{ 1 // 0 }}", "failed on the conversation (ZeroDivisionError: "),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed without end"),
        ("{% for m in messages %}\n{{ m.content }", "does not parse (line 2: unexpected '}'); "
         "fix the template (chat_template.jinja"),  # was wrapped in "failed on ... (SpeculantError"
    ],
)  # fmt: skip
def test_a_template_that_fails_while_rendering_is_a_prompt_error(
    llama_dir, tmp_path, capsys, template, needle
):
    """A template whose own code raises at render time (not jinja's TemplateError): one error
    naming the prompt, as a refusal by raise_exception is (was: a traceback, exit 1)."""
    folder = with_template(llama_dir, tmp_path / "t", "jinja", template)
    engine = Engine(str(folder), device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(
        SpeculantError,
        match=re.escape(
            f"prompt 0 is a chat that could not be rendered: the chat template {needle}"
        ),
    ):
        engine.chat(CONVERSATIONS[0])  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    capsys.readouterr()
    assert cli.main(["generate", "--device", "cpu", "--target", str(folder), "--prompts",
                     str(prompts), "--max-model-len", "64"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"speculant: error: {prompts}:1: the prompt is a "
                                               "chat that could not be rendered"), err  # fmt: skip


def test_cli_messages_lines(llama_dir, tmp_path, capsys):
    folder = with_template(llama_dir, tmp_path / "t", "jinja", CHATML)
    prompts, ids_prompts = tmp_path / "p.jsonl", tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    ids_prompts.write_text("".join(
        json.dumps({"prompt_token_ids": transformers_ids(folder, c)}) + "\n"
        for c in CONVERSATIONS))  # fmt: skip
    base = ["generate", "--device", "cpu", "--target", str(folder), "--max-new-tokens", "5",
            "--ignore-eos", "--max-model-len", "512"]  # fmt: skip
    outs = {}
    for name, file in (("chat", prompts), ("ids", ids_prompts)):
        assert cli.main([*base, "--prompts", str(file), "--output", str(tmp_path / name)]) == 0
        outs[name] = [json.loads(line)["token_ids"] for line in (tmp_path / name).open()]
    assert outs["chat"] == outs["ids"]
    two = subprocess.run(
        [sys.executable, "-m", "speculant", *base, "--dp", "2", "--prompts", str(prompts),
         "--output", str(tmp_path / "dp"), "--dist-timeout", "60"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    dp = {
        json.loads(line)["index"]: json.loads(line)["token_ids"] for line in open(tmp_path / "dp")
    }
    assert [dp[i] for i in range(len(CONVERSATIONS))] == outs["ids"]

    bad = tmp_path / "bad.jsonl"
    for line, expected in [
        ({"messages": [], "prompt": "x"}, "give exactly one of 'prompt', 'prompt_token_ids' or"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": 3}]}, 'message 0 has a "content" of type int'),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "content holds a lone surrogate"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "content holds a lone surrogate",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            'message 0\'s content part 0 is of type "input_audio"; the targets here read text only',
        ),
    ]:
        bad.write_text(json.dumps(line) + "\n")
        assert cli.main([*base, "--prompts", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"speculant: error: {bad}:1: ") and expected in err, err
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    assert cli.main([*base[:4], str(llama_dir), *base[5:], "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{bad}:1: the prompt is a chat but" in err and "has no chat template" in err, err
