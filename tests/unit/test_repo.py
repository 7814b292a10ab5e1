"""The repository's promises: CI runs the README's test command, the README stays a front door whose
links (and the docs' links) resolve, configs load, the benchmark tool keeps its interface."""

import json
import re
import subprocess
import sys

from conftest import ROOT
from odb.batching.config import load_odb_config

BENCH_KEYS = {"policy", "world_size", "samples", "emitted", "duplicated", "dropped", "truncated", "steps",
              "micro_batches", "dummy_micro_batches", "real_tokens", "materialized_tokens", "padding_ratio",
              "lower_bound_micro_batches", "aligned", "rounds", "collectives", "sync_efficiency",
              "us_per_sample"}


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for line in blocks[0].splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in readme_commands() if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_odb_config_file_loads():
    assert load_odb_config(ROOT / "configs" / "odb.json").max_tokens == 2048


def run_bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_batching.py"), *args, "--json",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_tool_prints_one_json_object_with_the_documented_keys(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{(i * 7919) % 3000 + 20} {(i * 31) % 5}\n" for i in range(3000)))
    for policy in ("odb", "fixed", "gmt", "bmt"):
        report = run_bench("--lengths", str(trace), "--max-tokens", "4096", "--window", "128",
                           "--world-size", "4", "--gas", "2", "--policy", policy)
        assert set(report) == BENCH_KEYS
        assert report["aligned"] and report["emitted"] == 3000 and report["duplicated"] == 0
        assert report["collectives"] == report["rounds"] + 1
    assert report["padding_ratio"] > 0  # bmt pads
    quota = run_bench("--lengths", str(trace), "--mode", "quota", "--quota", "4500", "--window", "64")
    assert quota["emitted"] == 4500 and quota["duplicated"] == 0


def test_bench_tool_takes_explicit_rank_shards(tmp_path):
    shards = tmp_path / "ranks.json"
    shards.write_text(json.dumps({"ranks": [[100] * 3, [], [50] * 300, [[300, 4]] * 7]}))
    report = run_bench("--rank-lengths", str(shards), "--max-tokens", "1024", "--window", "32", "--gas", "2")
    assert report["world_size"] == 4 and report["samples"] == 310 and report["emitted"] == 310
    assert report["aligned"] and report["padding_ratio"] == 0


# --- the documentation: README.md and docs/*.md -------------------------------------------------------

README_MAX_LINES = 300
REPO_PATH_PREFIXES = ("odb/", "docs/", "tools/", "launch/", "configs/", "tests/", "data/")


def doc_pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The page without its fenced code blocks (commands and their outputs are not links)."""
    return re.sub(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", "", text, flags=re.S | re.M)


def anchors(page) -> set[str]:
    """The heading anchors GitHub makes for ``page``: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to ``-``, ``-1``, ``-2``, ... after repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def links(page) -> list[str]:
    """Targets of the page's markdown links and images, outside code."""
    text = re.sub(r"`[^`\n]*`", "", prose(page.read_text()))
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def backticked_repo_paths(page) -> list[str]:
    """Words in the page's inline code spans that name a file or folder of this repository
    (``tests/e2e/test_faults.py::test_x`` names the file); placeholders and globs are left out."""
    paths = []
    for span in re.findall(r"`([^`\n]+)`", prose(page.read_text())):
        for word in span.split():
            word = word.strip("(),;:'\"").split("::")[0]
            if word.startswith(REPO_PATH_PREFIXES) and not re.search(r"[<>*{}$\[\]|]", word):
                paths.append(word)
    return paths


def test_readme_is_a_front_door_under_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_every_relative_link_and_backticked_repo_path_in_the_docs_exists():
    assert (ROOT / "docs").is_dir() and len(doc_pages()) > 1
    root = ROOT.resolve()
    broken = []
    for page in doc_pages():
        where = page.relative_to(ROOT)
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if path and (not file.exists() or not file.is_relative_to(root)):
                broken.append(f"{where}: link {target} (no such file in the repository)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{where}: link {target} (no heading #{anchor} in {file.relative_to(root)})")
        for path in backticked_repo_paths(page):
            if not (ROOT / path).exists():
                broken.append(f"{where}: `{path}` (no such file in the repository)")
    assert not broken, "\n".join(broken)
