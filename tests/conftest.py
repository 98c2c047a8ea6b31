"""Shared fixtures: tiny HF checkpoints (built once per session), the `gpu` skip and the
`needs(package)` skip for tests of optional packages."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Triton decides at its first import whether kernels run in its interpreter: set it here, before
# any test module (or the package under test) can import it, so the CPU kernel tests run whatever
# the collection order (a module importing the engine imports triton).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's `-n 2`) each worker process takes its share of the cores:
# torch would start a thread per core in every worker, and the workers' threads then wait on each
# other. Subprocesses the tests start choose their own (the command's rule, or OMP_NUM_THREADS=1).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# tests/ has no __init__.py; make `import helpers_ckpt` work whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import helpers_ckpt  # noqa: E402

# How to get each optional package a test may need (`@pytest.mark.needs("triton")`); the
# README's test install leaves them out, and `python -m pytest -m needs tests` runs just these.
INSTALL_HINTS = {
    "triton": "pip install triton==3.6.0 (a CUDA build of torch brings it)",
    "ray": "pip install -e '.[ray]'",
    "matplotlib": "pip install -e '.[plot]'",
    "speculators": "pip install --no-deps speculators==0.9.0 loguru==0.7.3",
    "loguru": "pip install --no-deps loguru==0.7.3",
    "dflash": "pip install --no-deps dflash==0.1.0",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `needs(package)` when the package is not installed, and tests marked
    `gpu` when CUDA is not available."""
    for item in items:
        for marker in item.iter_markers("needs"):
            missing = [name for name in marker.args if importlib.util.find_spec(name) is None]
            if missing:
                hints = "; ".join(INSTALL_HINTS.get(n, f"pip install {n}") for n in missing)
                item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}: {hints}"))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only tokenizer.json (the demo model's byte-level BPE)."""
    return helpers_ckpt.save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Llama with llama3 RoPE scaling, legacy config keys and a tokenizer.json."""
    return helpers_ckpt.build_llama(tmp_path_factory.mktemp("llama"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (q/k/v biases), no tokenizer."""
    return helpers_ckpt.build_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 (q/k norms), 3 layers, no tokenizer."""
    return helpers_ckpt.build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with tie_word_embeddings=True, no tokenizer."""
    return helpers_ckpt.build_llama_tied(tmp_path_factory.mktemp("llama_tied"))


@pytest.fixture(scope="session")
def llama_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama in several safetensors shards plus model.safetensors.index.json, no tokenizer."""
    return helpers_ckpt.build_llama_sharded(tmp_path_factory.mktemp("llama_sharded"))


@pytest.fixture(scope="session")
def hf_model_dirs(
    llama_dir: Path, qwen2_dir: Path, qwen3_dir: Path, llama_tied_dir: Path, llama_sharded_dir: Path
) -> dict[str, Path]:
    """Every tiny checkpoint by name."""
    return {
        "llama": llama_dir,
        "qwen2": qwen2_dir,
        "qwen3": qwen3_dir,
        "llama_tied": llama_tied_dir,
        "llama_sharded": llama_sharded_dir,
    }
