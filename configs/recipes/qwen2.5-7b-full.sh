#!/usr/bin/env bash
# Qwen2.5-7B(-Instruct), full fine-tuning, one node of 8 GPUs (80 GB class), DeepSpeed ZeRO-3.
#
#   bash configs/recipes/qwen2.5-7b-full.sh /models/Qwen2.5-7B-Instruct chats.jsonl runs/qwen7b [more flags]
#
# Sizes: ZeRO-3 holds 1/8 of the 7.6B weights, gradients and AdamW state per GPU (about 16 GB);
# the rest is activations, so the budget is measured, not guessed: max_tokens auto (odb.json here)
# takes the largest micro-batch whose worst-case step fits 0.9 of the smallest GPU, with gradient
# checkpointing. lr 2e-5 (full fine-tuning of a 7B model: 1e-5 to 2e-5), cosine to 10% after 3%
# warmup; a 2% validation split every 200 steps; a checkpoint every 500 steps, the newest two kept;
# a Hugging Face model in OUTPUT_DIR/hf at the end. overlap_comm overlaps ZeRO's reductions with
# the backward (ds_zero3.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?the model folder}; DATA=${2:?the training data}; OUT=${3:?the output folder}; shift 3
exec ${LAUNCHER:-deepspeed --num_gpus 8} launch/train.py \
    --model "$MODEL" --data "$DATA" --output_dir "$OUT" \
    --deepspeed_config configs/recipes/ds_zero3.json --odb_config configs/recipes/odb.json \
    --gradient_checkpointing --lr 2e-5 --warmup_ratio 0.03 --epochs 2 \
    --val_ratio 0.02 --eval_steps 200 --save_steps 500 --save_total_limit 2 --save_hf "$@"
