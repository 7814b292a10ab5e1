"""``check-model``: odb's packed training against the model's own code, on the user's model and data.

Before a long run on a model family no test here names, a user wants to know that odb trains it
as the model itself would. This check runs odb's own path (:class:`OdbEngine`: collation, rotary
positions, the blank image of a VL model, odb_varlen, the chunked loss, the router loss of an MoE
model) on one process and compares it with the model run one sample at a time through its own
attention (``eager`` or ``sdpa``) and its own loss (``model(labels=..., output_router_logits=True)``):

* **logits**: the first ``N`` samples packed into micro-batches of at most ``max_tokens`` tokens;
  each sample's logits in the packed row against the sample alone (max absolute difference);
* **loss and gradients**: each of the first few samples as a step of its own (one sample per
  micro-batch, where odb's trained objective is exactly the model's own loss, router loss
  included), then the same samples packed in one micro-batch (the token loss, against the model's
  own losses weighted by label tokens): relative differences of the loss and of every gradient
  (largest entry difference over the reference gradient's largest entry);
* **labels**: the label runs of the first sample, decoded (what the run would train on);
* **image processor** (VL models): odb's ``pixel_values`` against the folder's own processor on
  the same images, with the same pixel bounds;
* **video processor** (models that take videos, where torchvision is installed: transformers'
  video processors need it): odb's ``pixel_values_videos`` and grids against the folder's own
  ``AutoVideoProcessor`` on the same frames, with the same settings.

The model runs in eval mode (dropout off, so both sides are deterministic), in ``dtype`` on
``device``. A model odb refuses (:func:`odb.training.model.capability.packing_refusal`, or an attention
argument odb_varlen does not implement) is reported as ``refused`` with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.data.labels import label_runs
from odb.data.processing import DataConfig, SampleDataset
from odb.training.backends import LocalBackend
from odb.training.check_media import image_processor_diff, video_processor_diff
from odb.training.model.build import build_model, load_tokenizer, vision_spec
from odb.training.model.capability import packing_refusal, skeleton
from odb.training.model.mrope import mm_token_types, supports_packing
from odb.training.step.engine import BLANK_IMAGE_TOKENS, OdbEngine

__all__ = ["ModelReport", "Tolerances", "check_model"]


@dataclass(frozen=True)
class Tolerances:
    """What counts as equal: max absolute logit difference, relative loss and gradient differences."""

    logits: float
    loss: float
    grad: float


DEFAULT_TOLERANCES = {torch.float32: Tolerances(logits=1e-3, loss=1e-4, grad=1e-3),
                      torch.bfloat16: Tolerances(logits=0.25, loss=2e-2, grad=0.1)}


@dataclass
class ModelReport:
    """What :func:`check_model` found; ``ok`` when nothing is off and odb does not refuse the model."""

    model_type: str
    ok: bool = False
    refused: str | None = None
    max_logit_diff: float | None = None
    loss_rel_diff: float | None = None
    grad_rel_diff: float | None = None
    aux_loss_included: bool | None = None
    """Whether the model has a router loss and odb's trained loss included it (None: a dense model)."""
    packing: str = "packed"
    """'packed' (varlen rows), or 'padded' where odb does not know the model's rotary positions."""
    samples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    label_preview: list[str] = field(default_factory=list)
    image_processor_max_diff: float | None = None
    video_processor_max_diff: float | None = None
    tolerances: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was not checked, and why (not a fault)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_model(path: str | Path, *, data: str | Path, num_samples: int = 8, max_tokens: int = 4096,
                data_config: DataConfig | None = None, tokenizer: str | Path | None = None,
                reference: str = "eager", device: str | torch.device | None = None,
                dtype: torch.dtype = torch.float32, loss_samples: int = 3,
                tolerances: Tolerances | None = None) -> ModelReport:
    """Runs the check (the module docstring says what it compares).

    Args:
        path: a Hugging Face model folder (or a model config JSON: random weights).
        data: the records to check on (any format odb reads); the first ``num_samples`` are used.
        num_samples: samples packed for the logits comparison.
        max_tokens: a micro-batch's token budget, as in the run.
        data_config: how records become samples (default: :class:`DataConfig`'s).
        tokenizer: a tokenizer folder (default: the model folder).
        reference: the model's own attention to compare with: 'eager' or 'sdpa'.
        device: default CUDA when available, else the CPU.
        dtype: the model's precision (fp32 compares tightly; bf16 runs the GPU kernels).
        loss_samples: samples whose loss and gradients are compared (one step each).
        tolerances: default :data:`DEFAULT_TOLERANCES` for ``dtype``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tolerances = tolerances or DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.bfloat16])
    data_config = data_config or DataConfig()
    shell = skeleton(path)
    report = ModelReport(model_type=str(getattr(shell.config, "model_type", type(shell).__name__)),
                         tolerances=dataclasses.asdict(tolerances))
    report.refused = packing_refusal(shell)
    if report.refused is not None:
        return report
    del shell
    tok = load_tokenizer(tokenizer or path)
    model = build_model(path, seed=0, vocab_size=len(tok), dtype=dtype).to(device).eval()
    packed = supports_packing(model)
    report.packing = "packed" if packed else "padded"
    vision = vision_spec(model, data_config, path)
    room = BLANK_IMAGE_TOKENS if vision is not None else 0
    dataset = SampleDataset(data, tok, data_config, truncate_to=max_tokens - room, vision=vision,
                            max_samples=num_samples)
    samples = _samples(dataset, report)
    if samples:
        backend = LocalBackend(model, device)
        try:
            report.max_logit_diff = _logit_diff(model, backend, samples, max_tokens=max_tokens, packed=packed,
                                                pad_token_id=tok.pad_token_id, reference=reference)
            _loss_and_grads(model, backend, samples[:loss_samples], report, max_tokens=max_tokens, packed=packed,
                            pad_token_id=tok.pad_token_id, reference=reference)
        except ValueError as err:  # odb_varlen refuses an argument this model passes, or the loss refuses it
            report.refused = str(err)
            return report
        report.label_preview = _label_runs(tok, samples[0])
    if vision is not None:
        report.image_processor_max_diff = image_processor_diff(path, vision, report)
    if vision is not None and vision.video is not None:
        report.video_processor_max_diff = video_processor_diff(path, vision.video, report)
    _judge(report, tolerances)
    return report


def _samples(dataset: SampleDataset, report: ModelReport) -> list[dict[str, Any]]:
    samples = []
    for uid in range(len(dataset)):
        sample = dataset[uid]
        if "skip" in sample:
            report.skipped[sample["skip"]] = report.skipped.get(sample["skip"], 0) + 1
            continue
        samples.append(sample)
    report.samples = len(samples)
    if not samples:
        report.problems.append(f"every one of the {len(dataset)} records was skipped ({report.skipped}): nothing "
                               "to compare; check --data and the data config")
    return samples


def _cost(uid: int, sample: dict[str, Any]) -> SampleCost:
    tokens = len(sample["input_ids"])
    return SampleCost(uid=uid, tokens=tokens, label_tokens=count_label_tokens(sample["labels"].tolist()),
                      patches=int(sample.get("patches", 0)), cost=tokens)


def _plan(micro: list[tuple[SampleCost, ...]]) -> StepPlan:
    batches = tuple(MicroBatch(costs) for costs in micro)
    return StepPlan(epoch=0, step=0, micro_batches=batches, num_label_tokens=sum(b.label_tokens for b in batches),
                    num_samples=sum(len(b.samples) for b in batches),
                    rank_costs=tuple((b.tokens,) for b in batches), rank_tokens=tuple((b.tokens,) for b in batches))


def _packs(samples: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """Sample indices packed in order, each pack within ``max_tokens`` tokens."""
    packs: list[list[int]] = [[]]
    used = 0
    for i, sample in enumerate(samples):
        n = len(sample["input_ids"])
        if packs[-1] and used + n > max_tokens:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    return packs


def _alone(model, sample: dict[str, Any], device: torch.device, **extra: Any):
    """The model's own call on one sample: the plain transformers way."""
    ids = torch.as_tensor(sample["input_ids"], device=device)[None]
    kwargs: dict[str, Any] = {}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if sample.get(pixels) is not None:
            kwargs.update({pixels: sample[pixels].to(device, model.dtype), grid: sample[grid].to(device)})
    if sample.get("second_per_grid_ts") is not None:
        kwargs["second_per_grid_ts"] = sample["second_per_grid_ts"].to(device)
    if getattr(model.config, "vision_config", None) is not None:  # M-RoPE from the image and video tokens
        kwargs["mm_token_type_ids"] = mm_token_types(ids, model.config)
    return model(input_ids=ids, use_cache=False, **kwargs, **extra)


