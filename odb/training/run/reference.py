"""``--reference precompute``: a full fine-tune's reference log-probabilities, those of its initial
weights, from one forward-only pass over the training data before the first step (and the engine of
a host's separate reference model, reference ``model``: :func:`reference_engine`).

The table, per dataset index ``i`` (float64 ``[N, 2]``)::

    table[i] = (pi_0(chosen_i), pi_0(rejected_i))     pi_0(answer) = -sum_t CE_t over the answer's labels

under the initial weights, exactly as :meth:`odb.training.step.preference.Preference.logps`
computes the policy's ``pi`` in training (the pair processed and truncated as training processes
it, each sequence cut to ``max_tokens``); NaN where the data layer skipped the record or the
batcher dropped the pair over the cap. The pass's batcher runs the training's over-cap policy, and
whether a sample is dropped is a pure function of its sizes and the caps (:meth:`CostModel.measure`),
the same in training: a pair the pass drops never trains, and never asks for its entry.

The pass is the evaluator's (:class:`odb.training.run.evaluate.Evaluator`) with
:class:`ReferenceScores` scoring its steps: a fresh :class:`~odb.batching.batcher.OnlineBatcher`
over the dataset, join mode, gas 1, the training batcher's communicator, so every pair is scored
exactly once over all ranks (I2) and every rank runs the same number of forwards, dummies where it
has none (I1: ZeRO-3's and FSDP2's parameter gathers); eval mode, no gradients. A validation set
(``--eval_data``, ``--val_ratio``) gets a table of its own the same way, its pairs over the caps
scored whole, as the evaluator scores them.

Gather (:func:`gather_table`): two collectives through an :class:`~odb.batching.align.Aligner` over
the same communicator: the most pairs any rank scored, ``m``; then each rank's ``[m, 3]`` int64
(dataset index, chosen and rejected float64 bit-cast; index -1 pads). Every rank holds the whole
table. Rank 0 writes it, atomically (temp, fsync, rename; the JSON last, so a table is complete
when its JSON is there and names its bytes' hash)::

    OUTPUT_DIR/reference_logps.npy         float64 [N, 2]
    OUTPUT_DIR/reference_logps.json        version, made_with, pairs, seconds, sha256
    OUTPUT_DIR/reference_logps.eval.*      the validation set's

``made_with`` (:func:`made_with`): the dataset's fingerprint and records, the model (and its seed
when it is a config's random init), the tokenizer, the precision, ``max_tokens``, ``over_cap`` and
the data processing. A run, fresh or resumed, whose folder holds a complete table made with the
same loads it and skips the pass; one made otherwise is refused, naming the fix; a resume that finds
none is refused (the checkpoint holds trained weights, not the initial ones). Every rank reads the
folder and the ranks compare what they found (one collective), so all take the same way.
``--overwrite_output_dir`` removes the tables (:data:`odb.training.launch.output_dir.DERIVED`).

Training then reads each pair's entry as reference 'data' reads a record's: :class:`ReferencedDataset`
puts ``sample["ref_logps"]`` into the sample where the DataLoader worker makes it (the batcher sees
the same sizes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from odb.batching.align import Aligner, Communicator
from odb.batching.config import OdbConfig
from odb.batching.plan import StepPlan
from odb.training import backends
from odb.training.backends import Backend
from odb.training.config.objective import padded_refusal
from odb.training.config.settings import RunConfig
from odb.training.model.build import hf_model
from odb.training.model.mrope import supports_packing
from odb.training.run.evaluate import EvalResult, Evaluator
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference
from odb.training.step.sources import SourceSums

__all__ = ["TABLE", "ReferenceScores", "ReferencedDataset", "TableFiles", "gather_table", "made_with",
           "reference_datasets", "reference_engine", "score_pairs"]

TABLE = "reference_logps"
"""The tables' file names in ``--output_dir``: ``reference_logps.npy`` and ``.json`` (the
validation set's ``reference_logps.eval.*``)."""
VERSION = 1
_STATUS = ("missing", "matches", "differs")


