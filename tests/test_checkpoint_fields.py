"""Checkpoint fields a user's config.json (or weight files) can get wrong, through the real CLI
on real tiny checkpoints in the published layouts: `architectures` of another type, a config
without `architectures`, badly typed speculators fields, a default k above what the engine runs,
a DFLASH drafter of another vocabulary, the same tensor in two weight files. Each is one line
`speculant: error: ...` naming the field (or tensor), the file and the fix, exit 2; none is a
traceback, a silently lowered value or a silent winner."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_dflash import write_random_dflash, write_speculators_dflash
from helpers_eagle import write_random_eagle3, write_speculators_eagle3
from safetensors.torch import load_file, save_file

from speculant.config import ModelConfig
from speculant.launch.cli import main


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, Path]:
    """The target's drafters in each published layout: z-lab DFLASH (block 4), its speculators
    conversion, a SpecForge EAGLE-3 head and its speculators conversion."""
    root = tmp_path_factory.mktemp("drafters")
    write_random_dflash(root / "dflash", llama_dir, block_size=4, target_layer_ids=[0])
    write_speculators_dflash(root / "spec_dflash", root / "dflash", llama_dir)
    write_random_eagle3(root / "eagle3", llama_dir)
    write_speculators_eagle3(root / "spec_eagle3", root / "eagle3", llama_dir)
    return {path.name: path for path in root.iterdir()}


def variant(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of checkpoint folder `src` whose config.json `edit` changed in place."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def generate(capsys, target: Path, *extra) -> tuple[int, str, str]:
    """`speculant generate` on the CPU: (exit status, stdout, stderr)."""
    args = ["generate", "--device", "cpu", "--target", target, "--prompt", "hi"]
    rc = main([str(a) for a in [*args, "--max-new-tokens", "6", "--ignore-eos", *extra]])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, target: Path, *extra) -> str:
    """The one error line of a run that must be refused with exit 2 (no traceback)."""
    rc, _, err = generate(capsys, target, *extra)
    assert rc == 2, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("speculant: error: "), err
    return line


def set_path(keys: str, value) -> Callable[[dict], None]:
    """An edit setting config[k1][k2]... = value (`keys` dotted; an int is a list index)."""

    def edit(config: dict) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in keys.split(".")]
        for key in parents:
            config = config[key]
        config[last] = value

    return edit


# ------------------------------------------------------------ architectures


@pytest.mark.parametrize(
    "which, value",
    [
        ("target", {"x": 1}),
        ("target", 5),
        ("target", [5]),
        ("dflash", [5]),
        ("dflash", {"x": 1}),
        ("eagle3", {"x": 1}),
        ("eagle3", 5),
        ("spec_eagle3", ["Eagle3Speculator", 5]),
    ],
)
def test_architectures_that_are_not_a_list_of_names_are_refused(
    capsys, tmp_path, llama_dir, drafters, which, value
):
    """Once a KeyError / TypeError traceback (a dict, a number, a number in the list)."""
    src = llama_dir if which == "target" else drafters[which]
    bad = variant(src, tmp_path / "bad", set_path("architectures", value))
    target, extra = (bad, []) if which == "target" else (llama_dir, ["--draft", bad])
    if which in ("dflash", "eagle3"):
        extra += ["--algo", which]
    line = refused(capsys, target, *extra)
    assert f"architectures={value!r} in {bad / 'config.json'}" in line, line
    assert "must be a list of class names" in line and "fix config.json" in line, line


@pytest.mark.parametrize("which", ["target", "dflash", "eagle3"])
def test_architectures_as_one_string_is_refused_with_the_list_to_write(
    capsys, tmp_path, llama_dir, drafters, which
):
    """A bare string was read letter by letter ("architecture 'L' is not supported")."""
    src = llama_dir if which == "target" else drafters[which]
    name = {"target": "LlamaForCausalLM", "dflash": "DFlashDraftModel"}.get(
        which, "LlamaForCausalLMEagle3"
    )
    bad = variant(src, tmp_path / "bad", set_path("architectures", name))
    target, extra = (bad, []) if which == "target" else (llama_dir, ["--draft", bad])
    line = refused(capsys, target, *extra, *(["--algo", which] if which != "target" else []))
    assert f"architectures='{name}' in {bad / 'config.json'}" in line, line
    assert f'write ["{name}"] in config.json' in line, line


# ------------------------------------------------------------ model_type without architectures


def test_model_type_stands_in_for_missing_architectures(capsys, tmp_path, llama_dir):
    """As transformers' AutoModelForCausalLM loads it: by model_type (was: "architecture None
    is not supported"); the tokens are those of the same checkpoint with its architectures."""
    bare = variant(llama_dir, tmp_path / "bare", lambda c: c.pop("architectures"))
    rc, out, err = generate(capsys, bare)
    assert rc == 0, err
    assert generate(capsys, llama_dir)[1] == out
    config = json.loads((bare / "config.json").read_text())
    for model_type, arch in (
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ):
        assert ModelConfig.from_hf({**config, "model_type": model_type}).architecture == arch


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c.update(architectures=None, model_type="gpt2"),
            "has no architectures and model_type='gpt2' is not supported; supported model "
            "types: llama, mistral, qwen2, qwen3, qwen3_moe",
        ),
        (
            lambda c: [c.pop("architectures"), c.pop("model_type")],
            "has neither architectures nor model_type; add the model's class",
        ),
    ],
)
def test_missing_architectures_and_unknown_model_type_name_both_fields(
    capsys, tmp_path, llama_dir, edit, message
):
    bad = variant(llama_dir, tmp_path / "bad", edit)
    line = refused(capsys, bad)
    assert f"{bad / 'config.json'} {message}" in line, line


