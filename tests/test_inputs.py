"""Inputs that cannot be right are refused with one line naming the value (issue 18, items 2,
3, 4, 5 and 8): sampling values that round to nothing in float32, `--num-draft-tokens 0`,
checkpoints with integer weights, wrong vocabulary maps or extra tensors, config.json values
that are not sizes, prompts that are not Unicode, KV pools that do not fit in memory, and paths
that cannot be read or written. Most run the CLI in-process and fail before any model loads."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_eagle import write_random_eagle3
from safetensors.torch import load_file, save_file

import speculant
from speculant import Engine, ModelConfig, SamplingParams, SpeculantError
from speculant.comm.groups import ParallelContext
from speculant.config import SpecConfig
from speculant.drafter.dflash import DFlashConfig, block_size_of
from speculant.drafter.eagle import Eagle3Config, load_eagle3
from speculant.executor import kv_cache
from speculant.executor.build import DEFAULT_DRAFT_TOKENS, check_spec
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import GREEDY, argmax, batch_variant, filtered_probs, sample

ASSETS = Path(__file__).resolve().parent.parent / "assets"
INT64_MAX = 2**63 - 1


def run_main(capsys: pytest.CaptureFixture, *args: object, command: str = "generate"):
    """`speculant COMMAND --device cpu ARGS` in this process: (exit status, stderr)."""
    from speculant.launch.cli import main

    try:
        status = main([command, "--device", "cpu", *map(str, args)])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    return status, capsys.readouterr().err


def error_line(status: int, err: str) -> str:
    """The one `speculant: error:` line of a run that must have failed with status 2."""
    # from the marker on: a progress bar may share the line (item 7 is another test's)
    lines = [
        line[line.index("speculant: error:") :]
        for line in err.splitlines()
        if "speculant: error:" in line
    ]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def write_jsonl(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------- item 2: float32 sampling values


def sampling_info(bs: int, temperature: float, top_p: float = 1.0, top_k: int = 0):
    return SamplingInfo(
        torch.full((bs,), temperature, dtype=torch.float32),
        torch.full((bs,), top_k, dtype=torch.int64),
        torch.full((bs,), top_p, dtype=torch.float32),
        torch.arange(bs, dtype=torch.int64),
    )


@pytest.mark.parametrize("top_p", [1e-46, 1e-40, 1e-30, 1e-8])  # 0 in float32, subnormal, tiny
def test_top_token_always_survives_top_p(top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    info = sampling_info(6, 0.8, top_p=top_p)
    probs = filtered_probs(logits, info.temperature, info.top_k, info.top_p)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    positions = torch.arange(6)
    assert torch.equal(sample(logits, info, positions, "full"), argmax(logits))


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-7, 9.9e-6])
def test_temperatures_below_epsilon_are_greedy(temperature):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 30
    info = sampling_info(5, temperature, top_p=0.9, top_k=10)
    probs = filtered_probs(logits, info.temperature, info.top_k, info.top_p)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())
    assert torch.equal(sample(logits, info, torch.arange(5), "full"), logits.argmax(-1))
    assert batch_variant([SamplingParams(temperature=temperature, top_p=0.9)]) == GREEDY
    given = SamplingParams(temperature=temperature)
    assert given.validate().temperature == 0.0  # the engine then runs the greedy path
    assert given.temperature == temperature  # the caller's object as it was


def test_tiny_sampling_values_generate_the_greedy_tokens(llama_dir):
    engine = Engine(llama_dir, device="cpu", max_num_seqs=4, max_model_len=64)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for params in (
        SamplingParams(max_new_tokens=12, temperature=1e-40, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.9, top_p=1e-46, seed=3, ignore_eos=True),
    ):
        tiny = engine.generate(prompts, params)
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_top_k_minus_one_is_off_as_in_vllm(tmp_path):
    """vLLM's older default top_k=-1 ("all tokens") is taken as off (0), from SamplingParams,
    --top-k and a --prompts line alike: the same seeded samples as top_k=0; -2 is refused."""
    from speculant.launch import cli

    assert SamplingParams(top_k=-1).validate().top_k == 0
    engine = Engine(speculant.bundled("target"), device="cpu", num_draft_tokens=0)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.3, seed=s, top_k=k)
              for k in (0, -1) for s in (1, 2)]  # fmt: skip
    out = [o.token_ids for o in engine.generate(["def f(x):"] * 4, params)]
    assert out[:2] == out[2:] and out[0] != out[1]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):", "top_k": -1, "seed": 2}) + "\n")
    args = ["generate", "--device", "cpu", "--num-draft-tokens", "0", "--max-new-tokens", "12",
            "--ignore-eos", "--temperature", "1.3", "--top-k", "-1", "--seed", "1",
            "--prompts", str(prompts), "--output", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(args) == 0
    assert json.loads(open(tmp_path / "out").read())["token_ids"] == out[1]
    with pytest.raises(SpeculantError, match=re.escape("top_k=-2")):
        SamplingParams(top_k=-2).validate()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", math.nan),
        ("top_k", math.inf),
        ("top_k", 2**63),
        ("top_k", -2),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("max_new_tokens", math.inf),
        ("temperature", 1e300),  # beyond float32: inf on the device
        ("ignore_eos", "no"),  # a truthy string is no yes
        ("ignore_eos", 1),
    ],
)
def test_sampling_params_refuse_values_that_cannot_reach_the_device(field, value):
    with pytest.raises(SpeculantError, match=re.escape(f"{field}={value!r}")):
        SamplingParams(**{field: value}).validate()
    SamplingParams(seed=INT64_MAX, top_k=INT64_MAX).validate()  # the edges fit


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "inf"),
        ("--temperature", "nan"),
        ("--temperature", "1e+300"),  # finite, beyond float32: inf on the device
        ("--top-p", "nan"),
        ("--top-k", str(2**63)),
        ("--seed", str(2**64)),
        ("--seed", str(-(2**63) - 1)),
    ],
)
def test_cli_refuses_non_finite_and_out_of_int64_values_before_loading(
    capsys, tmp_path, flag, value
):
    # tmp_path holds no checkpoint: the error must come from the flag, at parse time
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x", flag, value))
    assert f"{flag} {value}" in line


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"prompt": "a", "temperature": Infinity}', "temperature=inf"),
        ('{"prompt": "a", "temperature": NaN}', "temperature=nan"),
        ('{"prompt": "a", "temperature": 3.5e38}', "temperature=3.5e+38"),
        ('{"prompt": "a", "top_p": NaN}', "top_p=nan"),
        ('{"prompt": "a", "top_k": 1e400}', "top_k=inf"),
        (f'{{"prompt": "a", "top_k": {2**63}}}', f"top_k={2**63}"),
        (f'{{"prompt": "a", "seed": {2**64}}}', f"seed={2**64}"),
        ("[" * 100_000, "nested too deeply"),
        ('{"prompt": "a", "prompt": "b"}', "the key 'prompt' is given twice"),
        ('{"prompt": "a", "temperature": 0, "temperature": 1}', "'temperature' is given twice"),
    ],
)
def test_prompts_lines_go_through_the_same_checks(capsys, tmp_path, text, needle):
    prompts = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "fine"}', text])
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompts", prompts))
    assert f"{prompts}:2:" in line and needle in line


# ------------------------------------------------------------- item 3: --num-draft-tokens 0


def test_num_draft_tokens_unset_is_the_default_and_zero_is_plain(tmp_path):
    head = ASSETS / "eagle3"
    unset = SpecConfig(algo="eagle3", draft=str(head))
    check_spec(unset)
    assert unset.num_draft_tokens == DEFAULT_DRAFT_TOKENS
    zero = SpecConfig(algo="eagle3", draft=str(head), num_draft_tokens=0)
    check_spec(zero)
    assert zero.num_draft_tokens == 0
    with pytest.raises(SpeculantError, match="num_draft_tokens=-1"):
        check_spec(SpecConfig(algo="eagle3", draft=str(head), num_draft_tokens=-1))


def test_engine_with_zero_draft_tokens_decodes_plainly():
    target, head = ASSETS / "target", ASSETS / "eagle3"
    options = dict(device="cpu", max_num_seqs=2, max_model_len=128)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    zero = Engine(target, algo="eagle3", draft=head, num_draft_tokens=0, **options)
    assert zero.drafter is None and zero.tokens_per_req == 1
    plain = Engine(target, **options)
    prompts = [[5, 6, 7, 8]]
    assert (
        zero.generate(prompts, params)[0].token_ids == plain.generate(prompts, params)[0].token_ids
    )


def test_cli_num_draft_tokens_zero_and_default(capsys):
    from speculant.launch.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate"]).num_draft_tokens is None
    assert parse(["generate", "--num-draft-tokens", "0"]).num_draft_tokens == 0
    status, err = run_main(capsys, "--num-draft-tokens", "-1")
    assert status == 2 and "--num-draft-tokens" in err and "'-1'" in err, err


def test_accept_rate_refuses_zero_draft_tokens(capsys):
    line = error_line(*run_main(capsys, "--num-draft-tokens", "0", command="accept-rate"))
    assert "--num-draft-tokens 0" in line


# ------------------------------------------------------------- item 4: checkpoints


def rewrite_tensors(folder: Path, change) -> None:
    """Apply `change(tensors)` to every safetensors file of `folder`."""
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        change(tensors)
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_weights_are_refused_naming_tensor_dtype_and_file(tmp_path, llama_dir, dtype):
    ckpt = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    name = "model.layers.1.mlp.down_proj.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].to(dtype)

    rewrite_tensors(ckpt, to_int)
    with pytest.raises(SpeculantError) as err:
        Engine(ckpt, device="cpu", max_num_seqs=2, max_model_len=64)
    message = str(err.value)
    assert name in message and str(dtype) in message and "model.safetensors" in message


def test_integer_weights_in_a_head_are_refused(tmp_path, llama_dir):
    tensors = write_random_eagle3(tmp_path, llama_dir)
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.int16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(SpeculantError, match="'fc.weight' in .*model.safetensors is torch.int16"):
        load_head(tmp_path, llama_dir)


def load_head(head: Path, target: Path):
    return load_eagle3(
        head, ModelConfig.from_dir(target), "cpu", torch.float32, ParallelContext.single(), 128
    )


@pytest.mark.parametrize(
    "change, needle",
    [
        (
            lambda t: t.update(t2d=t["t2d"][:-3]),
            "'t2d' .* has shape \\(509,\\), expected \\(512,\\)",  # llama_dir: vocab 512
        ),
        (lambda t: t.update(t2d=torch.ones_like(t["t2d"])), "'t2d' .* marks 512 .* not the 64"),
        (lambda t: t.update(t2d=t["t2d"].float()), "'t2d' .* is torch.float32"),
        (lambda t: t.update(d2t=t["d2t"].float()), "'d2t' .* is torch.float32"),
    ],
)
def test_vocabulary_maps_that_cannot_be_right_are_refused(tmp_path, llama_dir, change, needle):
    tensors = write_random_eagle3(tmp_path, llama_dir, draft_vocab=64)
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(SpeculantError, match=needle):
        load_head(tmp_path, llama_dir)


def test_unused_tensors_are_named_in_one_warning(tmp_path, llama_dir, caplog):
    ckpt = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    extra = [f"model.extra.{i:02d}.weight" for i in range(12)]  # read back in sorted order
    rewrite_tensors(ckpt, lambda t: t.update({name: torch.zeros(2) for name in extra}))
    with caplog.at_level(logging.WARNING, logger="speculant"):
        Engine(ckpt, device="cpu", max_num_seqs=2, max_model_len=64)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "12 tensor(s) not used" in warnings[0] and extra[0] in warnings[0]
    assert "and 4 more" in warnings[0] and extra[-1] not in warnings[0]


def test_checkpoints_that_use_every_tensor_do_not_warn(hf_model_dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="speculant"):
        for folder in hf_model_dirs.values():
            Engine(folder, device="cpu", max_num_seqs=2, max_model_len=64)
        # the bundled head stores embed_tokens.weight, which a head as wide as its target skips
        Engine(ASSETS / "target", device="cpu", max_num_seqs=2, max_model_len=64, algo="eagle3",
               draft=ASSETS / "eagle3")  # fmt: skip
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------- item 5: the one-line contract


@pytest.mark.parametrize("value", [[1, 2], "LlamaForCausalLM", 3, None])
def test_config_that_is_not_an_object_is_one_line(capsys, tmp_path, llama_dir, value):
    ckpt = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps(value))
    line = error_line(*run_main(capsys, "--target", ckpt, "--prompt", "x"))
    assert "config.json" in line and "not an object" in line


BAD_SIZES = [
    ({"hidden_size": -256}, "hidden_size=-256"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"intermediate_size": -1}, "intermediate_size=-1"),
    ({"head_dim": 0}, "head_dim=0"),
    ({"head_dim": 15}, "head_dim=15 .* odd"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
    ({"rope_theta": 0}, "rope_theta=0"),
    ({"rope_theta": -10000.0}, "rope_theta=-10000.0"),
    ({"rope_theta": math.inf}, "rope_theta=inf"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06"),
    ({"hidden_size": "64"}, "hidden_size='64'"),
    ({"hidden_size": True}, "hidden_size=True"),
    ({"hidden_size": [64]}, "hidden_size=\\[64\\]"),
    ({"hidden_size": 64.5}, "hidden_size=64.5"),
    ({"eos_token_id": "</s>"}, "eos_token_id='</s>'"),
    ({"rope_scaling": [1]}, "rope_scaling=\\[1\\]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0}}, "factor=0"),
]


@pytest.mark.parametrize("changes, needle", BAD_SIZES)
def test_config_values_that_are_not_sizes(tmp_path, llama_dir, changes, needle):
    ckpt = edit_config(copy_checkpoint(llama_dir, tmp_path / "ckpt"), **changes)
    with pytest.raises(SpeculantError, match=needle):
        ModelConfig.from_dir(ckpt)


def test_bad_config_value_is_one_line_from_the_cli(capsys, tmp_path, llama_dir):
    ckpt = edit_config(copy_checkpoint(llama_dir, tmp_path / "ckpt"), hidden_size=-256)
    line = error_line(*run_main(capsys, "--target", ckpt, "--prompt", "x"))
    assert "hidden_size=-256" in line and str(ckpt) in line


def test_moe_config_values_that_are_not_sizes():
    base = dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4,
        num_hidden_layers=2, intermediate_size=128, vocab_size=256, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    ModelConfig.from_hf(base)
    for changes, needle in (
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"num_experts_per_tok": 8}, "num_experts_per_tok=8 .* exceeds num_experts=4"),
        ({"num_experts": -1}, "num_experts=-1"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers='0'"),
    ):
        with pytest.raises(SpeculantError, match=needle):
            ModelConfig.from_hf({**base, **changes})


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"draft_vocab_size": -5}, "draft_vocab_size=-5"),
        ({"target_hidden_size": 0}, "target_hidden_size=0"),
        ({"hidden_size": -64}, "hidden_size=-64"),
        ({"eagle_config": [1, 2, 3]}, "eagle_config=\\[1, 2, 3\\]"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2"}}, "must be a list"),
    ],
)
def test_eagle3_config_values_that_are_not_sizes(tmp_path, llama_dir, changes, needle):
    write_random_eagle3(tmp_path, llama_dir, config_overrides=changes)
    with pytest.raises(SpeculantError, match=needle):
        Eagle3Config.from_dir(tmp_path, ModelConfig.from_dir(llama_dir))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"block_size": 1}, "block_size=1"),
        ({"block_size": "8"}, "block_size='8'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ({"dflash_config": [0]}, "dflash_config=\\[0\\]"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": "0"}}, "must be a list"),
        ({"dflash_config": {"mask_token_id": 1, "num_target_layers": 0}}, "num_target_layers=0"),
        ({"input_embedding_scale": math.nan}, "input_embedding_scale=nan"),
    ],
)
def test_dflash_config_values_that_are_not_sizes(tmp_path, llama_dir, changes, needle):
    target = ModelConfig.from_dir(llama_dir)
    config = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target.hidden_size,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": target.vocab_size,
        "block_size": 4, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1]},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(SpeculantError, match=needle):
        DFlashConfig.from_dir(tmp_path, target)
        block_size_of(tmp_path)


def test_lone_surrogate_in_a_prompts_line(capsys, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "ok"}', r'{"prompt": "ab\ud800c"}'])
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompts", prompts))
    assert f"{prompts}:2:" in line and "\\ud800" in line and "surrogate" in line


def test_lone_surrogate_in_prompt_flag(capsys, tmp_path):
    # what Python makes of a byte that is not UTF-8 in argv (surrogateescape)
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "ab\udcffc"))
    assert "--prompt" in line and "\\udcff" in line


@pytest.mark.timeout(120)
def test_invalid_utf8_prompt_under_tp2_is_one_line(tmp_path):
    """Real argv bytes, and --tp 2: refused by the launcher before any rank starts."""
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--tp", "2",
           "--target", str(tmp_path), "--prompt", os.fsdecode(b"ab\xffc")]  # fmt: skip
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prompt" in lines[0] and "\\udcff" in lines[0], proc.stderr


@pytest.fixture
def little_memory(monkeypatch):
    """The CPU KV cache budget as if 64 MiB were available."""
    monkeypatch.setattr(kv_cache, "_available_host_memory", lambda: 64 * 2**20)


def test_cpu_kv_cache_is_capped_by_available_memory(little_memory):
    per_token = 1024
    # 100000 full-length requests would need 25.6 M pages; 85% of 64 MiB holds 3481 of 16 tokens
    num = kv_cache.choose_num_pages(16, 100000, 4096, per_token, "cpu", 0.85, None)
    assert num == int(64 * 2**20 * 0.85) // (per_token * 16)
    assert kv_cache.choose_num_pages(16, 2, 64, per_token, "cpu", 0.85, None) == 2 * 4 + 1
    with pytest.raises(SpeculantError, match="--num-pages 10000000 .*--kv-cache-memory-fraction"):
        kv_cache.choose_num_pages(16, 2, 64, per_token, "cpu", 0.85, 10_000_000)
    # two CPU ranks on one host (--tp/--dp 2) take half of the fraction each, not all of it
    shared = kv_cache.choose_num_pages(16, 100000, 4096, per_token, "cpu", 0.85, None, 0, 2)
    assert shared == int(64 * 2**20 // 2 * 0.85) // (per_token * 16)


def test_huge_num_pages_is_one_line(capsys, llama_dir):
    line = error_line(*run_main(capsys, "--target", llama_dir, "--prompt", "x",
                                "--num-pages", 10**12))  # fmt: skip
    assert "--num-pages 1000000000000" in line and "GiB" in line


@pytest.mark.parametrize("rows", [100000, 10**8])
def test_huge_max_num_seqs_runs_in_a_capped_pool(capsys, caplog, llama_dir, little_memory, rows):
    # rows past the pages memory could hold are lowered (they never run, and their buffers,
    # sized before the pool, would exhaust memory: 10**8 was a 26 GB allocation's traceback)
    status, err = run_main(capsys, "--target", llama_dir, "--prompt", "x", "--max-num-seqs",
                           rows, "--max-new-tokens", 3)  # fmt: skip
    assert status == 0 and "Traceback" not in err, err
    assert "max_num_seqs lowered to" in caplog.text and f"(asked {rows})" in caplog.text


# ------------------------------------------------------------- item 8: messages name the value


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_dev_full_names_the_path(capsys, llama_dir):
    line = error_line(*run_main(capsys, "--target", llama_dir, "--prompt", "x",
                                "--max-new-tokens", 2, "--output", "/dev/full"))  # fmt: skip
    assert "--output '/dev/full'" in line and "no space left" in line


def test_invalid_utf8_in_prompts_names_file_and_line(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompts", prompts))
    assert f"{prompts}:2:" in line and "UTF-8" in line and "0xe9" in line


def test_utf8_bom_is_not_part_of_the_first_line(capsys, tmp_path):
    from speculant.launch.cli import read_prompts_file

    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "ok"}\r\n{"prompt_token_ids": [1]}\r\n')
    assert [s.prompt for s in read_prompts_file(str(prompts))] == ["ok", [1]]


@pytest.mark.parametrize("kind", ["directory", "/dev/null"])
def test_prompts_that_are_not_files_say_what_they_are(capsys, tmp_path, kind):
    path = tmp_path if kind == "directory" else Path("/dev/null")
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompts", path))
    expected = "is a directory" if kind == "directory" else "is a character device"
    assert str(path) in line and expected in line and "does not exist" not in line


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can create files in: mode 0555, or (root) the immutable attribute."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if os.access(folder, os.W_OK):  # root ignores the mode bits
        immutable = (
            subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        )
        if not immutable:
            pytest.skip("cannot make a read-only directory here (root without chattr)")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


def test_output_into_a_directory_is_found_before_loading(capsys, tmp_path):
    # tmp_path is no checkpoint: the --output error must come first
    line = error_line(
        *run_main(capsys, "--target", tmp_path, "--prompt", "x", "--output", tmp_path)
    )
    assert f"--output {str(tmp_path)!r} is a directory" in line


def test_output_into_a_read_only_place_is_found_before_loading(capsys, tmp_path, read_only_dir):
    out = read_only_dir / "out.jsonl"
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x", "--output", out))
    assert f"--output {str(out)!r} cannot be written" in line
    assert not out.exists()


def test_output_check_leaves_no_file_and_keeps_an_existing_one(capsys, tmp_path):
    from speculant.launch.paths import check_writable

    fresh, kept = tmp_path / "fresh.jsonl", tmp_path / "kept.jsonl"
    kept.write_text("old\n")
    check_writable(str(fresh), "--output")
    check_writable(str(kept), "--output")
    assert not fresh.exists() and kept.read_text() == "old\n"
    check_writable("/dev/null", "--output")  # devices are fine


@pytest.mark.parametrize("flag", ["--report", "--plot", "--write-baseline"])
def test_accept_rate_report_paths_are_checked_before_loading(capsys, tmp_path, read_only_dir, flag):
    status, err = run_main(capsys, flag, tmp_path, command="accept-rate")
    assert f"{flag} {str(tmp_path)!r} is a directory" in error_line(status, err)
    out = read_only_dir / "r.json"
    status, err = run_main(capsys, flag, out, command="accept-rate")
    assert f"{flag} {str(out)!r} cannot be written" in error_line(status, err)


def test_accept_rate_baseline_that_is_a_directory_or_not_utf8(capsys, tmp_path):
    line = error_line(*run_main(capsys, "--baseline", tmp_path, command="accept-rate"))
    assert f"--baseline {str(tmp_path)!r} is a directory" in line
    baseline = tmp_path / "b.json"
    baseline.write_bytes(b'{"acceptance_length": "\xff"}')
    line = error_line(*run_main(capsys, "--baseline", baseline, command="accept-rate"))
    assert str(baseline) in line and "UTF-8" in line


def test_stopped_line_names_the_output_only_when_this_run_wrote_it(tmp_path):
    """Ctrl-C before any request finished: an --output file from an earlier run still holds
    that run's lines, and the last line must not say it holds this run's."""
    from speculant.launch.spawn import RUN_STARTED, stopped_line

    old = tmp_path / "old.jsonl"
    old.write_text('{"old": 1}\n')
    os.utime(old, (RUN_STARTED - 60, RUN_STARTED - 60))
    line, status = stopped_line(KeyboardInterrupt(), str(old), ranks=False)
    assert status == 130 and "no request had finished" in line and "are in" not in line
    assert "no request had finished" in stopped_line(KeyboardInterrupt(), "missing", False)[0]
    old.write_text('{"index": 0}\n')  # written by this run
    assert (
        f"the requests that finished are in {old}"
        in stopped_line(KeyboardInterrupt(), str(old), False)[0]
    )


def test_completions_the_terminal_cannot_encode_are_escaped(llama_dir, tmp_path):
    """A stdout that is not UTF-8 (PYTHONIOENCODING=ascii, a C locale) shows the completion
    escaped instead of losing the whole run to an encoding error."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--target",
           str(llama_dir), "--prompt", "h\u00e9llo", "--max-new-tokens", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[0] h\\xe9llo"), proc.stdout


