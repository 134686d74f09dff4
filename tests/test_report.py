"""`gradian report`: the page's numbers against the query's own results, and the page in a real browser."""

import json
import re
import shutil
import subprocess

import pytest
from conftest import MAPPED, ROWS, write_jsonl, write_renamed_parquet

from gradian_lightning.cli import main

QUERIES = [{**r, "id": f"q{i}"} for i, r in enumerate(ROWS[:2])]


def index_query_report(folder, saved_model, capsys, data, queries, *extra):
    """gradian index, query (with token scores) and report of `data` and `queries` into `folder`."""
    common = [
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"query.data={queries}",
        f"index.path={folder / 'ix'}",
        f"query.output={folder / 'results.jsonl'}",
        "query.top_k=3",
        "query.bottom_k=2",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        *extra,
    ]
    assert main(["index", *common]) == 0
    assert main(["query", *common, "query.token_scores=true"]) == 0
    capsys.readouterr()
    assert main(["report", *common, "report.token_rows=2"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == f"gradian report: written to {folder / 'results.html'}"
    results = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    # The token terms run under a progress bar counting each distinct shaded row once, with its ETA.
    shaded = {e["index"] for r in results for e in r["results"][:2] + r["opponents"][:2]}
    assert "gradian report: token terms: 100%" in printed.err and f"{len(shaded)}/{len(shaded)} [" in printed.err
    return folder / "results.html", common


@pytest.fixture
def reported(tmp_path, saved_model, capsys):
    data, queries = write_jsonl(tmp_path / "train.jsonl", ROWS), write_jsonl(tmp_path / "queries.jsonl", QUERIES)
    page, _ = index_query_report(tmp_path, saved_model, capsys, data, queries)
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    return page, results


def test_a_parquet_file_with_renamed_columns_reports_as_its_jsonl_twin(reported, tmp_path, saved_model, capsys):
    """report reads query.data and the indexed rows as gradian query does: any source, through the
    data.*_field mapping; the same rows give the same page, texts and token terms included."""
    folder = tmp_path / "parquet"
    folder.mkdir()
    data, queries = (write_renamed_parquet(folder / f"{n}.parquet", r) for n, r in (("train", ROWS), ("q", QUERIES)))
    page, common = index_query_report(folder, saved_model, capsys, data, queries, *MAPPED)
    assert page.read_text() == reported[0].read_text() and "capital of the country" in page.read_text()
    write_renamed_parquet(data, ROWS[::-1])  # edited after indexing: its rows no longer line up with the index's
    assert main(["report", *common]) == 2
    assert "gradian report shows the training rows the index at" in capsys.readouterr().err


def test_token_terms_in_the_results_sum_to_each_score(reported):
    _, results = reported
    for entry in results:
        for r in entry["results"] + entry["opponents"]:
            terms = [t for t in r["terms"] if t is not None]
            assert terms and sum(terms) == pytest.approx(
                r["score"], rel=5e-2, abs=1e-4
            )  # the default storage, int8, rounds the ranked score (at float16 it was within 1%)


def test_prompt_tokens_are_shaded_by_their_terms_in_grey_text(reported):
    """Every token of a shaded row has a term (its position's share); the prompt's text stays grey."""
    page, results = reported
    text = page.read_text()
    prompt = re.findall(r'class="tok prompt" data-term="([-0-9.e+]+)"', text)
    completion = re.findall(r'class="tok" data-term="([-0-9.e+]+)"', text)
    assert prompt and completion and any(float(t) != 0 for t in prompt)
    assert 'class="prompt"' not in text  # no token of a shaded row is left without a term


def test_the_page_is_self_contained_and_shows_every_result(reported):
    page, results = reported
    text = page.read_text()
    assert not re.search(r"<script|https?://|<link", text)  # no script, no network, no CDN
    for entry in results:
        assert f'id="q-{entry["query_id"]}"' in text
        for r in entry["results"] + entry["opponents"]:
            assert f"{r['score']:+.4f}" in text


def test_the_report_renders_in_a_real_browser(reported, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium here (Debian: apt-get install chromium); CI installs it")
    page, results = reported
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = done.stdout
    assert done.returncode == 0 and "</html>" in dom, done.stderr[-2000:]
    # What the browser built: one section per query, a row per result, shaded tokens for the first two.
    assert dom.count('class="query-section"') == len(results)
    assert dom.count('class="result"') == sum(len(e["results"]) + len(e["opponents"]) for e in results)
    shaded = re.findall(r'class="tok" data-term="([-0-9.e+]+)"', dom)
    assert len(shaded) >= 2 * len(results)
    assert "<svg" in dom and 'class="histogram"' in dom


def test_the_title_names_the_model_and_index_by_their_folders_not_machine_paths(reported, saved_model, tmp_path):
    page, _ = reported
    title = re.search(r"<title>(.*?)</title>", page.read_text()).group(1)
    heading = re.search(r"<h1>(.*?)</h1>", page.read_text()).group(1)
    assert title == heading == f"gradian report: {saved_model.name}, index ix"
    assert "/" not in title  # no folder of this machine


def test_page_title_keeps_a_hub_name_and_shortens_local_paths(tmp_path):
    from gradian_lightning.recipes.report import page_title

    assert page_title("HuggingFaceTB/SmolLM2-135M-Instruct", "s3://bucket/runs/ix/") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct, index ix"
    )
    assert page_title(str(tmp_path / "my-model") + "/", str(tmp_path / "ix")) == "my-model, index ix"
