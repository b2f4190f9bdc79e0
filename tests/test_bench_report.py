"""Summary figures, the JSON report, `bench compare`, and the CLI's error messages."""

import json
import statistics
import sys

import pytest

from llmbus.bench.chart import draw
from llmbus.bench.compare import comparison, format_comparison, update_doc
from llmbus.bench.metrics import summarize
from llmbus.bench.record import RequestRecord
from llmbus.bench.report import load_report, make_report, records_of, write_report
from llmbus.bench.slo import SLO
from llmbus.cli import main


def _records():
    recs = []
    for i, (ttft, gaps) in enumerate([(0.1, [0.02, 0.03]), (0.2, [0.05] * 4), (0.4, [0.01])]):
        recs.append(RequestRecord(index=i, kind="short" if i < 2 else "long", success=True, status=200, start_s=i * 0.1,
                                  ttft_s=ttft, itl_s=gaps, e2e_s=ttft + sum(gaps), output_tokens=len(gaps) + 1,
                                  prompt_tokens=10, usage_reported=True))
    recs.append(RequestRecord(index=3, status=503, error="busy"))
    recs.append(RequestRecord(index=4, status=None, error="ConnectError"))
    return recs


def test_summary_against_independent_statistics():
    recs = _records()
    s = summarize(recs, duration_s=2.0, slo=SLO.parse(["ttft:250", "tpot:40"]), cpu_s=3.0)
    ok = [r for r in recs if r.success]
    assert (s["completed"], s["failed"]) == (3, 2)
    assert s["errors_by_status"] == {"503": 1, "connection": 1}
    assert s["total_output_tokens"] == 3 + 5 + 2
    assert s["output_throughput"] == pytest.approx(10 / 2.0)
    assert s["request_throughput"] == pytest.approx(1.5)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok]
    assert s["tpot"]["mean_ms"] == pytest.approx(1000 * statistics.fmean(tpots))
    assert s["ttft"]["median_ms"] == pytest.approx(200.0)
    gaps = [g * 1000 for r in ok for g in r.itl_s]
    assert s["itl"]["median_ms"] == pytest.approx(statistics.median(gaps))
    assert s["itl"]["p90_ms"] == pytest.approx(statistics.quantiles(gaps, n=10, method="inclusive")[8])
    # request 0: ttft 100 ms, tpot 25 ms -> good; 1: ttft 200, tpot 50 -> bad; 2: ttft 400 -> bad
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["cpu_s_per_output_token"] == pytest.approx(0.3)
    assert s["by_kind"]["long"]["ttft"]["median_ms"] == pytest.approx(400.0)


def test_report_round_trip(tmp_path):
    recs = _records()
    rep = make_report("serve", "a", {"x": 1}, recs, summarize(recs, 1.0))
    path = tmp_path / "sub" / "a.json"
    write_report(rep, str(path))
    back = load_report(str(path))
    assert back["summary"] == json.loads(json.dumps(rep["summary"]))
    assert [r.to_dict() for r in records_of(back)] == [r.to_dict() for r in recs]
    assert back["requests"][0]["tpot_s"] == pytest.approx(0.025)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an llmbus bench report"):
        load_report(str(tmp_path / "bad.json"))


def test_compare_ratios_and_doc_refresh(tmp_path):
    recs = _records()
    a = make_report("serve", "base", {}, recs, summarize(recs, 2.0))
    b = make_report("serve", "fast", {}, recs, summarize(recs, 1.0))
    rows = {r["metric"]: r for r in comparison([a, b])}
    assert rows["output tok/s"]["ratios"] == pytest.approx([1.0, 2.0])
    assert rows["TTFT p50 ms"]["ratios"] == pytest.approx([1.0, 1.0])
    assert "| metric | base | fast |" in format_comparison([a, b], markdown=True)
    doc = tmp_path / "bench.md"
    doc.write_text("intro\n<!-- bench:suite -->\nold\n<!-- /bench:suite -->\nend\n")
    update_doc(str(doc), "suite", "NEW TABLE")
    assert doc.read_text() == "intro\n<!-- bench:suite -->\nNEW TABLE\n<!-- /bench:suite -->\nend\n"
    with pytest.raises(ValueError, match="markers"):
        update_doc(str(doc), "other", "x")
    with pytest.raises(ValueError, match="at least two"):
        comparison([a])


