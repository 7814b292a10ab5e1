#!/usr/bin/env bash
# A 70B model (Llama-3-70B, Qwen2.5-72B), full fine-tuning on 4 SLURM nodes of 8 GPUs, FSDP2.
#
#   bash configs/recipes/llama3-70b-fsdp2-slurm.sh /models/Meta-Llama-3-70B-Instruct /data/sft.jsonl runs/llama70b
#
# Sizes: FSDP2 shards the fp32 weights, gradients and AdamW state over the 32 GPUs (70B x 16 bytes
# / 32: about 35 GB each); bf16 compute; gradients reduce-scattered after every micro-batch
# (fsdp2_70b.json: 1/32 of the accumulated gradients per GPU instead of all of them); gradient
# checkpointing; the budget measured (max_tokens auto). lr 1e-5. More nodes: --nodes N (the run
# resumes on another number of GPUs). ZeRO-3 instead: --backend deepspeed --deepspeed_config
# configs/recipes/ds_zero3.json in place of the two FSDP2 flags.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?the model folder}; DATA=${2:?the training data}; OUT=${3:?the output folder}; shift 3
exec ${LAUNCHER:-sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 --cpus-per-task 12 --time 48:00:00 \
    --job-name odb-70b} launch/slurm.sbatch \
    --backend fsdp2 --fsdp_config configs/recipes/fsdp2_70b.json \
    --model "$MODEL" --data "$DATA" --output_dir "$OUT" --odb_config configs/recipes/odb.json \
    --gradient_checkpointing --lr 1e-5 --warmup_ratio 0.03 --epochs 2 \
    --val_ratio 0.02 --eval_steps 200 --save_steps 200 --save_total_limit 2 --save_hf "$@"