def test_empty_prompt_flag_is_refused_before_loading(capsys, tmp_path):
    # tmp_path holds no checkpoint: the error must come before any model loads
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", ""))
    assert "--prompt is empty" in line


# ------------------------------------------------------------- API misuse named before running


def test_api_misuse_is_named_before_anything_runs(tmp_path, llama_dir):
    eng = Engine(str(llama_dir), device="cpu", max_num_seqs=2)
    with pytest.raises(SpeculantError, match="on_output=5 is not callable"):
        eng.generate([[5, 6]], on_output=5)
    with pytest.raises(SpeculantError, match="is a file; pass the folder holding it"):
        Engine(str(llama_dir / "config.json"), device="cpu")
    # a prompt that fills the context leaves no room for output: the message says so
    with pytest.raises(SpeculantError, match="leaving no room for output .* at most 8 prompt"):
        Engine(str(llama_dir), device="cpu", max_model_len=9).generate([list(range(3, 12))])


def test_tp_that_does_not_divide_the_heads_names_the_sizes_that_do(capfd, llama_dir):
    # the launcher's ranks write the line to the process's stderr: capfd, not capsys
    heads = json.loads((llama_dir / "config.json").read_text())["num_attention_heads"]
    line = error_line(*run_main(capfd, "--target", llama_dir, "--prompt", "x", "--device",
                                "cpu", "--tp", heads + 1))  # fmt: skip
    assert f"not divisible by tp={heads + 1}; use --tp 1" in line, line