def test_cached_prompt_share_is_reported_without_a_ratio():
    cold, warm = _records(), _records()
    for r in warm[:3]:
        r.cached_tokens = 5  # half of each 10-token prompt came from a prefix cache
    a = make_report("serve", "cold", {}, cold, summarize(cold, 1.0))
    b = make_report("serve", "warm", {}, warm, summarize(warm, 1.0))
    assert "cached_prompt_share" not in a["summary"]
    assert b["summary"]["cached_prompt_share"] == pytest.approx(0.5)
    rows = {r["metric"]: r for r in comparison([b, a])}
    assert rows["cached prompt %"]["values"] == [pytest.approx(50.0), None]
    assert rows["cached prompt %"]["ratios"] == [None, None]
    assert rows["failed"]["values"] == [2, 2] and rows["failed"]["ratios"] == [None, None]


def test_chart_is_optional(tmp_path):
    recs = _records()
    rep = make_report("serve", "a", {}, recs, summarize(recs, 1.0))
    msg = draw([rep], str(tmp_path / "c.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in msg and not (tmp_path / "c.png").exists()
    else:
        assert msg is None and (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.parametrize("argv,needle", [
    (["--slo", "ttft=5"], "--slo"), (["--slo", "itl:5"], "METRIC"), (["--max-concurrency", "0"], "concurrency"),
    (["--burstiness", "-1"], "burstiness"), (["--base-url", "ftp://x"], "http://"),
    (["--max-concurrency", "-1"], "concurrency"),
])
def test_cli_bad_input_is_a_clear_error(tmp_path, capsys, argv, needle):
    from llmbus.bench.tinymodel import write_tokenizer

    write_tokenizer(str(tmp_path), vocab_size=300)
    rc = main(["bench", "serve", "--model", "m", "--tokenizer", str(tmp_path), "--num-prompts", "1",
               "--no-progress", *argv])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_cli_compare(tmp_path, capsys):
    recs = _records()
    for name, dur in (("a", 2.0), ("b", 4.0)):
        write_report(make_report("serve", name, {}, recs, summarize(recs, dur)), str(tmp_path / f"{name}.json"))
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "(0.50x)" in out


def test_cli_compare_unusable_report_is_a_one_line_error(tmp_path, capsys):
    recs = _records()
    good = tmp_path / "a.json"
    write_report(make_report("serve", "a", {}, recs, summarize(recs, 1.0)), str(good))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"schema": "llmbus-bench/1", "kind": "serve", "label": "x", "requests": []}))
    folder = tmp_path / "dir"
    folder.mkdir()
    for path, needle in ((folder, "Is a directory"), (bare, "no summary"), (tmp_path / "gone.json", "No such file")):
        assert main(["bench", "compare", str(good), str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and needle in err, err


def test_cli_compare_usage_asks_for_two_reports(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "compare", str(tmp_path / "a.json")])
    assert exc.value.code == 2
    assert "REPORT REPORT [REPORT ...]" in capsys.readouterr().err


def test_cli_outputs_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    """A chart that cannot be drawn, or a doc refresh without its section, is refused before a
    benchmark runs or a table is printed, not after."""
    from llmbus.bench.tinymodel import write_tokenizer

    recs = _records()
    for name in ("a", "b"):
        write_report(make_report("serve", name, {}, recs, summarize(recs, 1.0)), str(tmp_path / f"{name}.json"))
    reports = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert main(["bench", "compare", *reports, "--update-doc", str(tmp_path / "doc.md")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--section" in err

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["bench", "compare", *reports, "--chart", str(tmp_path / "c.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "pip install matplotlib" in err
    write_tokenizer(str(tmp_path), vocab_size=300)
    # nothing listens on port 9: the run would fail every request, but it never starts
    rc = main(["bench", "serve", "--model", "m", "--tokenizer", str(tmp_path), "--base-url", "http://127.0.0.1:9",
               "--num-prompts", "1", "--no-progress", "--chart", str(tmp_path / "c.png")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "matplotlib" in err
