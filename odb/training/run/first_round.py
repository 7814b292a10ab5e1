"""What the first round's records say about the data: a run most of whose first records cannot
train stops there, on every rank alike (the figures are the round's, gathered), naming the fix,
instead of training a sliver of its data or nothing and ending as if it had trained."""

from __future__ import annotations

__all__ = ["check_first_round"]


def check_first_round(skipped: dict[str, int], fetched: int) -> None:
    """Stops the run at its first round when most samples have nothing to learn from, or (``--reference
    data``) no reference log-probs."""
    unlabelled = skipped.get("no_labels", 0) + skipped.get("template_mismatch", 0)
    if fetched and 2 * unlabelled > fetched:
        raise ValueError(
            f"{unlabelled} of the first {fetched} samples have no label tokens ({skipped}): the chat template "
            "marks no assistant tokens that odb can find, or truncation cut them all. Fix: use the model's own "
            "tokenizer and template (--tokenizer), set train_on to 'last' (the final assistant turn) or 'all' in "
            "--data_config, or raise max_tokens in the odb config")
    unscored = skipped.get("no_reference", 0)
    if fetched and 2 * unscored > fetched:
        raise ValueError(
            f"{unscored} of the first {fetched} pairs have no ref_chosen_logps / ref_rejected_logps ({skipped}), "
            "which --reference data takes the reference log-probs from: give every record both (TRL's "
            "precompute_ref_log_probs writes them under these names), or use --reference precompute (the initial "
            "weights' own, computed before the first step)")
