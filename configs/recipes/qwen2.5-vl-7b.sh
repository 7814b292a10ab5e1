#!/usr/bin/env bash
# Qwen2.5-VL-7B(-Instruct), full fine-tuning on images and text, one node of 8 GPUs, ZeRO-3.
#
#   bash configs/recipes/qwen2.5-vl-7b.sh /models/Qwen2.5-VL-7B-Instruct mm.jsonl runs/qwen-vl --image_folder imgs
#
# Sizes: as the 7B text recipe, plus the vision tower's activations: images up to 1280 x 784
# pixels (max_pixels 1003520 in data_vl.json: up to 1280 visual tokens, 5120 patches an image),
# and the worst case the preflight measures holds as many of the largest images as half the budget
# holds; max_tokens and max_patches auto. lr 1e-5 (a VL model's vision tower and merger train too).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?the model folder}; DATA=${2:?the training data}; OUT=${3:?the output folder}; shift 3
exec ${LAUNCHER:-deepspeed --num_gpus 8} launch/train.py \
    --model "$MODEL" --data "$DATA" --output_dir "$OUT" --data_config configs/recipes/data_vl.json \
    --deepspeed_config configs/recipes/ds_zero3.json --odb_config configs/recipes/odb.json --max_patches auto \
    --gradient_checkpointing --lr 1e-5 --warmup_ratio 0.03 --epochs 2 \
    --val_ratio 0.02 --eval_steps 200 --save_steps 500 --save_total_limit 2 --save_hf "$@"
