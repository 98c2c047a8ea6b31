"""One rank of a torchrun job: `torchrun ... -m speculant.launch.torchrun generate|accept-rate ...`.

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; each process runs the `speculant` command as one rank, the same
per-rank worker as `speculant generate --tp/--dp` (launch/spawn.py) and the Ray actors
(launch/ray.py). Global rank 0 reads the prompts (and an accept-rate baseline) and writes the
outputs; the other ranks get the prompts from it (executor/dp.py), so only rank 0's node needs
the input files, and a stream (a pipe on stdin, a FIFO) is read once. torchrun passes its ranks
stdin but none of the shell's other descriptors: rank 0 reopens a `--prompts <(...)`
(/dev/fd/N) through its agent's descriptor N (paths.adopt_parent_descriptor). `--tp` x `--dp`
must equal WORLD_SIZE (= nnodes x nproc-per-node).

One node:

    torchrun --standalone --nproc-per-node 4 -m speculant.launch.torchrun generate \\
        --target DIR --tp 2 --dp 2 --prompts prompts.jsonl --output out.jsonl

Several nodes (run on each node; HOST is one of them, reachable from all):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m speculant.launch.torchrun generate --tp 8 --dp 2 ...

How ranks map to nodes and GPUs: torchrun numbers ranks node by node (global rank = node's
group rank x nproc-per-node + LOCAL_RANK; with the c10d rendezvous the group rank is the order
in which nodes joined, not necessarily --node-rank), and each rank uses cuda:LOCAL_RANK. The
(dp, tp) mesh has TP innermost (global rank = dp_rank x tp + tp_rank, comm/groups.py), so when
nproc-per-node is a multiple of tp every TP group sits on one node and its all-reduces stay on
NVLink; only the DP groups cross nodes (they exchange a few ints per step, and rank 0 sends the
prompts and gathers the outputs over them). Rank 0 warns when a TP group would span nodes.

Exit: every rank flushes and GPU ranks end with `os._exit` (destroying NCCL groups after graph
capture has hung); a rank that fails prints one line naming itself, and torchrun stops the
others and names the failed rank in its summary. Collectives time out after --dist-timeout. A
rank whose collective failed asks the others through the job's store which of them failed on
their own or do not answer, and names them with their node (`rank 1 (torchrun node 1) stopped
answering`): a node whose agent was killed is named by the nodes that remain. Each rank ends
with its agent (spawn.end_with_parent): an agent killed by SIGKILL leaves no rank running, and
SIGTERM, which torchrun forwards, stops a rank as Ctrl-C does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from speculant.errors import SpeculantError
from speculant.launch.cli import hold_for_local_rank0
from speculant.launch.paths import adopt_parent_descriptor
from speculant.launch.spawn import INPUT_FLAGS, cli_rank_main, end_with_parent, tell_torchrun

USAGE = (
    "torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] "
    "-m speculant.launch.torchrun generate|accept-rate ..."
)


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on the first process of each node (not once per rank), then exit."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"speculant: error: {message}", file=sys.stderr, flush=True)
        tell_torchrun(message)  # (read by the agent when this rank's exit is the first)
    hold_for_local_rank0()  # the other local ranks: let local rank 0 print first
    sys.exit(code)


def check_torchrun_world(tp: int, dp: int, device: str) -> None:
    """The job torchrun started must be the one --tp/--dp describe, one GPU per local rank."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if missing:
        _fail(f"{missing[0]} is not set: start this module under torchrun ({USAGE})")
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world != tp * dp:
        _fail(
            f"torchrun started WORLD_SIZE={world} processes but --tp {tp} x --dp {dp} = "
            f"{tp * dp}; make --nnodes x --nproc-per-node equal tp x dp, or change --tp/--dp"
        )
    if device.startswith("cuda"):
        import torch

        visible = torch.cuda.device_count()
        if int(os.environ["LOCAL_RANK"]) >= visible:
            _fail(
                f"torchrun started {local_world} processes on this node but {visible} GPUs are "
                "visible; lower --nproc-per-node to the GPU count"
            )
    if world > local_world and local_world % tp and os.environ["RANK"] == "0":
        print(
            f"speculant: warning: nproc-per-node {local_world} is not a multiple of tp {tp}: "
            "some TP groups span nodes and their all-reduces cross the network",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run `speculant ARGV` as the rank torchrun's environment names, then exit."""
    from speculant.launch.cli import build_parser

    end_with_parent()  # torchrun's agent is the parent: a killed agent takes this rank with it
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)  # a bad flag: one line, exit 2
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_torchrun_world(args.tp, args.dp, device)
    if os.environ["RANK"] == "0":  # the one rank that reads the inputs
        for flag in INPUT_FLAGS:
            try:
                adopt_parent_descriptor(getattr(args, flag[2:], None), flag)
            except SpeculantError as exc:
                _fail(str(exc))
    os.environ["SPECULANT_RANK_DEVICE"] = device  # how cli_rank_main ends the process
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared/GPU.md)
    if os.environ["RANK"] != "0":
        # torchrun gives every rank the job's stdout, where rank 0 prints the completions: what
        # another rank (a library, NCCL_DEBUG) prints there goes to its stderr instead
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        if not args.debug:  # rank 0 logs for the job
            logging.basicConfig(level=logging.WARNING, format="speculant: %(message)s")
    cli_rank_main(argv)


if __name__ == "__main__":
    main()