# ------------------------------------------------------------ speculators fields


@pytest.mark.parametrize(
    "which, keys, value, message",
    [
        ("spec_eagle3", "speculators_config.verifier", "x", "verifier='x' in {} must be an object"),
        (
            "spec_eagle3",
            "speculators_config.verifier.name_or_path",
            5,
            "verifier.name_or_path=5 in {} must be a string",
        ),
        (
            "spec_eagle3",
            "speculators_config.proposal_methods",
            [5],
            "proposal_methods=[5] in {} must be a list of method objects",
        ),
        (
            "spec_eagle3",
            "speculators_config.proposal_methods",
            "greedy",
            "proposal_methods='greedy' in {} must be a list of method objects",
        ),
        (
            "spec_eagle3",
            "speculators_config.proposal_methods.0.speculative_tokens",
            "3",
            "proposal_methods[0].speculative_tokens='3' in {} must be a positive integer",
        ),
        (
            "spec_eagle3",
            "speculators_config.proposal_methods.0.speculative_tokens",
            True,
            "proposal_methods[0].speculative_tokens=True in {} must be a positive integer",
        ),
        (
            "spec_eagle3",
            "speculators_config.default_proposal_method",
            "tree",
            "default_proposal_method='tree' in {} names none of the proposal_methods ('greedy')",
        ),
        ("spec_eagle3", "norm_before_residual", "false", "norm_before_residual='false' in {} must"),
        ("spec_dflash", "draft_vocab_size", "abc", "draft_vocab_size='abc' in {} must be an int"),
        ("spec_dflash", "target_hidden_size", "64", "target_hidden_size='64' in {} must be an int"),
        (
            "spec_dflash",
            "aux_hidden_state_layer_ids",
            "1",
            "aux_hidden_state_layer_ids='1' in {} must be a list of target layer indices",
        ),
        (
            "spec_dflash",
            "aux_hidden_state_layer_ids",
            ["1"],
            "aux_hidden_state_layer_ids=['1'] in {} must be a list of target layer indices",
        ),
        ("spec_dflash", "sample_from_anchor", "false", "sample_from_anchor='false' in {} must be"),
    ],
)
def test_badly_typed_speculators_fields_are_named(
    capsys, tmp_path, llama_dir, drafters, which, keys, value, message
):
    """Once AttributeError tracebacks (verifier, proposal_methods), `invalid literal for int()`
    naming no field, a string "3" taken as k 3, a "false" flag read as true."""
    bad = variant(drafters[which], tmp_path / "bad", set_path(keys, value))
    line = refused(capsys, llama_dir, "--draft", bad)
    assert message.format(bad / "config.json") in line, line


