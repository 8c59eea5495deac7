"""The run environment's record of the code (``bench/env.py``): the working tree's git tree, whether it
differs from the commit's, and the line a report prints, on throwaway repositories."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fusion_backend.bench.env import describe_code, git_code


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _objects(repo: Path) -> set[str]:
    return {str(p.relative_to(repo)) for p in (repo / ".git" / "objects").rglob("*") if p.is_file()}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("ignored.txt\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_a_clean_checkout_is_its_commits_tree(repo: Path) -> None:
    (repo / "ignored.txt").write_text("not code\n")  # ignored files are not part of the tree
    code = git_code(repo)
    assert code == {"git_tree": _git(repo, "rev-parse", "HEAD^{tree}"), "git_local_changes": False}


def test_local_changes_name_the_working_tree_without_writing_the_repository(repo: Path) -> None:
    before = _objects(repo)
    index = (repo / ".git" / "index").read_bytes()
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 3\n")  # untracked, not ignored: part of the code that runs
    code = git_code(repo)
    assert code["git_local_changes"] and code["git_tree"] != _git(repo, "rev-parse", "HEAD^{tree}")
    assert _objects(repo) == before and (repo / ".git" / "index").read_bytes() == index
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "two")
    assert _git(repo, "rev-parse", "HEAD^{tree}") == code["git_tree"]  # the commit with that tree is found


def test_outside_a_checkout_or_below_its_top_nothing_is_recorded(tmp_path_factory: pytest.TempPathFactory,
                                                                  repo: Path) -> None:  # fmt: skip
    assert git_code(tmp_path_factory.mktemp("plain")) == {}
    (repo / "site-packages").mkdir()
    assert git_code(repo / "site-packages") == {}  # a package installed inside another project's repository


def test_the_report_line_says_when_the_code_is_not_the_commit() -> None:
    assert describe_code({"git_commit": "c1", "git_tree": "t1", "git_local_changes": False}) == "commit c1"
    assert describe_code({"git_commit": "c1", "git_tree": "t2", "git_local_changes": True}) == (
        "commit c1 with local changes (working tree t2)")
    assert describe_code({"git_commit": "c1", "git_tree": None, "git_local_changes": True}) == (
        "commit c1 with local changes")  # merged parts of several working trees
    assert describe_code({"git_tree": "t3"}) == "working tree t3"
    assert describe_code({}) == "-"
