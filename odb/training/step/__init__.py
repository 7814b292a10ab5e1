"""One optimizer step over a step plan.

    engine.py             :class:`~odb.training.step.engine.OdbEngine`: the model calls of a step (collation,
                          positions, the blank image, dummies, attention routing), the backward, the step
    objective.py          what a step trains and reports: the loss math (I4); next-token cross entropy
    loss.py               the loss from the final hidden states in chunks (no full logits)
    sources.py            a step's figures per data source
    sequence_parallel.py  a row split over a group of ranks (Ulysses), per run or per micro-batch
    clock.py              each micro-batch's forward time
"""