def _with_attention(model, implementation: str):
    model.set_attn_implementation(implementation)
    return model


@torch.no_grad()
def _logit_diff(model, backend: LocalBackend, samples, *, max_tokens: int, packed: bool, pad_token_id: int,
                reference: str) -> float:
    """Max |odb's packed logits - each sample alone| over every real token."""
    from odb.training.attention.varlen import ATTN_IMPLEMENTATION

    engine = OdbEngine(backend, world_size=1, max_tokens=max_tokens, pad_token_id=pad_token_id, packed=packed,
                       loss_chunk_tokens=None)
    got: list[torch.Tensor] = []
    for pack in _packs(samples, max_tokens - (BLANK_IMAGE_TOKENS if engine.vision is not None else 0)):
        plan = _plan([tuple(_cost(i, samples[i]) for i in pack)])
        engine.eval_step(plan, [[samples[i] for i in pack]])  # one model call: the pack's micro-batch
        batch, logits = backend.last_batch, backend.last.logits.float()
        if "cu_seq_lens_q" in batch:
            bounds = batch["cu_seq_lens_q"].tolist()
            got += [logits[0, a:b] for a, b in zip(bounds, bounds[1:])][:len(pack)]
        else:  # padded rows, one sample each
            got += [logits[row, :len(samples[i]["input_ids"])] for row, i in enumerate(pack)]
    _with_attention(model, reference)
    try:
        worst = 0.0
        for sample, mine in zip(samples, got):
            theirs = _alone(model, sample, backend.device).logits[0].float()
            worst = max(worst, float((mine - theirs).abs().max()))
    finally:
        _with_attention(model, ATTN_IMPLEMENTATION)
    return worst