def test_api_page_size_has_the_clis_bound(llama_dir):
    from speculant.config import MAX_PAGE_SIZE
    from speculant.launch.cli import MAX_PAGE_SIZE as CLI_MAX

    assert MAX_PAGE_SIZE == CLI_MAX
    with pytest.raises(
        SpeculantError, match=f"page_size={MAX_PAGE_SIZE + 1} must be in 1..{MAX_PAGE_SIZE}"
    ):
        Engine(str(llama_dir), device="cpu", page_size=MAX_PAGE_SIZE + 1)


# ------------------------------------------- prompt errors found once the model is loaded


def test_a_prompt_the_model_refuses_is_named_by_its_file_line(capsys, tmp_path, llama_dir):
    """Token ids outside the vocabulary or a prompt too long for --max-model-len are found
    once the model is loaded; the error names the --prompts line (blank lines counted), not
    the prompt's place among the prompts (an audit: "prompt 1" for line 4)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_token_ids": [5, 6]}, "", "  ", {"prompt_token_ids": [1, 2, 99999]},
    ])  # fmt: skip
    line = error_line(*run_main(capsys, "--target", llama_dir, "--prompts", prompts))
    assert f"{prompts}:4: the prompt has token id 99999 outside the vocabulary" in line, line
    prompts = write_jsonl(tmp_path / "q.jsonl", ["", {"prompt_token_ids": list(range(40))}])
    line = error_line(*run_main(capsys, "--target", llama_dir, "--prompts", prompts,
                                "--max-model-len", 32))  # fmt: skip
    assert f"{prompts}:2: the prompt has 40 tokens, leaving no room" in line, line


def test_a_tokenizer_of_another_model_is_named_as_such(capsys, tmp_path, llama_dir):
    """A text prompt whose ids the checkpoint's own tokenizer puts past its vocab_size: the
    checkpoint holds another model's tokenizer; the message says so (it said "fix the token
    ids" to a user who wrote none)."""
    folder = copy_checkpoint(llama_dir, tmp_path / "mixed")
    shutil.copy(ASSETS / "target" / "tokenizer.json", folder / "tokenizer.json")
    line = error_line(*run_main(capsys, "--target", folder, "--prompt",
                                "def fibonacci(n): return fibonacci(n - 1)"))  # fmt: skip
    assert line.startswith("speculant: error: --prompt: the prompt is text the tokenizer turns")
    assert "tokenizer.json of another model" in line and "token ids" not in line, line


