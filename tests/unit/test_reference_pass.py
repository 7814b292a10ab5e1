"""``--reference precompute`` (odb.training.run.reference): the pass's table against an independent
oracle (an eager copy of the model, each sequence alone, log-softmax summed over the answer's
labels), on two simulated ranks, a skipped record and a pair over the cap; training then reads
exactly the table's entries, and drops exactly the pairs the pass dropped; the table's files
(atomic, checked against what made them) and the run's choices: load, refuse, make."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_defaults
from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.data.feed import SampleFeed
from odb.data.processing import SampleDataset, sample_sizes
from odb.training.backends import LocalBackend
from odb.training.launch.flags import parse_config
from odb.training.launch.output_dir import DERIVED
from odb.training.model.build import build_model, hf_model
from odb.training.run.reference import (
    ReferencedDataset,
    TableFiles,
    made_with,
    reference_datasets,
    score_pairs,
)
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference

ROOT = Path(__file__).resolve().parents[2]
CAP = 160
WORDS = "apple river stone cloud garden window".split()


def records() -> list[dict]:
    """Pairs of 35 to 135 tokens (bundled tokenizer), one record that is no pair (skipped), and a
    pair of 920 tokens (over the cap of 160)."""
    rows = [{"prompt": "Name a fruit " * k, "chosen": "apple " * (k + 1), "rejected": " ".join(WORDS * k)}
            for k in range(1, 6)]
    rows.insert(2, {"question": "no pair here"})
    rows.append({"prompt": "Long?", "chosen": "yes", "rejected": "word " * 300})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=len(tokenizer))


def alone(model, sample: dict) -> list[float]:
    """The oracle: each of the pair's sequences alone through an eager copy, its log-softmax summed
    over its answer's labels (the next token of each position)."""
    chosen = sample["pair"][0]
    out = []
    for ids, labels in ((sample["input_ids"][:chosen], sample["labels"][:chosen]),
                        (sample["input_ids"][chosen:], sample["labels"][chosen:])):
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
        targets = labels[1:]
        scored = targets != -100
        out.append(float(torch.log_softmax(logits, -1)[scored].gather(1, targets[scored][:, None]).sum()))
    return out


def engine_of(model) -> OdbEngine:
    return OdbEngine(LocalBackend(model), world_size=2, max_tokens=CAP, pad_token_id=0, loss_chunk_tokens=64,
                     objective=Preference("dpo", reference="precompute"))


@pytest.mark.parametrize("over_cap,whole", [("drop", False), ("truncate", False), ("drop", True)],
                         ids=["drop", "truncate", "validation"])
def test_the_table_holds_each_pairs_log_probs_under_the_initial_weights(data, model, tokenizer, over_cap, whole):
    """Two ranks, window 3: every rank gets the whole table, bit for bit; every pair's entry is the
    oracle's, NaN for the skipped record and (over_cap drop) for the pair over the cap, which a
    validation set's table scores whole instead; both ranks ran as many forwards (dummies
    included). Training (gas 2) over the table then trains exactly the pairs that have an entry,
    each carrying it."""
    dataset = SampleDataset(data, tokenizer, pairs=True, truncate_to=CAP if over_cap == "truncate" else None)
    batching = OdbConfig(max_tokens=CAP, window=3, gas=2, over_cap=over_cap, seed=5)
    forwards = [0, 0]

    def rank(comm):
        copied = copy.deepcopy(model)
        copied.register_forward_hook(lambda *_: forwards.__setitem__(comm.rank, forwards[comm.rank] + 1))
        return score_pairs(engine_of(copied), dataset, batching, comm, score_over_cap=whole)

    (table, result), (other, _) = SimulatedGroup(2).run(rank)
    assert other.tobytes() == table.tobytes() and forwards[0] == forwards[1] > 0
    eager = copy.deepcopy(model)
    hf_model(eager).set_attn_implementation("eager")
    kept = []
    for index in range(len(dataset)):
        sample = dataset[index]
        if "skip" in sample or len(sample["input_ids"]) > CAP and not whole:
            assert np.isnan(table[index]).all(), index
            continue
        kept.append(index)
        np.testing.assert_allclose(table[index], alone(eager, sample), rtol=1e-6, atol=1e-4)
    assert kept == ([0, 1, 3, 4, 5] if over_cap == "drop" and not whole else [0, 1, 3, 4, 5, 6])  # (truncate: cut)
    assert result.samples == len(kept) and result.skipped == {"not_a_pair": 1} and result.over_cap == whole
    if whole:
        return

    def train(comm):
        feed = SampleFeed(ReferencedDataset(dataset, table), sample_sizes)
        trained = {}
        for plan in OnlineBatcher(batching, comm, dataset_size=len(dataset), feed=feed):
            for micro in plan.micro_batches:
                trained.update((uid, feed.take(uid).get("ref_logps")) for uid in micro.uids)
        return trained

    trained = {k: v for part in SimulatedGroup(2).run(train) for k, v in part.items()}
    assert sorted(trained) == kept
    assert all(trained[i] == tuple(table[i]) for i in kept)


