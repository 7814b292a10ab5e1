#!/usr/bin/env bash
# Llama-3-8B(-Instruct), LoRA, one node of 8 GPUs (or fewer: --num_gpus), DeepSpeed ZeRO-2.
#
#   bash configs/recipes/llama3-8b-lora.sh /models/Meta-Llama-3-8B-Instruct chats.jsonl runs/llama8b-lora
#
# Sizes: the frozen bf16 base (16 GB) sits whole on every GPU and LoRA's adapters (r 16 on every
# projection, lora.json here: about 42M parameters) are all that train, so ZeRO-2 partitions
# little and costs little; the budget is measured (max_tokens auto, with gradient checkpointing).
# lr 2e-4 (LoRA adapters start at zero: 1e-4 to 2e-4); a 2% validation split; the export merges
# the adapters into the base (add --save_adapter_only for the adapter alone).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?the model folder}; DATA=${2:?the training data}; OUT=${3:?the output folder}; shift 3
exec ${LAUNCHER:-deepspeed --num_gpus 8} launch/train.py \
    --model "$MODEL" --data "$DATA" --output_dir "$OUT" \
    --deepspeed_config configs/recipes/ds_zero2.json --odb_config configs/recipes/odb.json \
    --lora configs/recipes/lora.json --gradient_checkpointing --lr 2e-4 --warmup_ratio 0.03 --epochs 2 \
    --val_ratio 0.02 --eval_steps 200 --save_steps 500 --save_total_limit 2 --save_hf "$@"
