"""tools/train_all.py --smoke: the whole training pipeline runs on the CPU in a few seconds of
steps, and what it writes loads in our runtime (target, EAGLE-3 head, draft LM and, when the
runtime has it, the DFLASH drafter) with greedy speculative output equal to plain greedy output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from speculant import Engine, SamplingParams

TOOLS = Path(__file__).resolve().parent.parent / "tools"
ASSET_DIRS = ("target", "eagle3", "dflash", "draft_lm")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(assets dir, data dir) of one smoke run on a 200-file corpus subset."""
    root = tmp_path_factory.mktemp("train_all")
    assets, data = root / "assets", root / "data"
    cmd = [sys.executable, str(TOOLS / "train_all.py"), "--smoke", "--max-files", "200"]
    cmd += ["--out", str(assets), "--data-out", str(data)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return assets, data


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def test_assets_and_prompt_sets_are_written(smoke):
    assets, data = smoke
    summary = json.loads((assets / "train_summary.json").read_text())
    corpus_hash = summary["corpus"]["file_list_sha256"]
    for name in ASSET_DIRS:
        folder = assets / name
        assert (folder / "config.json").is_file()
        assert (folder / "model.safetensors").is_file()
        card = (folder / "README.md").read_text()
        assert corpus_hash in card and "## Measured acceptance" in card
        assert name in summary["stages"]
    for name in ("target", "draft_lm"):
        assert (assets / name / "tokenizer.json").is_file()
        assert (assets / name / "tokenizer_config.json").is_file()
    big = [json.loads(line) for line in (data / "heldout_prompts.jsonl").read_text().splitlines()]
    small = (data / "heldout_prompts_small.jsonl").read_text().splitlines()
    assert big and all(set(row) == {"prompt"} and row["prompt"] for row in big)
    assert [json.loads(line) for line in small] == big[:8]


def test_published_layouts(smoke):
    assets, _ = smoke
    target = json.loads((assets / "target" / "config.json").read_text())
    H, V = target["hidden_size"], target["vocab_size"]
    eagle = json.loads((assets / "eagle3" / "config.json").read_text())
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"]
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # L = 8
    head = tensors_of(assets / "eagle3")
    draft_vocab = eagle["draft_vocab_size"]
    assert head["fc.weight"].shape == (H, 3 * H)
    assert head["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert head["lm_head.weight"].shape == (draft_vocab, H)
    ids = torch.arange(draft_vocab) + head["d2t"]
    assert head["d2t"].dtype == torch.int64 and ids.unique().numel() == draft_vocab
    assert head["t2d"].dtype == torch.bool and head["t2d"].sum() == draft_vocab
    assert bool(head["t2d"][ids].all())
    dflash = json.loads((assets / "dflash" / "config.json").read_text())
    assert dflash["architectures"] == ["DFlashDraftModel"] and dflash["block_size"] == 8
    layer_ids = dflash["dflash_config"]["target_layer_ids"]
    mask_id = dflash["dflash_config"]["mask_token_id"]
    tokenizer = json.loads((assets / "target" / "tokenizer.json").read_text())
    assert {t["content"]: t["id"] for t in tokenizer["added_tokens"]}["<|MASK|>"] == mask_id
    weights = tensors_of(assets / "dflash")
    assert weights["fc.weight"].shape == (H, len(layer_ids) * H)
    assert weights["layers.1.self_attn.k_norm.weight"].shape == (dflash["head_dim"],)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert target["vocab_size"] == V == dflash["vocab_size"]


def test_target_matches_transformers(smoke):
    """The saved target is a transformers LlamaForCausalLM equal to the model that trained."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(TOOLS))
    from modeling import LlamaShape, load_lm

    assets, _ = smoke
    cfg = json.loads((assets / "target" / "config.json").read_text())
    shape = LlamaShape(
        cfg["vocab_size"],
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["max_position_embeddings"],
        cfg["rope_theta"],
        cfg["rms_norm_eps"],
    )
    ours = load_lm(assets / "target", shape, "cpu").eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        assets / "target", dtype=torch.float32
    ).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.lm_head(ours(ids)[0])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_runtime_loads_them_and_speculation_is_lossless(smoke):
    assets, data = smoke
    prompt = json.loads((data / "heldout_prompts_small.jsonl").read_text().splitlines()[0])
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    target = str(assets / "target")

    def run(**spec):
        engine = Engine(target, device="cpu", max_num_seqs=2, page_size=4, **spec)
        return engine.generate([prompt["prompt"]], params)[0]

    plain = run()
    assert len(plain.token_ids) == 8 and isinstance(plain.text, str)
    drafters = [("eagle3", "eagle3", 3), ("draft-model", "draft_lm", 3), ("dflash", "dflash", 7)]
    for algo, folder, k in drafters:
        out = run(algo=algo, draft=str(assets / folder), num_draft_tokens=k)
        assert out.token_ids == plain.token_ids, algo
        assert out.stats["num_verify_steps"] > 0, algo
