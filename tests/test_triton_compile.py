"""Every Triton kernel of the package compiles for sm_90 without a GPU, with the arguments its
launch sites pass (tests/helpers_triton_compile.py drives them): the CPU tests run the kernels in
Triton's interpreter, which accepts code compiled Triton refuses (a reassigned constexpr did
reach an H200). One process without TRITON_INTERPRET compiles every case; a guard makes every
@triton.jit function of the package part of an offline compile test."""

from __future__ import annotations

import ast
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the package `speculant`
HELPER = TESTS / "helpers_triton_compile.py"
# not part of the package's kernels: the test suite, benchmark scripts, tools
NOT_SCANNED = {"tests", "benchmarks", "tools"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """The helper's report: {"ok": [...], "fail": [...], "kernels": {path:name}}. Compiled once
    per test session: pytest-xdist workers (each runs this module's fixture) share the report
    through the session's temporary folder, the first one compiling under a lock (~1 minute)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's
    report = shared / "triton_compile_report.txt"
    with (shared / "triton_compile.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not report.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            cache = tmp_path_factory.mktemp("triton_cache")
            env.update(TRITON_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
            done = subprocess.run([sys.executable, str(HELPER)], env=env, timeout=240,
                                  capture_output=True, text=True)  # fmt: skip
            lines = done.stdout.splitlines()
            ok = done.returncode == 0 and lines[-1:] == ["done"]
            assert ok, (done.stdout + done.stderr)[-3000:]
            report.write_text(done.stdout)
    lines = report.read_text().splitlines()
    return {
        "ok": [line[3:] for line in lines if line.startswith("ok ")],
        "fail": [line[5:] for line in lines if line.startswith("FAIL ")],
        "kernels": {line[7:] for line in lines if line.startswith("kernel ")},
    }


@pytest.mark.needs("triton")
def test_every_kernel_compiles_for_sm90(compiled):
    """Each launch a case makes (kernel, dtypes, constexprs, num_warps, PDL) compiles."""
    failed = [line for line in compiled["fail"] if not line.startswith("selfcheck")]
    assert not failed, "compiled Triton refuses (the interpreter does not):\n" + "\n".join(failed)
    assert len(compiled["ok"]) >= 90, compiled["ok"]


@pytest.mark.needs("triton")
def test_the_harness_reports_a_kernel_compiled_triton_refuses(compiled):
    """A kernel reassigning a constexpr (it runs in the interpreter) is reported as failing,
    with the compiler's message."""
    selfcheck = [line for line in compiled["fail"] if line.startswith("selfcheck")]
    assert len(selfcheck) == 1 and "_reassigned_constexpr_kernel" in selfcheck[0], compiled
    assert "constexpr cannot be reassigned" in selfcheck[0], selfcheck


FP8_KERNELS = ("_fma_kernel", "_dot_kernel", "_dequant_kernel", "_act_quant_kernel",
               "_w8a8_kernel", "_splitk_kernel", "_sum_splits_kernel", "_sk_kernel")  # fmt: skip


@pytest.mark.needs("triton")
def test_fp8_kernels_compile_on_the_paths_an_h200_routes(compiled):
    """The harness itself compiles every kernels/fp8.py kernel, its Llama-8B cases on the paths
    the tuned table routes an H200 to (scaled_mm: its activation quantisation, column-major)."""
    ours = {k.removeprefix("kernels/fp8.py:") for k in compiled["kernels"]}
    assert set(FP8_KERNELS) <= ours, sorted(ours)
    routed = {line.split(" | ")[0].split()[-1] for line in compiled["ok"] if line[:4] == "fp8 "}
    assert {"fma", "splitk", "dot", "w8a8", "dequant", "scaled_mm"} <= routed, routed


# ------------------------------------------------------------------------------ the guard


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _jit_functions() -> dict[str, set[str]]:
    """Every @triton.jit function of the package ("kernels/norm.py:_rms_norm_kernel") and the
    jit functions it names (its own module's, or imported from the package by name)."""
    trees = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_SCANNED or any(p.startswith(".") for p in parts):
            continue
        trees["/".join(parts)] = ast.parse(path.read_text(), str(path))
    jit = {
        rel: {
            node.name: node
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any(_dotted(d).split(".")[-1] == "jit" for d in node.decorator_list)
        }
        for rel, tree in trees.items()
    }
    found = {}
    for rel, tree in trees.items():
        scope = {name: f"{rel}:{name}" for name in jit[rel]}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("speculant."):
                source = node.module.removeprefix("speculant.").replace(".", "/") + ".py"
                for alias in node.names:
                    if alias.name in jit.get(source, {}):
                        scope[alias.asname or alias.name] = f"{source}:{alias.name}"
        for name, fn in jit[rel].items():
            names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            found[f"{rel}:{name}"] = {scope[n] for n in names if n in scope} - {scope[name]}
    return found


def _compiled_by_other_tests(kernels) -> set[str]:
    """Kernels another test compiles offline: named, with their module, in a test file that
    compiles for a GPUTarget (tests/test_adaptive.py, tests/test_fp8_kernels.py)."""
    texts = [p.read_text() for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name]
    texts = [text for text in texts if "GPUTarget" in text]
    covered = set()
    for kernel in kernels:
        path, name = kernel.split(":")
        module = "speculant." + path.removesuffix(".py").replace("/", ".")
        if any(module in text and name in text for text in texts):
            covered.add(kernel)
    return covered


@pytest.mark.needs("triton")
def test_every_jit_function_is_compiled_offline(compiled):
    """Every @triton.jit function of the package is compiled for sm_90 by a test: a case of
    tests/helpers_triton_compile.py, another test's GPUTarget compile, or a jit function such a
    kernel calls. A kernel added without one fails here, by name."""
    found = _jit_functions()
    assert {"kernels/runtime.py:pdl_enter", "kernels/paged_attention.py:_attend_block"} <= set(
        found
    ), sorted(found)
    assert compiled["kernels"] <= set(found), (compiled["kernels"], sorted(found))
    covered = compiled["kernels"] | _compiled_by_other_tests(found)
    todo = list(covered)
    while todo:  # and what they call
        for callee in found[todo.pop()] - covered:
            covered.add(callee)
            todo.append(callee)
    missing = sorted(set(found) - covered)
    assert not missing, (
        "no test compiles these @triton.jit functions for sm_90: "
        + ", ".join(missing)
        + "; add a case that calls each one's launch site to CASES in "
        "tests/helpers_triton_compile.py"
    )
