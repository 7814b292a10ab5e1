#!/usr/bin/env bash
# The GPU check: odb's CUDA path, run once on a GPU machine (one H200: a few minutes). Its first
# seconds (before any wheel is installed: torch alone) name the attention path odb takes there, with
# torch's varlen_attn signature, after one checked packed call; a path that cannot run stops the
# check with the fix. The last line of stdout is one JSON summary:
#   attention  odb's CUDA varlen attention (torch varlen_attn called by its installed signature, or
#              flash-attn when importable; softcap and sinks per group) on packed rows against each
#              sample alone: logits, gradients, leaks, the paths taken (bf16)
#   train      a ~0.5B random-init Qwen2-style model, deepspeed --num_gpus 1 launch/train.py at
#              ZeRO-2 in bf16, on chats with the shared sharegpt4o_like length profile: odb (packed)
#              against fixed batches of 8 (padded), the same samples: samples/s, real tokens/s,
#              padding, peak GPU memory, MFU (6 x params x tokens/s over the GPU's bf16 peak); and odb
#              under FSDP2 (torchrun --nproc_per_node 1 ... --backend fsdp2, bf16 mixed precision); each
#              run's preflight (the worst-case step's peak memory and time), and a run with
#              max_tokens auto (the budget the preflight's search chose, its trials)
#   loss       the chunked loss's peak memory against full logits at the model's vocabulary
#
#   bash tools/check/gpu_check.sh --prepare   # here, where the package registries answer: the wheels the
#                                       # GPU machine lacks and the trace-shaped data, in runs/gpu_check/
#   bash tools/check/gpu_check.sh             # there (nothing downloaded): installs the carried wheels, checks
#   bash tools/check/gpu_check.sh --dry-run   # on CPU: the same steps, a tiny model and little data
#
# On the device tool: run(command="bash tools/check/gpu_check.sh", carry=["runs/gpu_check"], timeout_s=600).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-run}
PY=${PYTHON:-python3}
WORK=runs/gpu_check
TRACE=${TRACE:-../shared/traces/sharegpt4o_like.txt}
export PYTHONUNBUFFERED=1

prepare() {
    mkdir -p "$WORK/wheels"
    $PY tools/make/make_trace_data.py --trace "$TRACE" --samples 1000 --max_tokens 8192 --out "$WORK/data.jsonl"
    # the GPU machine's image has torch, peft, accelerate, ninja, psutil, py-cpuinfo, msgpack; not these
    # (its python is 3.12; transformers pinned to the version odb is tested with)
    $PY -m pip download -q -d "$WORK/wheels" --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        transformers==5.24.0 hjson pydantic pydantic-core annotated-types typing-inspection nvidia-ml-py
    $PY -m pip download -q -d "$WORK/wheels" --no-deps --no-binary=:all: --no-build-isolation deepspeed==0.19.8
    ls "$WORK/wheels"
}

if [ "$MODE" = "--prepare" ]; then prepare; exit 0; fi

# the attention path, first: torch alone, no wheel installed yet (odb.training.attention.varlen imports only torch)
$PY - <<'EOF'
import inspect

import torch

from odb.training.attention import attention_path
from odb.training.attention.kernels import torch_varlen_api

api = torch_varlen_api()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"odb: torch {torch.__version__}, varlen_attn{inspect.signature(api.function) if api else ': none'}")
print(f"odb: attention path on {device} in bf16: {attention_path(device, torch.bfloat16)}", flush=True)
EOF

if [ "$MODE" = "--dry-run" ]; then
    WORK=runs/gpu_check_dry
    mkdir -p "$WORK"
    MODEL=configs/tiny_model.json
    head -n 64 data/chat.jsonl > "$WORK/data.jsonl"
    MAX_TOKENS=2048 SAMPLES=64 LOSS_ARGS="--vocab 32000 --hidden 256 --tokens 2048"
