"""A data mixture as the user writes it: ``--data NAME=PATH:WEIGHT ...`` (or JSON objects), a
recipe's list of sources, and the datasets the trainer builds from them (each source's own
processing settings; a held-out share of each source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bundled_tokenizer, train_defaults
from odb.data.mixture import MixedDataset, SourceSpec, parse_source, parse_sources
from odb.recipe import load_recipe
from odb.training.launch.flags import parse_config
from odb.training.run.datasets import build_datasets

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = train_defaults()


@pytest.fixture(autouse=True)
def _in_the_repo(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_source_words():
    assert parse_source("chat=data/chat.jsonl:0.3") == SourceSpec("chat", "data/chat.jsonl", 0.3)
    assert parse_source("code=C:/data/code") == SourceSpec("code", "C:/data/code")  # a colon in the path
    assert parse_source("code=C:/data/code:2") == SourceSpec("code", "C:/data/code", 2.0)
    assert parse_source('{"name": "m", "path": "p", "weight": 1, "train_on": "last"}') == \
        SourceSpec("m", "p", 1, {"train_on": "last"})
    for bad, match in [("data/chat.jsonl", "NAME=PATH"), ("a b=p", "name"), ("a=p:0", "weight"), ("a=p:inf", "finite"),
                       ('{"name": "a", "path": "p", "lr": 1}', "unknown key"), ("{nope", "JSON")]:
        with pytest.raises(ValueError, match=match):
            parse_source(bad)
    with pytest.raises(ValueError, match="every data source a weight, or none"):
        parse_sources(["a=p:1", "b=q"])
    with pytest.raises(ValueError, match="distinct names"):
        parse_sources(["a=p", "a=q"])


def test_the_command_line_names_weighted_sources(tmp_path):
    config = parse_config(["--data", "chat=data/chat.jsonl:0.3", "mm=data/mm/train.jsonl:0.7", "--mix_by", "tokens",
                           "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
    assert config.data.sources == (SourceSpec("chat", "data/chat.jsonl", 0.3),
                                   SourceSpec("mm", "data/mm/train.jsonl", 0.7))
    assert config.data.is_weighted and config.data.mix_by == "tokens" and config.data.mix_epoch == "all"
    plain = parse_config(["--data", "data/chat.jsonl", "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
    assert plain.data.sources == () and plain.data.path == "data/chat.jsonl"
    with pytest.raises(FileNotFoundError, match="source 'b': path data/nope.jsonl does not exist"):
        parse_config(["--data", "a=data/chat.jsonl", "b=data/nope.jsonl", "--output_dir", str(tmp_path / "o")],
                     defaults=DEFAULTS)
    with pytest.raises(ValueError, match="take no weight"):
        parse_config(["--eval_data", "a=data/chat.jsonl:1", "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)


def test_a_recipe_lists_sources_with_their_own_settings(tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(json.dumps({"data": [{"name": "chat", "path": "data/chat.jsonl", "weight": 1,
                                            "train_on": "last", "system_prompts": ["Be brief."]},
                                           {"name": "more", "path": "data/chat.jsonl", "weight": 3}],
                                  "mix_epoch": "first", "output_dir": str(tmp_path / "o")}))
    config = parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe))
    assert config.data.sources == (SourceSpec("chat", "data/chat.jsonl", 1, {"train_on": "last",
                                                                            "system_prompts": ["Be brief."]}),
                                   SourceSpec("more", "data/chat.jsonl", 3))
    assert config.data.mix_epoch == "first"
    # the trainer's datasets: each source processed with its own settings over --data_config's
    train, held = build_datasets(config, bundled_tokenizer(), None, truncate_to=None)
    assert isinstance(train, MixedDataset) and train.source_names == ("chat", "more") and held is None
    assert train.parts[0].config.train_on == "last" and train.parts[0].config.system_prompts == ("Be brief.",)
    assert train.parts[1].config.train_on == "assistant"
    sample = train[len(train.parts[0]) + 5]
    assert sample["source"] == 1 and sample["index"] == len(train.parts[0]) + 5
    assert train.locate(sample["index"]) == (1, 5)


def test_a_held_out_share_of_each_source(tmp_path):
    config = parse_config(["--data", "a=data/chat.jsonl", "b=data/chat.jsonl", "--max_samples", "100",
                           "--val_ratio", "0.1", "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
    train, held = build_datasets(config, bundled_tokenizer(), None, truncate_to=None)
    assert train.sizes == [90, 90] and held.sizes == [10, 10] and held.source_names == ("a", "b")
    for part, out in zip(train.parts, held.parts):
        assert not set(part.indices) & set(out.indices) and len(set(part.indices) | set(out.indices)) == 100


def test_one_named_source_keeps_its_name_and_a_path_with_an_equals_sign_is_a_path(tmp_path):
    config = parse_config(["--data", "chat=data/chat.jsonl:1", "--max_samples", "10", "--eval_data",
                           "held=data/chat.jsonl", "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
    train, held = build_datasets(config, bundled_tokenizer(), None, truncate_to=None)
    assert train.source_names == ("chat",) and train.sizes == [10] and held.source_names == ("held",)
    folder = tmp_path / "date=2024"
    folder.mkdir()
    (folder / "train.jsonl").write_text((ROOT / "data" / "chat.jsonl").read_text())
    plain = parse_config(["--data", str(folder / "train.jsonl"), "--output_dir", str(tmp_path / "o")],
                         defaults=DEFAULTS)
    assert plain.data.sources == () and plain.data.path == str(folder / "train.jsonl")


def test_a_huge_weighted_epoch_is_warned_of_at_start_naming_the_source_and_the_ways_out(tmp_path):
    """mix_epoch all with a tiny source at a large weight: about 100x the data's records an epoch."""
    from odb.training.run.datasets import mixture_epoch

    def line(rule, weights):
        config = parse_config(["--data", f"tiny=data/chat.jsonl:{weights[0]}", f"big=data/chat.jsonl:{weights[1]}",
                               "--mix_epoch", rule, "--mix_by", "samples", "--output_dir", str(tmp_path / "o")],
                              defaults=DEFAULTS)
        return mixture_epoch(config, [50, 5000], ["tiny", "big"])

    warned = line("all", [0.99, 0.01])
    assert warned.startswith("odb: WARNING: mixture (mix_epoch all): an epoch trains about 500000 records, 99 x")
    assert "'tiny' (50 records at weight 0.99) passes about 9.9e+03 times" in warned
    assert "--mix_epoch first" in warned and "--max_steps" in warned
    assert line("first", [0.99, 0.01]).startswith("odb: mixture (mix_epoch first): an epoch trains about 51 records")
    assert "WARNING" not in line("all", [0.5, 0.5])  # 2 x the data at most: no warning below LARGE_EPOCH
