"""``odb show-labels``: what a run would train on: the first records of a data file, processed as
the DataLoader workers process them (chat template, labels, truncation), with each label run decoded.

    odb show-labels --tokenizer /models/Qwen2.5-7B-Instruct --data chats.jsonl
    odb show-labels --data chats.jsonl --data_config my_data.yaml --max_tokens 512

Check it before a long run: every assistant answer (its tool calls and reasoning, as the chat
template renders them) and its end-of-turn token should appear as a label run, and nothing of the
system, user, tool results or headers; a record the template cannot label is shown SKIPPED with the
reason and the fix. Text records only (no images).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None, prog: str = "odb show-labels") -> None:
    from odb.data.labels import label_runs
    from odb.data.processing import SampleDataset, load_data_config
    from odb.training.launch.flags import FileDefaults
    from odb.training.model.build import load_tokenizer

    bundled = FileDefaults.bundled()
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--tokenizer", type=Path, default=bundled.tokenizer,
                        help="tokenizer (or model) folder with its chat template (default: the bundled one)")
    parser.add_argument("--data", type=Path, default=bundled.data, help="default: the bundled chat data")
    parser.add_argument("--data_config", type=Path, default=None,
                        help="data settings JSON or YAML (train_on, truncation)")
    parser.add_argument("--train_on", choices=("assistant", "last", "all"), default=None)
    parser.add_argument("--max_tokens", type=int, default=None, help="truncate as a run with this cap would")
    parser.add_argument("--records", type=int, default=3, help="how many records to show")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    config = load_data_config(args.data_config, train_on=args.train_on)
    dataset = SampleDataset(args.data, tokenizer, config, max_samples=args.records, truncate_to=args.max_tokens)
    for uid in range(len(dataset)):
        sample = dataset[uid]
        if "skip" in sample:
            print(f"record {sample['where']}: SKIPPED ({sample['skip']}): {sample['detail']}\n")
            continue
        ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
        runs = label_runs(tokenizer, ids, labels)
        cut = f", {sample['truncated_tokens']} cut" if sample.get("truncated_tokens") else ""
        print(f"record {uid}: {len(ids)} tokens{cut}, {sum(t != -100 for t in labels)} label tokens in "
              f"{len(runs)} runs")
        for run in runs:
            print(f"  label run: {run!r}")
        print()