class ReferenceScores:
    """Stands in for the run's objective in the pass (:meth:`OdbEngine.eval_step`'s ``objective``):
    keeps each real pair's :meth:`Preference.logps` in :attr:`scores` by dataset index."""

    name = "reference"

    def __init__(self, preference: Preference) -> None:
        self.preference = preference
        self.scores: dict[int, tuple[float, float]] = {}

    def tally(self, engine: OdbEngine, plan: StepPlan):
        raise AssertionError("the reference pass trains nothing")

    def evaluate(self, engine: OdbEngine, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], *,
                 truncate: bool = True, by_source: SourceSums | None = None) -> tuple[float, int]:
        count = 0
        for micro, micro_samples in zip(plan.micro_batches, samples, strict=True):
            if micro.is_dummy:  # a real forward, as the other ranks run theirs (no router logits either)
                engine.dummy_loss(router=False)
                continue
            logps = self.preference.logps(engine, micro, micro_samples, truncate=truncate).double().cpu().tolist()
            for sample, (chosen, rejected) in zip(micro_samples, logps, strict=True):
                assert sample["index"] not in self.scores, f"pair {sample['index']} scored twice"
                self.scores[sample["index"]] = (chosen, rejected)
            count += len(micro_samples)
        return 0.0, count


class ReferencedDataset(Dataset):
    """``dataset``'s samples, each pair with its entry of ``logps`` as ``sample["ref_logps"]``
    (a record's own ``ref_chosen_logps`` / ``ref_rejected_logps`` give way to it); a pair whose
    entry is NaN gets none."""

    def __init__(self, dataset: Dataset, logps: np.ndarray) -> None:
        assert logps.shape == (len(dataset), 2), f"a table of {logps.shape} for {len(dataset)} records"
        self.dataset, self.logps = dataset, logps
        self.source_names = dataset.source_names

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, uid: int) -> dict[str, Any]:
        sample = self.dataset[uid]
        if "skip" not in sample:
            sample.pop("ref_logps", None)
            chosen, rejected = (float(v) for v in self.logps[sample["index"]])
            if math.isfinite(chosen) and math.isfinite(rejected):
                sample["ref_logps"] = (chosen, rejected)
        return sample


def score_pairs(engine: OdbEngine, dataset: Dataset, batching: OdbConfig, comm: Communicator, *,
                score_over_cap: bool = False, num_workers: int = 0, prefetch_factor: int = 2
                ) -> tuple[np.ndarray, EvalResult]:
    """The pass over ``dataset`` with the model as it is (collective): the whole table ``[N, 2]``
    on every rank, and the evaluator's figures (pairs scored, records skipped, seconds).
    ``score_over_cap``: score pairs over the caps whole (a validation set) instead of dropping
    them as training does."""
    objective = engine.objective
    assert isinstance(objective, Preference), "reference log-probs are a preference objective's"
    scores = ReferenceScores(objective)
    result = Evaluator(engine, dataset, batching, comm, num_workers=num_workers, prefetch_factor=prefetch_factor,
                       objective=scores, score_over_cap=score_over_cap).run()
    return gather_table(Aligner(comm), scores.scores, len(dataset)), result


def gather_table(aligner: Aligner, scores: dict[int, tuple[float, float]], size: int) -> np.ndarray:
    """Every rank's ``scores`` in one ``[size, 2]`` float64 table, NaN where no rank has one
    (collective: two gathers; the second is left out, on every rank alike, when no rank has any)."""
    most = int(aligner.gather_reports(np.array([len(scores)], dtype=np.int64))[:, 0].max())
    table = np.full((size, 2), np.nan)
    if not most:
        return table
    mine = np.full((most, 3), -1, dtype=np.int64)
    if scores:
        mine[:len(scores), 0] = np.fromiter(scores, dtype=np.int64, count=len(scores))
        mine[:len(scores), 1:] = np.array(list(scores.values()), dtype=np.float64).view(np.int64)
    rows = aligner.gather_reports(mine.reshape(-1)).reshape(-1, 3)
    rows = rows[rows[:, 0] >= 0]
    assert len(np.unique(rows[:, 0])) == len(rows), "a pair was scored on two ranks"
    table[rows[:, 0]] = np.ascontiguousarray(rows[:, 1:]).view(np.float64)
    return table