def _loss_and_grads(model, backend: LocalBackend, samples, report: ModelReport, *, max_tokens: int, packed: bool,
                    pad_token_id: int, reference: str) -> None:
    """odb's trained objective and gradients against the model's own ``loss`` and its gradients:

    * each sample as a step of its own (its own loss: CE mean, plus ``coef * aux`` where the model has
      a router loss, which is what odb trains with one sample per micro-batch);
    * the samples packed in one micro-batch, one step: odb's token loss ``sum CE / N`` against the sum
      of the model's own CE losses weighted by label tokens (the router loss, a product of means and
      not a sum over samples, is left out of this step on both sides).
    """
    engine = OdbEngine(backend, world_size=1, max_tokens=max_tokens, pad_token_id=pad_token_id, packed=packed)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    is_moe = _has_router_loss(model)
    worst_loss = worst_grad = 0.0
    included = True
    for i, sample in enumerate(samples):
        model.zero_grad(set_to_none=True)
        result = engine.train_step(_plan([(_cost(i, sample),)]), [[sample]], lr=0.0)
        # odb's trained objective of this step: sum CE / N + coef * aux (StepResult.aux_loss; 0 if dense)
        mine_loss = result.loss_sum / max(1, count_label_tokens(sample["labels"].tolist())) + result.aux_loss
        included &= result.aux_sum is not None
        mine_grads = _grads(params)
        their_loss = _own_loss_backward(model, [sample], backend.device, reference, router=is_moe)
        worst_loss = max(worst_loss, abs(mine_loss - their_loss) / max(abs(their_loss), 1e-12))
        worst_grad = max(worst_grad, _grad_diff(mine_grads, params, report))
    pack = [samples[i] for i in _packs(samples, max_tokens - BLANK_IMAGE_TOKENS)[0]]
    if len(pack) > 1:
        model.zero_grad(set_to_none=True)
        engine.router_loss = None  # the token loss only (see above)
        plan = _plan([tuple(_cost(i, s) for i, s in enumerate(pack))])
        result = engine.train_step(plan, [pack], lr=0.0)
        mine_loss, mine_grads = result.loss_sum / plan.num_label_tokens, _grads(params)
        their_loss = _own_loss_backward(model, pack, backend.device, reference, router=False)
        worst_loss = max(worst_loss, abs(mine_loss - their_loss) / max(abs(their_loss), 1e-12))
        worst_grad = max(worst_grad, _grad_diff(mine_grads, params, report))
    model.zero_grad(set_to_none=True)
    report.loss_rel_diff, report.grad_rel_diff = worst_loss, worst_grad
    report.aux_loss_included = included if is_moe else None


