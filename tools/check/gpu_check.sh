#!/usr/bin/env bash
# The GPU check: odb's CUDA path on one GPU, in under 8 minutes of wall time (one H100/H200). Its first
# seconds (before any wheel is installed: torch alone) name the attention path odb takes there, with
# torch's varlen_attn signature, after one checked packed call; a path that cannot run stops the
# check with the fix. Then, each phase under its own time limit and the whole under a deadline
# (DEADLINE_S, default 470 s: a phase that could end past it, its kill's grace counted, is skipped, and
# says so), in order:
#   attention  odb's CUDA varlen attention on packed rows against each sample alone, in bf16, through
#              each installed kernel in turn (flash-attn / FlashAttention-3 where installed, torch's
#              varlen_attn): logits, gradients, leaks, the paths taken; five families incl. MLA
#   odb        a ~1.2B random-init Llama-3.2-1B-shaped model, deepspeed --num_gpus 1 launch/train.py at
#              ZeRO-2 in bf16 with gradient checkpointing, on chats with the shared sharegpt4o_like
#              length profile, packed by odb: samples/s, real tokens/s, MFU (6 x params x tokens/s over
#              the GPU's bf16 peak; and odb's own per-step mfu), the measured sync efficiency (one rank:
#              1 by definition), peak GPU memory, the preflight (the worst-case step's peak memory and
#              time) and the cost model fitted on the GPU's own forward times
#   auto       the same with max_tokens auto: the budget the preflight's search chose, its trials
#   fixed      the same samples in fixed batches of 8 (padded): the baseline's figures
#   fsdp2      odb under FSDP2 (torchrun --nproc_per_node 1 ... --backend fsdp2, bf16 mixed precision)
#   loss       the chunked loss's peak memory against full logits at the model's vocabulary
# The last line of stdout is one JSON object with everything (also written to runs/gpu_check/result.json):
# each phase's exit status and seconds, and the figures of those that ran. It survives what the GPU
# image may lack: flash-attn (torch's varlen_attn then), a torch without enable_gqa (2.11: K/V heads
# expanded) or without varlen_attn (per-group SDPA, named), a phase that fails (its log's tail in the JSON).
#
#   bash tools/check/gpu_check.sh --prepare   # here, where the package registries answer: the wheels the
#                                             # GPU machine lacks and the trace-shaped data, in runs/gpu_check/
#   bash tools/check/gpu_check.sh             # there (nothing downloaded): installs the carried wheels, checks
#   bash tools/check/gpu_check.sh --dry-run   # on CPU: the same phases, a tiny model and little data
#
# On the device tool: run(command="bash tools/check/gpu_check.sh", carry=["runs/gpu_check"], timeout_s=600).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-run}
PY=${PYTHON:-python3}
WORK=$PWD/runs/gpu_check
TRACE=${TRACE:-../shared/traces/sharegpt4o_like.txt}
BEGAN=$(date +%s)
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}

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

# the attention path, first: torch alone, no wheel installed yet (odb.training.attention imports only torch)
$PY - <<'EOF_PY' || exit 1
import inspect

import torch

from odb.training.attention import attention_path
from odb.training.attention.kernels import torch_varlen_api

api = torch_varlen_api()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"odb: torch {torch.__version__}, varlen_attn{inspect.signature(api.function) if api else ': none'}")
print(f"odb: attention path on {device} in bf16: {attention_path(device, torch.bfloat16)}", flush=True)
EOF_PY

if [ "$MODE" = "--dry-run" ]; then
    WORK=$PWD/runs/gpu_check_dry
    mkdir -p "$WORK"
    MODEL=configs/tiny_model.json
    head -n 64 data/chat.jsonl > "$WORK/data.jsonl"
    MAX_TOKENS=2048 SAMPLES=64 LOSS_ARGS="--vocab 32000 --hidden 256 --tokens 2048" DEADLINE_S=${DEADLINE_S:-3000}
    SCALE=4  # phase limits x4: the CPU is slow