def made_with(config: RunConfig, dataset: Dataset, batching: OdbConfig) -> dict[str, Any]:
    """What a table depends on besides the weights' values (the module docstring), as JSON reads it back."""
    model = config.model.path
    dtype = backends.get(config.optimization.backend).compute_dtype(config.optimization)
    values = {"dataset": dataset.fingerprint(), "records": len(dataset), "model": str(model),
              "seed": config.seed if Path(model).is_file() else None,  # a config JSON: random init from the seed
              "tokenizer": str(config.model.tokenizer), "dtype": str(dtype), "max_tokens": batching.max_tokens,
              "over_cap": batching.over_cap, "processing": dataclasses.asdict(config.data.processing),
              "sources": [[s.name, dict(s.processing)] for s in config.data.sources]}
    return json.loads(json.dumps(values, default=str))


@dataclasses.dataclass(frozen=True)
class TableFiles:
    """A table's two files in ``folder`` (``suffix``: '' for the training data, '.eval' for validation)."""

    folder: Path
    suffix: str = ""

    @property
    def table(self) -> Path:
        return self.folder / f"{TABLE}{self.suffix}.npy"

    @property
    def meta(self) -> Path:
        return self.folder / f"{TABLE}{self.suffix}.json"

    def read(self, wanted: dict[str, Any]) -> tuple[str, str, np.ndarray | None]:
        """``(status, detail, table)``: status 'missing' (no complete table), 'matches' (with the
        table) or 'differs' (made otherwise, or unreadable: ``detail`` says how)."""
        if not self.meta.is_file() or not self.table.is_file():
            return "missing", "", None
        try:
            meta = json.loads(self.meta.read_text())
            data = self.table.read_bytes()
            if meta.get("sha256") != hashlib.sha256(data).hexdigest():
                return "differs", f"{self.table.name} is not the table its {self.meta.name} describes", None
            table = np.load(self.table, allow_pickle=False)
        except (OSError, ValueError) as err:
            return "differs", f"it cannot be read ({type(err).__name__}: {err})", None
        if meta.get("version") != VERSION or meta.get("made_with") != wanted:
            had = meta.get("made_with") if isinstance(meta.get("made_with"), dict) else {}
            keys = sorted(k for k in {*had, *wanted} if had.get(k) != wanted.get(k)) or ["version"]
            return "differs", "made with " + "; ".join(f"{k} {had.get(k)!r}, this run {wanted.get(k)!r}"
                                                        for k in keys), None
        return "matches", "", table

    def write(self, table: np.ndarray, wanted: dict[str, Any], *, seconds: float) -> None:
        """Writes the table, then its JSON, each atomically (rank 0)."""
        self.meta.unlink(missing_ok=True)  # (first: a table is complete only once its new JSON is there)
        _fsync_folder(self.folder)
        _write_atomic(self.table, lambda f: np.save(f, table, allow_pickle=False))
        meta = {"version": VERSION, "made_with": wanted, "pairs": int(np.isfinite(table).all(axis=1).sum()),
                "seconds": round(seconds, 3), "sha256": hashlib.sha256(self.table.read_bytes()).hexdigest()}
        _write_atomic(self.meta, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))


