"""The Python API's inputs of the wrong kind, found by an audit: each is one SpeculantError
naming the argument and the fix (they were AttributeError / TypeError / KeyError tracebacks, or
numpy integers refused where Python ones were taken), and nothing the caller gave is changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from speculant import ASSETS, Engine, SamplingParams, SpeculantError


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine(llama_dir, device="cpu", max_num_seqs=4, max_model_len=64)


def test_a_torch_device_is_taken(llama_dir):
    eng = Engine(llama_dir, device=torch.device("cpu"), max_num_seqs=2, max_model_len=32)
    assert eng.device == "cpu"
    with pytest.raises(SpeculantError, match=r"device=0 must be 'cpu', 'cuda' or 'cuda:N'"):
        Engine(llama_dir, device=0)


@pytest.mark.parametrize("draft", [5, b"/x", ""])
def test_a_draft_that_is_no_path_is_named(llama_dir, draft):
    with pytest.raises(SpeculantError, match=r"draft=.* must be the path of a drafter"):
        Engine(llama_dir, device="cpu", algo="eagle3", draft=draft)


def test_numpy_integers_are_integers():
    target = str(ASSETS / "target")  # the bundled target and its EAGLE-3 head (a Path here)
    eng = Engine(target, device="cpu", algo="eagle3", draft=Path(ASSETS / "eagle3"),
                 num_draft_tokens=np.int64(2), catch_up_depth=np.int64(4), max_model_len=32,
                 max_num_seqs=2)  # fmt: skip
    assert eng.config.spec.num_draft_tokens == 2 and type(eng.config.spec.num_draft_tokens) is int


@pytest.mark.parametrize(
    "params, needle",
    [
        (5, "sampling_params is of type int"),
        ((p for p in [SamplingParams()]), "sampling_params is of type generator"),
        ("greedy", "sampling_params is of type str"),
        ([SamplingParams(), SamplingParams(top_p=0)], r"sampling_params\[1\]: top_p=0"),
    ],
)
def test_sampling_params_of_the_wrong_kind_are_named(engine, params, needle):
    with pytest.raises(SpeculantError, match=needle):
        engine.generate([[5, 6], [7, 8]], params)


def test_bytes_are_no_prompt(engine):
    with pytest.raises(SpeculantError, match="prompts is bytes"):
        engine.generate(b"abc")
    with pytest.raises(SpeculantError, match="use_tqdm='no' must be True or False"):
        engine.generate([[5, 6]], use_tqdm="no")


def test_the_callers_sampling_params_are_not_changed(engine):
    given = SamplingParams(temperature=1e-6, max_new_tokens=4)
    engine.generate([[5, 6]], given)
    assert given.temperature == 1e-6


@pytest.mark.parametrize("name", ["max_tokens", "min_tokens", "presence_penalty", "logit_bias"])
def test_a_sampling_field_it_does_not_have_cannot_be_set(engine, name):
    """A field SamplingParams lacks (vLLM's max_tokens, min_tokens, penalties) is refused when
    set on an object as it is in the constructor: it was kept and silently ignored (a request
    with params.max_tokens = 2 ran to the default 64 tokens)."""
    with pytest.raises(TypeError, match=name):
        SamplingParams(**{name: 2})
    params = SamplingParams(max_new_tokens=3)
    with pytest.raises(AttributeError, match=name):
        setattr(params, name, 2)
    assert len(engine.generate([[5, 6]], params)[0].token_ids) == 3


def test_generate_inside_on_output_is_refused_and_the_engine_goes_on(engine):
    """One engine runs one generate at a time: a nested call (from on_output) raised KeyError
    after running the outer requests as its own; now a clear error reaches the outer caller,
    and the engine serves the next call."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def nested(out):
        engine.generate([[42, 43]], params)

    with pytest.raises(SpeculantError, match="generate is already running on this engine"):
        engine.generate([[5, 6, 7], [9, 10]], params, on_output=nested)
    again = engine.generate([[5, 6, 7], [9, 10]], params)
    assert [len(o.token_ids) for o in again] == [4, 4]


def test_a_prompt_error_survives_pickling():
    """A rank's PromptError reaches the Ray driver pickled: it must come back whole, a user
    error (it came back as a failed deserialisation, exit 1 instead of 2)."""
    import pickle

    from speculant.errors import PromptError

    error = pickle.loads(pickle.dumps(PromptError(3, "has 400 tokens")))
    assert isinstance(error, PromptError) and isinstance(error, SpeculantError)
    assert (error.index, error.detail, str(error)) == (
        3,
        "has 400 tokens",
        "prompt 3 has 400 tokens",
    )


def test_a_stop_token_the_model_cannot_emit_is_refused(engine):
    """A stop id past the vocabulary would never match: refused, not silently kept."""
    with pytest.raises(SpeculantError, match=r"prompt 0 has stop_token_ids holding 4101, outside"):
        engine.generate([[5, 6]], SamplingParams(stop_token_ids=[3, 4101]))