else
    [ -d "$WORK/wheels" ] || { echo "no $WORK/wheels: run 'bash tools/check/gpu_check.sh --prepare' first, then carry $WORK"; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-build-isolation "$WORK"/wheels/* || exit 1
    MODEL=$WORK/llama_1b.json
    # Llama-3.2-1B's shape, random init: 1.24B parameters
    cat > "$MODEL" <<'JSON'
{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
 "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
JSON
    MAX_TOKENS=8192 SAMPLES=${SAMPLES:-600} LOSS_ARGS="--vocab 128256 --hidden 2048 --tokens 16384" DEADLINE_S=${DEADLINE_S:-470}
    SCALE=1
fi
mkdir -p "$WORK/phases"
# nothing of an earlier check may pass for this one's (the wheels and the data stay)
rm -rf "$WORK"/phases/* "$WORK"/{odb,auto,fixed,fsdp2} "$WORK"/*.log "$WORK/result.json"

phase() {  # name, limit in seconds, then the command; its output in $WORK/<name>.log, its status in phases/
    local name=$1 limit=$(( $2 * SCALE )) now
    shift 2
    now=$(( $(date +%s) - BEGAN ))
    if [ $(( now + limit + 45 )) -gt "$DEADLINE_S" ]; then  # (its limit and the kill's 45 s grace)
        echo "odb: gpu_check: $name skipped (at ${now} s, its ${limit} s + 45 s would pass the ${DEADLINE_S} s deadline)"
        echo "{\"rc\": null, \"skipped\": \"deadline\", \"at_s\": $now}" > "$WORK/phases/$name.json"
        return
    fi
    echo "odb: gpu_check: $name (limit ${limit} s, at ${now} s)"
    local began rc
    began=$(date +%s)
    # SIGTERM at the limit (odb stops within two steps), SIGKILL 45 s later (torchrun's agent waits 30 s)
    timeout --kill-after=45 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    local timed_out=false
    if [ $rc = 124 ] || { [ $rc = 137 ] && [ $(( $(date +%s) - began )) -ge "$limit" ]; }; then  # (137 early: a crash)
        timed_out=true
        pkill -KILL -f -- "--output_dir $WORK/$name( |$)" || true  # a rank left behind (WORK is absolute: no other checkout)
    fi
    echo "{\"rc\": $rc, \"seconds\": $(( $(date +%s) - began )), \"timed_out\": $timed_out}" > "$WORK/phases/$name.json"
    [ $rc = 0 ] || { echo "odb: gpu_check: $name failed (rc $rc):"; tail -n 20 "$WORK/$name.log"; }
}

config() {  # run name, extra odb settings: configs/odb.json with max_tokens and those
    $PY - "$WORK/$1.json" "$MAX_TOKENS" "$2" <<'EOF_PY'
import json, sys
config = json.load(open("configs/odb.json"))
config.update({"max_tokens": int(sys.argv[2]), **json.loads(sys.argv[3])})  # (a run's own settings win)
json.dump(config, open(sys.argv[1], "w"))
EOF_PY
}

RUN_ARGS=(--model "$MODEL" --data "$WORK/data.jsonl" --max_samples "$SAMPLES" --lr 1e-4 --gradient_checkpointing
          --num_workers 4 --no_final_checkpoint --overwrite_output_dir)
DEEPSPEED=(deepspeed --num_gpus 1 launch/train.py --deepspeed_config configs/ds_zero2.json)
config odb '{"policy": "odb"}'
config auto '{"policy": "odb", "max_tokens": "auto"}'
config fixed '{"policy": "fixed", "batch_size": 8, "sharding": "static"}'

phase attention 120 $PY tools/check/gpu_check_attention.py
phase odb 120 "${DEEPSPEED[@]}" "${RUN_ARGS[@]}" --odb_config "$WORK/odb.json" --output_dir "$WORK/odb"
# max_tokens auto: the preflight's search for the largest budget whose worst-case step fits 0.9 of the GPU
phase auto 120 "${DEEPSPEED[@]}" "${RUN_ARGS[@]}" --odb_config "$WORK/auto.json" --output_dir "$WORK/auto" --max_steps 5
phase fixed 120 "${DEEPSPEED[@]}" "${RUN_ARGS[@]}" --odb_config "$WORK/fixed.json" --output_dir "$WORK/fixed"
phase fsdp2 90 torchrun --nproc_per_node 1 launch/train.py --backend fsdp2 "${RUN_ARGS[@]}" \
    --odb_config "$WORK/odb.json" --output_dir "$WORK/fsdp2"
phase loss 45 $PY tools/bench/bench_memory.py $LOSS_ARGS --json

$PY - "$WORK" "$MODEL" "$(( $(date +%s) - BEGAN ))" <<'EOF_PY'
import json, sys
from pathlib import Path

import torch

work, model, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])


def last_json(log: Path):
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
    return json.loads(lines[-1]) if lines else None


phases = {p.stem: json.loads(p.read_text()) for p in sorted((work / "phases").glob("*.json"))}
for name, status in phases.items():
    if status.get("rc") not in (0, None):
        status["log_tail"] = (work / f"{name}.log").read_text().splitlines()[-15:]
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
# dense bf16 peak by the vendor's datasheet (H100 / H200 SXM); None where unknown
peak = 989e12 if any(name in gpu for name in ("H100", "H200")) else None
params = None
try:
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**json.load(open(model)))).parameters())
except Exception as error:  # (transformers not installed: the wheels' phase failed)
    print(f"odb: gpu_check: no parameter count ({error})", file=sys.stderr)
train = {}
for run in ("odb", "auto", "fixed", "fsdp2"):
    path = work / run / "summary.json"
    if not path.exists():
        continue
    s = json.loads(path.read_text())
    rows = [json.loads(line) for line in (work / run / "metrics.jsonl").read_text().splitlines()
            if line.startswith("{")] if (work / run / "metrics.jsonl").exists() else []
    step_mfu = [r["mfu"] for r in rows if "mfu" in r]
    train[run] = {k: s.get(k) for k in ("samples_emitted", "steps", "micro_batches", "samples_per_s", "tokens_per_s",
                                        "padding_ratio", "truncated_samples", "loss_first", "loss_last",
                                        "preflight", "cost_model")}
    this = s.get("this_process", {})
    train[run].update(peak_memory_mb=this.get("peak_memory_mb"), sync_efficiency=this.get("sync_efficiency"),
                      planned_sync_efficiency=this.get("planned_sync_efficiency"),
                      mfu=round(6 * params * s["tokens_per_s"] / peak, 4) if peak and params else None,
                      odb_step_mfu_mean=round(sum(step_mfu) / len(step_mfu), 4) if step_mfu else None)
if "odb" in train and "fixed" in train:
    train["odb_vs_fixed_tokens_per_s"] = round(train["odb"]["tokens_per_s"] / max(1e-9, train["fixed"]["tokens_per_s"]), 3)
versions = {}
for name in ("torch", "transformers", "deepspeed", "flash_attn", "flash_attn_interface"):
    try:
        versions[name] = getattr(__import__(name), "__version__", "?")
    except Exception:
        versions[name] = None
result = {"gpu": gpu, "params": params, "versions": versions, "cuda": torch.version.cuda, "wall_s": wall,
          "phases": phases, "attention": last_json(work / "attention.log"), "train": train,
          "loss": last_json(work / "loss.log")}
(work / "result.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
EOF_PY