else
    [ -d "$WORK/wheels" ] || { echo "no $WORK/wheels: run 'bash tools/check/gpu_check.sh --prepare' first, then carry $WORK"; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-build-isolation "$WORK"/wheels/*
    MODEL=$WORK/qwen2_0_5b.json
    # Qwen2-0.5B's shape, random init: 494M parameters
    cat > "$MODEL" <<'JSON'
{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
 "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "pad_token_id": 0,
 "bos_token_id": 1, "eos_token_id": 1}
JSON
    MAX_TOKENS=8192 SAMPLES=1000 LOSS_ARGS="--vocab 151936 --hidden 896 --tokens 16384"
fi

$PY tools/check/gpu_check_attention.py | tail -n 1 > "$WORK/attention.json"

train() {  # run name, extra odb settings, then the launcher with launch/train.py and the backend's flags
    local name=$1 settings=$2
    shift 2
    $PY - "$WORK/$name.json" "$MAX_TOKENS" "$settings" <<'EOF'
import json, sys
config = json.load(open("configs/odb.json"))
config.update({"max_tokens": int(sys.argv[2]), **json.loads(sys.argv[3])})  # (a run's own settings win)
json.dump(config, open(sys.argv[1], "w"))
EOF
    "$@" --model "$MODEL" --data "$WORK/data.jsonl" --odb_config "$WORK/$name.json" --max_samples "$SAMPLES" \
        --lr 1e-4 --gradient_checkpointing --num_workers 4 --no_final_checkpoint --output_dir "$WORK/$name" \
        --overwrite_output_dir \
        > "$WORK/$name.log" 2>&1 || { tail -n 40 "$WORK/$name.log"; exit 1; }
}
DEEPSPEED=(deepspeed --num_gpus 1 launch/train.py --deepspeed_config configs/ds_zero2.json)
train odb '{"policy": "odb"}' "${DEEPSPEED[@]}"
train fixed '{"policy": "fixed", "batch_size": 8, "sharding": "static"}' "${DEEPSPEED[@]}"
train odb_fsdp2 '{"policy": "odb"}' torchrun --nproc_per_node 1 launch/train.py --backend fsdp2
# max_tokens auto: the preflight's search for the largest budget whose worst-case step fits 0.9 of the GPU
train odb_auto '{"policy": "odb", "max_tokens": "auto"}' "${DEEPSPEED[@]}" --max_steps 5

$PY tools/bench/bench_memory.py $LOSS_ARGS --json | tail -n 1 > "$WORK/loss.json"

$PY - "$WORK" "$MODEL" <<'EOF'
import json, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

work, model = Path(sys.argv[1]), sys.argv[2]
with torch.device("meta"):
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**json.load(open(model)))).parameters())
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
# dense bf16 peak by the vendor's datasheet (H100 / H200 SXM); None where unknown
peak = 989e12 if any(name in gpu for name in ("H100", "H200")) else None
train = {}
for policy in ("odb", "fixed", "odb_fsdp2", "odb_auto"):
    s = json.load(open(work / policy / "summary.json"))
    train[policy] = {k: s[k] for k in ("samples_emitted", "steps", "micro_batches", "samples_per_s", "tokens_per_s",
                                       "padding_ratio", "truncated_samples", "loss_first", "loss_last")}
    train[policy]["peak_memory_mb"] = s["this_process"]["peak_memory_mb"]
    train[policy]["preflight"] = s.get("preflight")
    train[policy]["cost_model"] = s.get("cost_model")  # (the fitted coefficients on the GPU's own forward times)
    train[policy]["mfu"] = round(6 * params * s["tokens_per_s"] / peak, 4) if peak else None
train["odb_vs_fixed_tokens_per_s"] = round(train["odb"]["tokens_per_s"] / max(1e-9, train["fixed"]["tokens_per_s"]), 3)
versions = {name: __import__(name).__version__ for name in ("torch", "transformers", "deepspeed")}
print(json.dumps({"gpu": gpu, "params": params, "versions": versions,
                  "attention": json.load(open(work / "attention.json")), "train": train,
                  "loss": json.load(open(work / "loss.json"))}))
EOF
