"""The benchmark results are data: benchmarks/records.jsonl holds one record per GPU run of benchmarks/log.md (run,
commit, machine, date, commands, the numbers the log gives for it). docs/benchmarks.md's results table may quote
only numbers of the runs it cites, and no code links into the log (the log is history; code holds the why)."""
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records.jsonl"
LOG = ROOT / "benchmarks" / "log.md"
RESULTS = ROOT / "docs" / "benchmarks.md"
RUN_ANCHOR = re.compile(r'<a id="run-([a-z0-9]+)"></a>')
VALUE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)")
CITED_RUN = re.compile(r"\[([A-Z]{1,2}\d?)\]\(\.\./benchmarks/log\.md#run-([a-z0-9]+)\)")


def load_records(path: Path = RECORDS) -> dict[str, dict]:
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["run"] not in records, f"run {record['run']} recorded twice"
        records[record["run"]] = record
    return records


def results_rows(text: str) -> list[list[str]]:
    """The cells of each row of the results table (scenario, target, latest, run, vLLM, met)."""
    section = text.split("## Results", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # [0]: the header


def unrecorded_quotes(text: str, records: dict[str, dict]) -> list[str]:
    """Each bold number of a row's "latest" cell that is no number of the runs the row cites."""
    found = []
    for cells in results_rows(text):
        runs = [run for run, _ in CITED_RUN.findall(cells[3])]
        values = {n["value"] for run in runs for n in records.get(run, {}).get("numbers", [])}
        for bold in re.findall(r"\*\*(.+?)\*\*", cells[2]):
            found += [f"{cells[0]}: {v} (runs {runs})" for v in VALUE.findall(bold)
                      if float(v.replace(",", "")) not in values]
    return found


def test_every_run_of_the_log_has_one_record():
    records = load_records()
    anchors = {anchor.upper() for anchor in RUN_ANCHOR.findall(LOG.read_text())}
    assert set(records) == anchors
    for run, record in records.items():
        assert re.fullmatch(r"[0-9a-f]{7}", record["commit"]), run
        assert record["machine"] in ("H100", "H200"), run
        assert re.fullmatch(r"2026-\d\d-\d\d", record["date"]), run
        assert record["log"] == f"benchmarks/log.md#run-{run.lower()}"
        assert all(isinstance(n["value"], float) for n in record["numbers"]), run


def test_the_results_table_quotes_only_recorded_numbers():
    records = load_records()
    rows = results_rows(RESULTS.read_text())
    assert len(rows) > 20
    cited = [run for cells in rows for run, _ in CITED_RUN.findall(cells[3])]
    assert cited and set(cited) <= set(records), set(cited) - set(records)
    assert unrecorded_quotes(RESULTS.read_text(), records) == []


def test_a_number_no_cited_run_gave_is_found():
    text = RESULTS.read_text().replace("**25,879 tok/s**", "**25,979 tok/s**", 1)
    assert unrecorded_quotes(text, load_records()) == ["`bench.py`, Qwen3-0.6B, 256 seqs: 25,979 (runs ['AV'])"]


def test_no_code_links_into_the_log():
    code = [*ROOT.glob("nanovllm*/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("benchmarks/*.py")]
    assert [str(p.relative_to(ROOT)) for p in code if re.search(r"log\.md|benchmarks_archive", p.read_text())] == []