def test_speculative_tokens_above_the_maximum_are_refused_unless_overridden(
    capsys, tmp_path, llama_dir, drafters
):
    """A speculators default k of 17 was lowered to 16 without a word; an explicit
    --num-draft-tokens wins over it (and is not an error)."""
    edit = set_path("speculators_config.proposal_methods.0.speculative_tokens", 17)
    bad = variant(drafters["spec_eagle3"], tmp_path / "bad", edit)
    line = refused(capsys, llama_dir, "--draft", bad)
    assert (
        f"speculators_config.proposal_methods[0].speculative_tokens=17 in {bad / 'config.json'} "
        "is above the engine's maximum of 16 draft tokens; pass --num-draft-tokens N with "
        "N <= 16 to override it"
    ) in line, line
    rc, _, err = generate(capsys, llama_dir, "--draft", bad, "--num-draft-tokens", "4")
    assert rc == 0, err
    assert len(err.split("per_position=")[1].split()[0].split(",")) == 4, err


def test_dflash_speculative_tokens_beyond_the_block_are_refused(
    capsys, tmp_path, llama_dir, drafters
):
    """A block of 4 drafts 3; a default k of 5 was lowered to 3 without a word."""
    edit = set_path("speculators_config.proposal_methods.0.speculative_tokens", 5)
    bad = variant(drafters["spec_dflash"], tmp_path / "bad", edit)
    line = refused(capsys, llama_dir, "--draft", bad)
    assert "speculative_tokens=5 in" in line and "the 3 drafts a DFLASH block of 4 holds" in line
    assert "--num-draft-tokens N with N <= 3" in line, line
    rc, _, err = generate(capsys, llama_dir, "--draft", bad, "--num-draft-tokens", "2")
    assert rc == 0, err


def test_speculators_dflash_without_block_size_defaults_k_to_its_block(
    capsys, tmp_path, llama_dir, drafters
):
    """No block_size: the speculators schema's 8, for the model and for the default k alike (k
    used to default to 16 - 1 = 15, then be refused as not fitting the block of 8)."""

    def edit(config: dict) -> None:
        del config["block_size"]
        config["speculators_config"]["proposal_methods"] = []

    bare = variant(drafters["spec_dflash"], tmp_path / "bare", edit)
    rc, _, err = generate(capsys, llama_dir, "--draft", bare)
    assert rc == 0, err
    assert len(err.split("per_position=")[1].split()[0].split(",")) == 7, err


# ------------------------------------------------------------ DFLASH vocabulary


@pytest.mark.parametrize("which", ["dflash", "spec_dflash"])
def test_dflash_vocab_size_other_than_the_targets_is_refused(
    capsys, tmp_path, llama_dir, drafters, which
):
    """It drafts with the target's embeddings and lm_head: another vocabulary's ids are another
    tokenizer's (was: accepted, exit 0)."""
    key = "vocab_size" if which == "dflash" else "transformer_layer_config.vocab_size"
    bad = variant(drafters[which], tmp_path / "bad", set_path(key, 1000))
    line = refused(capsys, llama_dir, "--draft", bad, *(["--algo", "dflash"] * (which == "dflash")))
    assert (
        f"DFLASH {key}=1000 in {bad / 'config.json'} != the target's 512; the drafter shares "
        "the target's embeddings and lm_head"
    ) in line, line


# ------------------------------------------------------------ one file per tensor


