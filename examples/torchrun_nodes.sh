#!/bin/bash
# seqmem-train on N nodes with torchrun: run this on every node, NODE_RANK=0 on the first (docs/many_machines.md).
#   NODES=2 NODE_RANK=0 MASTER_ADDR=node0 PROCS=8 RUN_NAME=exp1 examples/torchrun_nodes.sh trainer.max_steps=2000
# RUN_NAME gives the job its folder, outputs/torchrun-<RUN_NAME>, the same on every node (without it rank zero's
# timestamp is handed to the others). A CPU rehearsal on one machine, two shells:
#   TRAINER=cpu NODES=2 NODE_RANK=0 PROCS=1 MASTER_ADDR=127.0.0.1 examples/torchrun_nodes.sh trainer.strategy=ddp
#   TRAINER=cpu NODES=2 NODE_RANK=1 PROCS=1 MASTER_ADDR=127.0.0.1 examples/torchrun_nodes.sh trainer.strategy=ddp
set -euo pipefail

: "${NODES:?how many nodes}" "${NODE_RANK:?the rank of this node, 0 to NODES-1}" "${MASTER_ADDR:?the first node}"
PROCS=${PROCS:-8}  # processes per node: one per GPU
RDZV=()
if [ -n "${RUN_NAME:-}" ]; then RDZV=(--rdzv-id "$RUN_NAME"); fi

# TORCHRUN: the launcher command (default torchrun; "python -m torch.distributed.run" is the same program)
exec ${TORCHRUN:-torchrun} \
    --nnodes "$NODES" --node_rank "$NODE_RANK" --nproc-per-node "$PROCS" \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" "${RDZV[@]}" \
    -m lightning_seqmem.apps.train \
    trainer="${TRAINER:-ddp}" trainer.num_nodes="$NODES" trainer.devices="$PROCS" "$@"
