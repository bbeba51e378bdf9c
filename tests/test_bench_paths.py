"""The bench checks every output path and folder before it measures: one `error:` line, exit 2 (issue 25.4).

No file is ever written over another (`--out r.png` once had the PNG summary drawn over the results), and a
folder that cannot be written is found with a real write (tests run as root: a chmod would not stop a write,
so the unwritable folder here is /proc, and a file stands where a folder should be).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.core.results import ResultSet
from tools import bench


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    monkeypatch.setenv("WORKBOOK_FULL", "0")
    monkeypatch.setenv("WORKBOOK_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("WORKBOOK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORKBOOK_REQUIRE_GPU", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = bench.main(["--no-progress", "--chapters", "00", *argv])
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert code == 2, captured.err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_results_file_with_a_png_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(capsys, ["--out", str(tmp_path / "x.png")])
    assert "--out" in line and ".json" in line
    assert not (tmp_path / "x.png").exists()


def test_the_same_file_for_results_and_png_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = tmp_path / "r.json"
    r.write_text("keep me")
    _refused(capsys, ["--out", str(r), "--png", str(r)])
    assert r.read_text() == "keep me"
    _refused(capsys, ["--out", str(tmp_path / "r.png"), "--png", str(tmp_path / "r.png")])


def test_png_with_another_extension_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(capsys, ["--out", str(tmp_path / "r.json"), "--png", str(tmp_path / "x.txt")])
    assert "--png" in line and ".png" in line
    assert not (tmp_path / "r.json").exists(), "refused before measuring anything"


@pytest.mark.parametrize("where", ["proc", "file-as-folder"])
def test_an_output_folder_that_takes_no_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    if where == "proc":
        target = Path("/proc") / "bench.json"
    else:
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "bench.json"
    assert "--out" in _refused(capsys, ["--out", str(target)])


@pytest.mark.parametrize("var", ["WORKBOOK_ARTIFACTS", "WORKBOOK_CACHE"])
@pytest.mark.parametrize("where", ["proc", "file"])
def test_a_folder_variable_that_cannot_be_written_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, var: str, where: str
) -> None:
    if where == "file":
        (tmp_path / "file").write_text("x")
        monkeypatch.setenv(var, str(tmp_path / "file"))
    else:
        monkeypatch.setenv(var, "/proc")
    line = _refused(capsys, [])
    assert var in line
    assert not list((tmp_path / "artifacts").glob("bench-*")) if (tmp_path / "artifacts").is_dir() else True


def _results(tmp_path: Path) -> Path:
    rs = ResultSet.new("t", "test", device="cpu")
    rs.add("ch98.items_per_s", 1.0, "items/s")
    return rs.save(tmp_path / "r.json")


def test_plot_only_never_creates_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / f"nonexistent-{uuid.uuid4().hex[:6]}"
    code = bench.main(["--plot-only", str(_results(tmp_path)), "--png", str(missing / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --png") and "\n" not in err.strip()
    assert not missing.exists()


def test_plot_only_refuses_a_png_with_another_extension(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["--plot-only", str(_results(tmp_path)), "--png", str(tmp_path / "x.txt")])
    assert code == 2 and ".png" in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists()


def test_png_and_no_png_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--no-png", "--png", str(tmp_path / "x.png")])
    assert exc.value.code == 2


def test_output_problems_lists_each_collision(tmp_path: Path) -> None:
    assert bench.output_problems(tmp_path / "r.json", tmp_path / "r.png") == []
    assert bench.output_problems(tmp_path / "r.json", tmp_path / "r.json")[0].startswith("--png")
    (tmp_path / "d.json").mkdir()
    assert "is a folder" in bench.output_problems(tmp_path / "d.json", None)[0]
    assert "empty" in bench.output_problems("", None)[0]