def test_a_tensor_in_two_safetensors_files_is_refused(capsys, tmp_path, llama_dir):
    """Without an index the last file in sorted order used to win, silently."""
    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    save_file({"model.norm.weight": torch.zeros(64)}, str(target / "zz.safetensors"))
    line = refused(capsys, target)
    assert (
        f"tensor 'model.norm.weight' is in both {str(target / 'model.safetensors')!r} and "
        f"{str(target / 'zz.safetensors')!r}; a checkpoint holds each tensor once"
    ) in line, line


def shard(llama_dir: Path, out: Path, move: str | None = None, copy: str | None = None) -> Path:
    """llama_dir as two shards with an index (norms and lm_head in the second); `move` puts
    that tensor in the first shard instead, the index unchanged; `copy` puts it in both."""
    shutil.copytree(llama_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(llama_dir / "model.safetensors"))
    second = {k: t for k, t in tensors.items() if k.endswith("norm.weight") or "lm_head" in k}
    files = {
        "model-00001-of-00002.safetensors": {k: t for k, t in tensors.items() if k not in second},
        "model-00002-of-00002.safetensors": second,
    }
    weight_map = {name: file for file, part in files.items() for name in part}
    for name in filter(None, (move, copy)):
        files["model-00001-of-00002.safetensors"][name] = tensors[name]
    if move:
        del second[move]
    for file, part in files.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_with_an_index_each_tensor_must_be_in_the_shard_it_names(capsys, tmp_path, llama_dir):
    """The index decides: a sharded copy runs as the original; a tensor also in another shard,
    or only in another shard than the index names, is refused naming the tensor and both files
    (a copy in another shard used to win by sort order, silently)."""
    good = shard(llama_dir, tmp_path / "good")
    rc, out, err = generate(capsys, good)
    assert rc == 0 and out == generate(capsys, llama_dir)[1], err
    name, first, second = (
        "model.norm.weight",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )
    both = shard(llama_dir, tmp_path / "both", copy=name)
    line = refused(capsys, both)
    assert (
        f"tensor {name!r} is in both {str(both / first)!r} and {str(both / second)!r} "
        f"(model.safetensors.index.json maps it to {str(both / second)!r})"
    ) in line, line
    moved = shard(llama_dir, tmp_path / "moved", move=name)
    line = refused(capsys, moved)
    assert (
        f"tensor {name!r} is in {str(moved / first)!r} but model.safetensors.index.json maps it "
        f"to {str(moved / second)!r}; the index does not match its shards"
    ) in line, line


def test_a_head_tensor_in_two_bin_files_or_under_two_names_is_refused(
    capsys, tmp_path, llama_dir, drafters
):
    """pytorch_model*.bin heads: the later file's copy used to win; `model.fc.weight` beside
    `fc.weight` (both load as fc.weight) too."""
    tensors = load_file(str(drafters["eagle3"] / "model.safetensors"))
    bins = tmp_path / "bins"
    bins.mkdir()
    shutil.copy(drafters["eagle3"] / "config.json", bins / "config.json")
    torch.save(tensors, bins / "pytorch_model-00001-of-00002.bin")
    torch.save({"fc.weight": tensors["fc.weight"]}, bins / "pytorch_model-00002-of-00002.bin")
    line = refused(capsys, llama_dir, "--draft", bins, "--algo", "eagle3")
    assert "tensor 'fc.weight' is in both" in line and "pytorch_model-00002-of-00002.bin" in line
    prefixed = variant(drafters["eagle3"], tmp_path / "prefixed", lambda c: None)
    both = {**tensors, "model.fc.weight": tensors["fc.weight"].clone()}
    save_file(both, str(prefixed / "model.safetensors"))
    line = refused(capsys, llama_dir, "--draft", prefixed, "--algo", "eagle3")
    assert f"{str(prefixed)!r} holds both 'fc.weight' and 'model.fc.weight'" in line, line
