"""scripts/gpu_age.py: the age of the GPU evidence that docs/gpu.md states, from
git. No Ray, no GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from _helpers import load_script

REPO = pathlib.Path(__file__).resolve().parent.parent
gpu_age = load_script("gpu_age")

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}


def git(root: pathlib.Path, *args: str) -> str:
  env = {**os.environ, **_GIT_ENV}
  return subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout.strip()


def commit_file(root: pathlib.Path, name: str, text: str) -> str:
  (root / name).parent.mkdir(parents=True, exist_ok=True)
  (root / name).write_text(text)
  git(root, "add", name)
  git(root, "commit", "-q", "-m", f"change {name}")
  return git(root, "rev-parse", "HEAD")


@pytest.fixture
def history(tmp_path):
  """A repository: a base commit, then one device-code change and one other."""
  root = tmp_path / "repo"
  root.mkdir()
  git(root, "init", "-q")
  base = commit_file(root, "dev/a.py", "1")
  commit_file(root, "dev/a.py", "2")
  commit_file(root, "docs/page.md", "text")
  return root, base


def test_every_device_code_path_exists():
  """A renamed file would silently drop out of the count."""
  missing = [p for p in gpu_age.DEVICE_CODE if not (REPO / p).exists()]
  assert missing == [], f"DEVICE_CODE names paths that do not exist: {missing}; follow the rename"


def test_the_gpu_page_states_what_git_computes_now():
  """docs/gpu.md's generated age line is what git says today."""
  sync = load_script("sync_docs")
  text = (REPO / "docs" / "gpu.md").read_text()
  blocks = [b for b in sync.blocks(text, "docs/gpu.md") if b.source == "scripts/gpu_age.py"]
  assert len(blocks) == 1, "docs/gpu.md should hold one block generated from scripts/gpu_age.py"
  try:
    expected = sync.body(blocks[0])
  except sync.SourceUnavailable as e:
    pytest.skip(f"no git history to compute the age from: {e}")
  shown = text.splitlines()[blocks[0].start + 1 : blocks[0].end]
  assert shown == expected, "docs/gpu.md states a GPU evidence age git no longer gives; run python scripts/sync_docs.py"


def test_commits_that_change_device_code_are_counted(history):
  root, base = history
  assert gpu_age.device_commits_since(base, root, ("dev/",)) == 1
  assert gpu_age.device_commits_since(base, root, ("docs/",)) == 1
  assert gpu_age.device_commits_since(base, root, ("other/",)) == 0


def test_uncommitted_device_changes_count_as_the_commit_they_will_become(history):
  root, base = history
  (root / "dev" / "a.py").write_text("3")
  assert gpu_age.device_commits_since(base, root, ("dev/",)) == 2
  git(root, "checkout", "-q", "--", "dev/a.py")
  (root / "dev" / "new.py").write_text("new")
  assert gpu_age.device_commits_since(base, root, ("dev/",)) == 2
  (root / "docs" / "page.md").write_text("edited")
  assert gpu_age.device_commits_since(base, root, ("other/",)) == 0


def test_a_merge_adds_no_commit_of_its_own(history):
  root, base = history
  main = git(root, "rev-parse", "--abbrev-ref", "HEAD")
  git(root, "checkout", "-q", "-b", "side", base)
  commit_file(root, "dev/b.py", "side")
  git(root, "checkout", "-q", main)
  git(root, "merge", "-q", "--no-ff", "-m", "merge side", "side")
  assert gpu_age.device_commits_since(base, root, ("dev/",)) == 2


def test_without_the_history_the_age_is_unavailable(history, tmp_path):
  root, base = history
  shallow = tmp_path / "shallow"
  git(tmp_path, "clone", "-q", "--depth", "1", root.as_uri(), str(shallow))
  with pytest.raises(gpu_age.Unavailable, match="shallow clone"):
    gpu_age.device_commits_since(base, shallow, ("dev/",))
  plain = tmp_path / "plain"
  plain.mkdir()
  with pytest.raises(gpu_age.Unavailable, match="git rev-parse"):
    gpu_age.device_commits_since(base, plain, ("dev/",))
  with pytest.raises(gpu_age.Unavailable, match="git cat-file"):
    gpu_age.device_commits_since("0" * 40, root, ("dev/",))


def write(root: pathlib.Path, name: str, doc: dict) -> None:
  (root / name).parent.mkdir(parents=True, exist_ok=True)
  (root / name).write_text(json.dumps(doc))


def environment(date: str, commit: str) -> dict:
  """A results document recording its revision as `rdt-jax bench` does."""
  return {"environment": {"date": date, "git": {"commit": commit, "uncommitted_rdt_jax_files": []}}}


def test_the_last_run_is_the_newest_that_records_its_revision(tmp_path):
  gpu = gpu_age.GPU_RESULTS[0]
  write(tmp_path, f"{gpu}/old/bench-gpu.json", environment("2026-01-01T00:00:00+00:00", "a" * 40))
  write(tmp_path, f"{gpu}/new/bench-weight-sync-gpu.json",
        {"commit": "b" * 40, "uncommitted_rdt_jax_files": ["M x.py"], "when": "2026-02-01T00:00:00+00:00"})
  write(tmp_path, f"{gpu}/newest/doctor.json", {"when": "2026-03-01T00:00:00+00:00"})  # no revision: not a run
  run = gpu_age.last_run(tmp_path)
  assert (run.commit, run.uncommitted, run.date[:10]) == ("b" * 40, 1, "2026-02-01")
  assert run.path == f"{gpu}/new/bench-weight-sync-gpu.json"


def test_no_recorded_run_is_an_error_naming_where_it_looked(tmp_path):
  with pytest.raises(LookupError, match="docs/benchmarks/gpu"):
    gpu_age.last_run(tmp_path)


def test_the_sentence_states_the_revision_and_the_count(history):
  root, base = history
  write(root, f"{gpu_age.GPU_RESULTS[0]}/bench-gpu.json", environment("2026-01-01T00:00:00+00:00", base))
  git(root, "add", ".")
  git(root, "commit", "-q", "-m", "results")
  text = gpu_age.text(root, ("dev/",))
  assert f"measured revision {base[:7]};" in text
  assert "; 1 commit since changed device code" in text and "results are 1 device-code commit old." in text


def test_a_run_with_uncommitted_changes_is_an_upper_bound(history):
  root, base = history
  uncommitted = ["M dev/a.py", "?? dev/c.py"]
  write(root, f"{gpu_age.GPU_RESULTS[0]}/bench-gpu.json",
        {"commit": base, "uncommitted_rdt_jax_files": uncommitted, "when": "2026-01-01T00:00:00+00:00"})
  git(root, "add", ".")
  git(root, "commit", "-q", "-m", "results")
  (root / "dev" / "a.py").write_text("uncommitted")
  text = gpu_age.text(root, ("dev/",))
  assert f"measured revision {base[:7]} with changes to 2 rdt_jax files not yet committed" in text
  assert "2 commits since" in text and "at most 2 device-code commits old." in text
