"""torchrun with its rendezvous store listening on the master address alone.

    python -m arealite.launcher.torchrun --rdzv_backend static --master_addr ADDR --master_port PORT \
        --nnodes 1 --node_rank 0 --nproc_per_node N SCRIPT ARGS...

takes torchrun's own arguments and runs torchrun (`torch.distributed.run`) in this process.
torchrun's store is a TCPStore, and a TCPStore server listens on every interface
whatever host it is given (``--standalone`` even adds a second one, on a random port).
With the static rendezvous there is one store, on ``--master_port``, which the workers
share (``MASTER_ADDR``/``MASTER_PORT``); node 0 starts it here first, bound to
``--master_addr`` (`arealite.utils.dist.bound_store`), and torch's rendezvous, asking
for a multi-tenant store on the same port in the same process, gets this one.
"""

from __future__ import annotations

import sys
from typing import Sequence

#: How long a client of the store waits for an answer (torch's rendezvous uses its own).
STORE_TIMEOUT_S = 900.0


def command(python: str, *, master_addr: str, master_port: int, nproc_per_node: int,
            nnodes: int = 1, node_rank: int | str = 0) -> list[str]:
    """The start of a command line that runs this module (the script and its arguments follow)."""
    return [python, "-m", __name__, "--rdzv_backend", "static", "--master_addr", master_addr,
            "--master_port", str(master_port), "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc_per_node)]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse torchrun's arguments, start node 0's store on the master address, run torchrun."""
    from torch.distributed import run as torchrun

    from arealite.utils.dist import bound_store

    argv = list(sys.argv[1:] if argv is None else argv)
    args = torchrun.parse_args(argv)
    if args.rdzv_backend != "static" or args.master_port is None:
        raise SystemExit("arealite.launcher.torchrun binds the static rendezvous store: give "
                         "--rdzv_backend static, --master_addr and --master_port")
    store = None
    if args.node_rank == 0:
        # Kept referenced until torchrun returns: torch shares a live server only.
        store = bound_store(args.master_addr, args.master_port, STORE_TIMEOUT_S, multi_tenant=True)
    try:
        torchrun.main(argv)
    finally:
        del store


if __name__ == "__main__":
    main()