def test_num_draft_tokens_without_a_drafter_says_so(capsys, llama_dir):
    """--num-draft-tokens with a --target and no --draft: the message names the missing
    drafter (it spoke of the drafter's config.json, with no drafter given)."""
    line = error_line(*run_main(capsys, "--target", llama_dir, "--prompt", "hi",
                                "--num-draft-tokens", 3))  # fmt: skip
    assert "--num-draft-tokens 3 needs a drafter: pass --draft DIR" in line, line


def test_a_text_prompt_without_a_tokenizer_says_the_same_everywhere(capsys, tmp_path, llama_dir):
    """One message whether one process or a rank found it (the CLI had its own wording)."""
    folder = copy_checkpoint(llama_dir, tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}, {"prompt": "hi"}])
    line = error_line(*run_main(capsys, "--target", folder, "--prompts", prompts))
    assert f"{prompts}:2: the prompt is text but '{folder}' has no tokenizer.json; add one" in line


def test_output_that_fills_up_keeps_whole_lines(llama_dir, tmp_path):
    """A write that fails part way through a line (a full disk; here a file size limit, which
    fails the same way: the bytes up to it are written) leaves --output ending at its last whole
    line, valid JSONL, with the one-line error and exit 2."""
    import resource

    rows = [{"prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 3} for i in range(12)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, limit = tmp_path / "out.jsonl", 1500  # a few lines of ~500 bytes, the last cut

    def small_files() -> None:  # Python ignores SIGXFSZ: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--target",
           str(llama_dir), "--prompts", "p.jsonl", "--output", str(out),
           "--max-num-seqs", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          preexec_fn=small_files)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"speculant: error: --output '{out}': writing failed" in proc.stderr.splitlines()[-1]
    text = out.read_text()
    assert text and text.endswith("\n") and len(text) < limit, text[-200:]
    indices = [json.loads(line)["index"] for line in text.splitlines()]
    assert indices == sorted(set(indices)) and len(indices) < len(rows)


def test_whole_file_writes_keep_mode_links_and_devices(tmp_path):
    """`paths.write_whole`: the file is replaced whole with its permissions kept; a symlink's
    file is replaced (the link stays a link); a device is written directly; a write that fails
    leaves the file as it was and no temporary file."""
    from speculant.launch.paths import write_whole

    def text(value: str):
        return lambda out: Path(out).write_text(value)

    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o640)
    write_whole(str(kept), text("new"))
    assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o640
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    write_whole(str(link), text("via link"))
    assert link.is_symlink() and kept.read_text() == "via link"
    write_whole(os.devnull, text("dropped"))  # not a regular file: no rename over it
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()

    def fails(out: str) -> None:
        Path(out).write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(str(kept), fails)
    assert kept.read_text() == "via link"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "link.json"]
