"""The door of ``launch/train.py`` (and ``odb train``): the flags, made from the settings'
dataclasses and checked before any process group (:mod:`~odb.training.launch.flags`), the output
folder's policy (:mod:`~odb.training.launch.output_dir`), one rank's parse -> init -> build ->
train -> finish (:mod:`~odb.training.launch.main`), and docs/settings.md's tables from the same
dataclasses (:mod:`~odb.training.launch.settings_docs`)."""
