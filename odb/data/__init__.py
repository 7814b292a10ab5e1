"""What runs in DataLoader workers: sources, formats, processing and labels, images, the feed
of dealt samples, and varlen collation. Uses :mod:`odb.batching` below it, nothing above."""
