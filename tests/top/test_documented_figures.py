"""The docs' measured figures: every curve benchmarks/curves.py re-runs is still in the docs, its
side-by-side reads a run's metrics, and every table of figures says where it was measured."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("curves", ROOT / "benchmarks" / "curves.py")
curves = sys.modules["curves"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(curves)


@pytest.mark.parametrize("curve", curves.CURVES, ids=lambda c: c.name)
def test_every_curve_is_in_the_docs_and_says_where_it_was_measured(curve):
    table = curves.doc_table(curve)  # raises when a row is gone or does not line up
    assert all(run in curves.RUNS for run in (row.run for row in curve.rows))
    for row in curve.rows:
        assert curves.provenance_gaps(curve.doc, row.label, seeded=True) == [], (curve.doc, row.label)
        columns, figures = table[row.label]
        assert len(columns) == len(figures) > 0


@pytest.mark.parametrize("script", curves.SCRIPTS, ids=lambda s: s.name)
def test_every_curve_a_script_makes_is_in_the_docs_and_says_where_it_was_measured(script):
    assert len(curves.docs_lines(script.doc, script.label)) > 2
    assert (curves.ROOT / script.command[0]).is_file()
    assert curves.provenance_gaps(script.doc, script.label, seeded=True) == [], (script.doc, script.label)


@pytest.mark.parametrize("doc, label", curves.TABLES)
def test_every_other_table_of_figures_says_where_it_was_measured(doc, label):
    assert curves.provenance_gaps(doc, label, seeded=False) == [], (doc, label)


def test_a_table_without_its_provenance_is_found(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("## A\n\nMeasured by `grpokit train` on 2026-11-28, 2 threads, torch 2.13.0.\n\n"
                   "| step | 0 |\n|---|---|\n| seed 0 | 0.5 |\n")
    monkeypatch.setattr(curves, "ROOT", tmp_path)
    assert curves.provenance_gaps("doc.md", "seed 0", seeded=True) == ["transformers' version", "the seed"]
    assert curves.provenance_gaps("doc.md", "seed 9", seeded=True) == ["0 table rows labelled 'seed 9'"]
    doc.write_text(doc.read_text().replace("torch 2.13.0.", "torch 2.13.0, transformers 5.24.0, seed 0.")
                   + "\n| steps | 1-2 |\n|---|---|\n| reward | 0.1 |\n\nSome words.\n\n| step | 3 |\n|---|---|\n| later | 1 |\n")
    assert curves.provenance_gaps("doc.md", "reward", seeded=True) == []  # the table above it shares its text
    assert curves.provenance_gaps("doc.md", "later", seeded=True) != []  # not across other text


def test_the_side_by_side_reads_the_docs_and_a_run_s_metrics(tmp_path):
    """The README's default curve against the committed metrics of the runs it shows."""
    for run, name in (("default-seed0", "default-seed0"), ("default-seed1", "default-seed1")):
        (tmp_path / run).mkdir()
        shutil.copy(ROOT / "benchmarks" / "results" / f"{name}.metrics.jsonl", tmp_path / run / "metrics.jsonl")
    curve = next(c for c in curves.CURVES if c.name == "default")
    lines = curves.side_by_side(curve, tmp_path)
    docs = {line.split("|")[1].strip()[len("docs: "):]: line.split("|")[2:-1] for line in lines if "| docs: " in line}
    new = {line.split("|")[1].strip()[len("new: "):]: line.split("|")[2:-1] for line in lines if "| new: " in line}
    label = "exact accuracy (`exact_answer`), seed 1"
    assert [c.strip() for c in docs[label]] == [c.strip() for c in new[label]]
    rows = [json.loads(line) for line in (tmp_path / "default-seed1" / "metrics.jsonl").read_text().splitlines()]
    step_20 = next(r for r in rows if r["step"] == 20 and curves.EXACT in r)
    assert new[label][1].strip() == f"{step_20[curves.EXACT]:.2f}"
