"""tools.compare_trees: a commit's code unpacked beside the working tree, the runs alternating,
each compared with the commit's first (the GPU runs themselves are kernel_bench's)."""

import pytest

from tools import compare_trees as ct


def test_a_commit_unpacks_to_its_code_folders_alone(tmp_path):
    tree = ct.unpack(ct.resolve("HEAD"), tmp_path / "rev")
    names = sorted(p.name for p in tree.iterdir())
    assert names == sorted(ct.CODE_FOLDERS)
    committed = ct.subprocess.run(["git", "show", "HEAD:cute_kernels/gdn_replay_flush.py"],
                                  cwd=ct.ROOT, capture_output=True, check=True).stdout
    assert (tree / "cute_kernels" / "gdn_replay_flush.py").read_bytes() == committed
    assert not (tree / "results").exists()


def test_the_runs_alternate_and_each_is_compared_with_the_commits_first(tmp_path, capsys):
    assert ct.main(["HEAD", "--repeats", "3", "--out-dir", str(tmp_path), "--dry-run", "--",
                    "--shapes", "qwen3-next-80b", "--batches", "1,256"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == [
        "rev_1", "work_1", "rev_2", "work_2", "rev_3", "work_3"]
    for line in lines:
        tree = line.split("PYTHONPATH=")[1].split()[0]
        assert (tree == str(ct.ROOT)) == line.startswith("work_"), line
        assert "--shapes qwen3-next-80b --batches 1,256 --out" in line
        assert line.endswith("--plot-dir none")
    assert ct.comparisons(3) == [("rev_1", "work_1"), ("rev_1", "work_2"), ("rev_1", "work_3"),
                                 ("rev_1", "rev_2"), ("rev_1", "rev_3")]


@pytest.mark.parametrize("argv, message", [
    (["no-such-revision", "--dry-run"], "'no-such-revision' is not a commit"),
    (["HEAD", "--repeats", "0"], "--repeats: expected 1 to 10, got 0"),
    (["HEAD", "--", "--out", "x.csv"], "--out is set by the tool"),
    (["HEAD", "--", "--plot-dir", "x"], "--plot-dir is set by the tool"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        ct.main(argv)
    assert message in capsys.readouterr().err + str(raised.value.code)