def _grads(params) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().float().clone() for name, p in params}


def _own_loss_backward(model, samples, device: torch.device, reference: str, *, router: bool) -> float:
    """The model's own loss of each sample alone (``labels=``; with ``router``, its router loss too),
    weighted by its label tokens over theirs together (one sample: its own loss), backed into fresh
    gradients; returns the weighted loss."""
    from odb.training.attention.varlen import ATTN_IMPLEMENTATION

    model.zero_grad(set_to_none=True)
    counts = [count_label_tokens(s["labels"].tolist()) for s in samples]
    total = 0.0
    _with_attention(model, reference)
    try:
        for sample, count in zip(samples, counts):
            labels = torch.as_tensor(sample["labels"], device=device)[None]
            extra = {"output_router_logits": True} if router else {}
            own = _alone(model, sample, device, labels=labels, **extra).loss * (count / max(1, sum(counts)))
            own.backward()
            total += own.item()
    finally:
        _with_attention(model, ATTN_IMPLEMENTATION)
    return total


def _grad_diff(ours: dict[str, torch.Tensor | None], params, report: ModelReport) -> float:
    """The largest relative difference of ``ours`` from the parameters' ``.grad`` (each tensor's max
    absolute difference over the reference's largest entry)."""
    worst = 0.0
    for name, p in params:
        mine, ref = ours[name], p.grad
        if mine is None or ref is None:
            if (mine is None) != (ref is None) and float((mine if mine is not None else ref).abs().max()) > 0:
                report.problems.append(f"gradient of {name}: present on one side only")
            continue
        worst = max(worst, float((mine - ref.float()).abs().max()) / max(float(ref.abs().max()), 1e-12))
    return worst


def _has_router_loss(model) -> bool:
    """Whether the model's own forward adds a router loss (it takes ``output_router_logits``), read
    from its signature, not from odb's detection (:mod:`odb.training.model.moe`)."""
    return "output_router_logits" in inspect.signature(model.forward).parameters


def _label_runs(tokenizer, sample: dict[str, Any], limit: int = 4, width: int = 120) -> list[str]:
    """The first ``limit`` label runs of ``sample``, decoded, each cut to ``width`` characters."""
    runs = label_runs(tokenizer, sample["input_ids"].tolist(), sample["labels"].tolist())
    return [repr(run if len(run) <= width else run[:width] + "...") for run in runs[:limit]]


def _judge(report: ModelReport, tolerances: Tolerances) -> None:
    checks = [("max_logit_diff", report.max_logit_diff, tolerances.logits),
              ("image_processor_max_diff", report.image_processor_max_diff, 1e-5),
              ("video_processor_max_diff", report.video_processor_max_diff, 1e-5),
              ("loss_rel_diff", report.loss_rel_diff, tolerances.loss),
              ("grad_rel_diff", report.grad_rel_diff, tolerances.grad)]
    for name, value, limit in checks:
        if value is not None and not value <= limit:
            report.problems.append(f"{name} {value:.2e} over the tolerance {limit:.0e}")
    if report.aux_loss_included is False:
        report.problems.append("the model has a router loss that odb's trained loss did not include")
    report.ok = report.refused is None and not report.problems and report.samples > 0