def test_a_record_own_reference_gives_way_to_the_table_and_a_nan_entry_leaves_none(data, tokenizer):
    dataset = SampleDataset(data, tokenizer, pairs=True)
    table = np.full((len(dataset), 2), np.nan)
    table[0] = (-3.0, -4.0)
    referenced = ReferencedDataset(dataset, table)
    assert referenced[0]["ref_logps"] == (-3.0, -4.0) and "ref_logps" not in referenced[1]
    assert referenced[2]["skip"] == "not_a_pair" and referenced.source_names == dataset.source_names


def test_the_files_are_written_whole_and_checked_against_what_made_them(tmp_path):
    files = TableFiles(tmp_path)
    assert {files.table.name, files.meta.name, TableFiles(tmp_path, ".eval").table.name,
            TableFiles(tmp_path, ".eval").meta.name} == set(DERIVED)  # what --overwrite_output_dir removes
    table = np.array([[-1.5, -2.25], [np.nan, np.nan]])
    wanted = {"dataset": "abc", "max_tokens": 160}
    assert files.read(wanted)[0] == "missing"
    files.write(table, wanted, seconds=1.0)
    assert not list(tmp_path.glob(".*"))  # no temporary left
    status, _, loaded = files.read(wanted)
    assert status == "matches" and loaded.tobytes() == table.tobytes()
    assert json.loads(files.meta.read_text())["pairs"] == 1
    status, detail, _ = files.read({**wanted, "max_tokens": 256})
    assert status == "differs" and "max_tokens 160, this run 256" in detail
    np.save(files.table, table * 2)  # changed behind the JSON's back
    assert files.read(wanted)[:2] == ("differs", f"{files.table.name} is not the table its {files.meta.name} "
                                                 "describes")
    files.meta.unlink()  # (a pass killed before its JSON: no complete table)
    assert files.read(wanted)[0] == "missing"


def run_config(out: Path, *flags: str):
    return parse_config(["--output_dir", str(out), "--objective", "dpo", *flags], defaults=train_defaults())


def test_a_run_loads_a_matching_table_and_refuses_one_made_otherwise(tmp_path, monkeypatch, data, tokenizer):
    """No engine: a pass would fail. A matching table is loaded; one of another max_tokens is
    refused naming --overwrite_output_dir; a resume without a table is refused."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "out"
    config = run_config(out)
    assert config.objective.reference_for(lora=False) == "precompute"  # a full fine-tune's default
    dataset = SampleDataset(data, tokenizer, pairs=True)
    batching = OdbConfig(max_tokens=CAP)
    table = np.full((len(dataset), 2), -2.0)
    out.mkdir()
    TableFiles(out).write(table, made_with(config, dataset, batching), seconds=0.5)
    lines = []
    comm = SimulatedGroup(1).communicator(0)
    fed, eval_fed = reference_datasets(config, None, dataset, None, batching, comm, lines.append)
    assert eval_fed is None and fed[0]["ref_logps"] == (-2.0, -2.0)
    assert "loaded" in lines[0] and "no pass" in lines[0]
    with pytest.raises(ValueError, match=r"max_tokens 160, this run 200.*--overwrite_output_dir"):
        reference_datasets(config, None, dataset, None, OdbConfig(max_tokens=200), comm, lines.append)
    TableFiles(out).meta.unlink()
    (out / "checkpoints" / "step1").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step1")
    with pytest.raises(ValueError, match="the checkpoint holds trained ones"):
        reference_datasets(run_config(out, "--resume"), None, dataset, None, batching, comm, lines.append)


def test_precompute_needs_indexed_data_and_the_other_references_pass_through(tmp_path, monkeypatch, data, tokenizer):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"--streaming.*--reference data.*--lora"):
        run_config(tmp_path / "a", "--streaming")
    config = run_config(tmp_path / "b", "--reference", "data")
    dataset = SampleDataset(data, tokenizer, pairs=True)
    assert reference_datasets(config, None, dataset, None, OdbConfig(), None, print) == (dataset, None)