def _write_atomic(path: Path, write: Callable[[Any], Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reference_datasets(config: RunConfig, engine: OdbEngine, dataset: Dataset, eval_dataset: Dataset | None,
                       batching: OdbConfig, comm: Communicator, log: Callable[[str], None]
                       ) -> tuple[Dataset, Dataset | None]:
    """The datasets the run's feeds read (collective): ``dataset`` and ``eval_dataset`` as they are,
    or, under reference 'precompute', each in a :class:`ReferencedDataset` over its table, loaded
    from ``--output_dir`` or made here (before any checkpoint is loaded: the initial weights)."""
    settings = config.objective
    if not settings.is_preference or settings.reference_for(lora=config.model.lora is not None) != "precompute":
        return dataset, eval_dataset
    fed = [ReferencedDataset(data, _table(config, engine, data, batching, comm, log, suffix=suffix))
           for data, suffix in ((dataset, ""), (eval_dataset, ".eval")) if data is not None]
    return fed[0], fed[1] if eval_dataset is not None else None


def _table(config: RunConfig, engine: OdbEngine, dataset: Dataset, batching: OdbConfig, comm: Communicator,
           log: Callable[[str], None], *, suffix: str) -> np.ndarray:
    """One table: loaded where the folder holds a matching one, else made and written (collective)."""
    files, wanted, aligner = TableFiles(config.output_dir, suffix), made_with(config, dataset, batching), Aligner(comm)
    status, detail, table = files.read(wanted)
    found = aligner.gather_reports(np.array([_STATUS.index(status)], dtype=np.int64))[:, 0].tolist()
    what = f"the reference table {files.table}"
    if len(set(found)) > 1:
        seen = ", ".join(f"rank {r}: {_STATUS[s]}" for r, s in enumerate(found))
        raise ValueError(f"ranks see {what} differently ({seen}): every rank must see the same --output_dir (a "
                         "shared file system)")
    resume = config.checkpoints.resume
    if status == "differs":
        fix = ("resume with the settings that made it" if resume else
               f"pass --overwrite_output_dir (removes it and any earlier run there) or remove {files.table.name} and "
               f"{files.meta.name} (this run then makes it again)")
        raise ValueError(f"--reference precompute: {what} was {detail}: {fix}")
    if status == "matches":
        assert table is not None
        log(f"odb: reference log-probs (--reference precompute): loaded {files.table} ({_pairs(table)} pairs, made "
            "with this run's data, model and max_tokens): no pass")
        return table
    if resume:
        raise ValueError(f"--resume: --reference precompute and no {files.table} in --output_dir: the table is made "
                         "from the initial weights before the first step, and the checkpoint holds trained ones; "
                         "resume with the --reference the run started with (e.g. data), or start over "
                         "(--overwrite_output_dir)")
    start = time.perf_counter()
    table, result = score_pairs(engine, dataset, batching, comm, score_over_cap=bool(suffix),
                                num_workers=config.data.num_workers, prefetch_factor=config.data.prefetch_factor)
    seconds = time.perf_counter() - start
    _write(files, table, wanted, seconds=seconds, aligner=aligner)
    skipped = sum(result.skipped.values())
    dropped = len(dataset) - result.samples - skipped
    whole = f", {result.over_cap} over max_tokens scored whole" if result.over_cap else ""
    log(f"odb: reference log-probs (--reference precompute): {result.samples} pairs of {len(dataset)} records "
        f"({skipped} skipped, {dropped} dropped over the cap{whole}) in {seconds:.1f} s from the initial weights of "
        f"{config.model.path}: {files.table}")
    return table


def _write(files: TableFiles, table: np.ndarray, wanted: dict[str, Any], *, seconds: float, aligner: Aligner) -> None:
    """Rank 0 writes the table; every rank then learns whether it did (one gather), so that a
    failed write stops every rank, not rank 0 alone."""
    error = None
    if aligner.rank == 0:
        try:
            files.write(table, wanted, seconds=seconds)
        except OSError as err:
            error = err
    if not aligner.gather_reports(np.array([error is None], dtype=np.int64))[0, 0]:
        raise ValueError(f"rank 0 could not write the reference table {files.table} ({error or 'see its log'}): "
                         "check that --output_dir is writable and has room") from error


def _pairs(table: np.ndarray) -> int:
    return int(np.isfinite(table).all(axis=1).sum())


def reference_engine(config: RunConfig, reference: Backend, batching: OdbConfig, tokenizer) -> OdbEngine:
    """The engine of a host's separate reference model (reference ``model``): the policy's packed
    rows under the same cap, through the reference's own forward and LM head; gradients never run
    through it (:meth:`odb.training.step.preference.Preference.pairs` calls it without them)."""
    model = hf_model(reference.module)
    if config.objective.reference != "model":
        raise ValueError(f"a separate reference model is reference 'model', not {config.objective.reference!r}: "
                         "set ObjectiveSettings(reference='model') with it")
    if not supports_packing(model):
        raise ValueError(padded_refusal(config.objective.objective,
                                        f"odb cannot pack the reference model ({model.config.model_type})"))
    return OdbEngine(reference, world_size=1, max_tokens=batching.max_tokens, pad_token_id=tokenizer.pad_token_id,
                     loss_chunk_tokens=config.model.loss_chunk_tokens)
