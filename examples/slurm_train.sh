#!/bin/bash
# Multi-node launch of examples/train_llama.py with torchrun under SLURM.
#
#   sbatch --nodes 2 examples/slurm_train.sh --seq-len 262144 --dtype bf16 --checkpoint-activations
#   MAX_RESTARTS=3 sbatch --nodes 2 examples/slurm_train.sh --save-dir /shared/ckpt --save-every 100 --resume
#
# One torchrun per node (srun --ntasks-per-node 1); torchrun starts one process per GPU. The mesh
# puts ulysses inside a node (NVLink all-to-all) and ring across nodes: by default
# ulysses = GPUs per node and ring = number of nodes (override with --ulysses / --ring, which are
# passed through with every other argument of this script).
#
#SBATCH --job-name=hybrid-cp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_NNODES:-1}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-29500}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# NCCL: let it pick the fast fabric; uncomment to pin interfaces on clusters that need it.
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_IB_HCA=mlx5
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Restarts (docs/training.md "Checkpoints and restarts"): torchrun restarts the group up to MAX_RESTARTS
# times; with --save-dir DIR --resume the job continues from the newest complete checkpoint. A fresh
# rendezvous store per attempt keeps a restarted group from reading the dead group's keys.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

echo "hybrid-cp: ${NNODES} nodes x ${GPUS_PER_NODE} GPUs, rendezvous ${HEAD_NODE}:${PORT}"

srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    torchrun \
        --nnodes "${NNODES}" \
        --nproc_per_node "${GPUS_PER_NODE}" \
        --max-restarts "${MAX_RESTARTS:-${PET_MAX_RESTARTS:-0}}" \
        --rdzv_id "${SLURM_JOB_ID:-hybrid-cp}" \
        --rdzv_backend c10d \
        --rdzv_endpoint "${HEAD_NODE}:${PORT}" \
        "${REPO}/examples/train_llama.py" \
        --device cuda \
        --ulysses "${ULYSSES:-${GPUS_PER_NODE}}" \
        --ring "${RING:-${NNODES}}" \
        "$@"
