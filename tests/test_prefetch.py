"""Weights asked into L2 during each layer's attention chain (kernels/prefetch.py; the lever
`TritonOps.l2_prefetch_bytes`, off as shipped): the forward calls the prefetcher once a layer,
after the QKV projection is launched and before attention, with the weights read next in the
order they are read; the Triton ops give a prefetcher only for small forwards on CUDA with a
budget; on the GPU, greedy tokens with it (CUDA graphs: a side-stream branch joined before
the forward ends) equal those without."""

from __future__ import annotations

import pytest
import torch

import speculant
from speculant import Engine, SamplingParams
from speculant.kernels.ops import TorchOps, TritonOps

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The capital of France"]


def test_each_layer_prefetches_the_weights_it_reads_next_after_its_qkv_projection():
    """Seen through the ops the forward is given (the protocol): one call a layer, between the
    layer's QKV projection and its attention, naming the o projection's weight and then the
    MLP's gate_up weight; the prefetcher's context closes after the last layer; the logits
    equal a forward without it."""
    engine = Engine(speculant.bundled("target"), device="cpu", dtype="float32",
                    max_num_seqs=2, max_model_len=64)  # fmt: skip
    model, runner = engine.model, engine.runner
    events = []

    class Prefetcher:
        def __call__(self, weights):
            events.append(("prefetch", [id(w) for w in weights]))

    class RecordingOps(TorchOps):
        @staticmethod
        def prefetching(x):
            class Context:
                def __enter__(self):
                    events.append(("open", x.shape[0]))
                    return Prefetcher()

                def __exit__(self, *exc):
                    events.append(("close",))

            return Context()

    layers = model.model.layers
    for i, layer in enumerate(layers):
        for name in ("qkv_proj", "o_proj"):
            module = getattr(layer.self_attn, name)
            module.register_forward_hook(lambda *a, i=i, name=name: events.append((name, i)))
    one_forward = []
    for i, layer in enumerate(layers):
        weights = [id(layer.self_attn.o_proj.weight), id(layer.mlp.gate_up_proj.weight)]
        one_forward += [("qkv_proj", i), ("prefetch", weights), ("o_proj", i)]

    prompt = [5, 9, 13, 2, 7]
    plain = engine.generate([prompt], GREEDY)[0].token_ids
    runner.attn.ops = RecordingOps()  # an instance attribute over the class's
    events.clear()
    assert engine.generate([prompt], GREEDY)[0].token_ids == plain
    forwards = []
    for event in events:
        if event[0] == "open":
            forwards.append([event])
        else:
            forwards[-1].append(event)
    assert len(forwards) >= GREEDY.max_new_tokens - 1
    assert forwards[0][0] == ("open", len(prompt)) and forwards[1][0] == ("open", 1)
    for forward in forwards:
        assert forward[1:] == one_forward + [("close",)]


def test_triton_ops_prefetch_only_small_cuda_forwards_with_a_budget(monkeypatch):
    """No budget (as shipped), a CPU tensor or more tokens than l2_prefetch_max_tokens: no
    prefetcher (None), so the forward launches nothing more."""
    ops = TritonOps()
    one = torch.zeros(1, 8)
    with ops.prefetching(one) as prefetch:
        assert prefetch is None  # no budget
    monkeypatch.setattr(TritonOps, "l2_prefetch_bytes", 32 << 20)
    with ops.prefetching(one) as prefetch:
        assert prefetch is None  # the CPU
    many = torch.zeros(TritonOps.l2_prefetch_max_tokens + 1, 8)
    with ops.prefetching(many) as prefetch:
        assert prefetch is None
    with TorchOps.prefetching(one) as prefetch:
        assert prefetch is None


@pytest.mark.gpu
@pytest.mark.needs("triton")
def test_prefetching_keeps_the_tokens_in_cuda_graphs(monkeypatch):
    """Greedy tokens of the bundled target on the Triton backend with graphs, one request and
    three, with 1 MB a layer prefetched: equal to the tokens without; the prefetch kernel ran
    (the side stream saw work: a captured branch joined at the forward's end, or capture would
    have failed)."""
    from speculant.kernels import prefetch

    calls = []
    launch = prefetch.prefetch_bytes

    def counted(tensor, most):
        calls.append(most)
        return launch(tensor, most)

    def tokens():
        engine = Engine(speculant.bundled("target"), device="cuda", dtype="bfloat16",
                        max_num_seqs=4, max_model_len=128, attention_backend="triton")  # fmt: skip
        return [[o.token_ids for o in engine.generate(batch, GREEDY, use_tqdm=False)]
                for batch in (PROMPTS[:1], PROMPTS)]  # fmt: skip

    without = tokens()
    monkeypatch.setattr(TritonOps, "l2_prefetch_bytes", 1 << 20)
    monkeypatch.setattr(prefetch, "prefetch_bytes", counted)
    assert tokens() == without
    assert calls
