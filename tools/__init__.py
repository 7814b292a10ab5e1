"""Scripts run from the checkout, never installed (users' commands live in ``odb``, odb/cli/):

- ``bench/``: benchmarks; each one's figures are in docs/benchmarks.md beside the command that made them
- ``check/``: checks a contributor runs on a change or a machine (plan digests, run comparison, the
  GPU check, the alignment soak, odb's video processing against transformers')
- ``sim/``: the cluster and long-context simulators
- ``make/``: what makes the bundled data (the preference demo's too), the trace data, the video trace and
  docs/settings.md's tables

Each script puts the checkout on ``sys.path`` and imports its neighbours as ``tools.<folder>.<name>``;
``tools/traces.py`` reads the length traces for all of them.
"""
