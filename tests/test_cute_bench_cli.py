"""The command lines of cute_kernels.bench_read and bench_write (CPU): a bad argument or a
machine without CUDA is a one-line error with exit status 2, not a traceback, and --help
names the module and its defaults."""

import pytest
import torch

from cute_kernels import bench_read, bench_write

BAD = {
    bench_read: [["--batch", "256", "0"], ["--h", "16"], ["--h", "0"], ["--reps", "0"],
                 ["--window", "-1"], ["--splits", "0"],
                 # combinations that ran something else than asked (the last list only, or
                 # a flag ignored), now refused before the GPU
                 ["--ablations", "--prologue-variants"], ["--no-variants", "--ablations"],
                 ["--splits-sweep", "--knob-variants"], ["--splits", "2", "4"],
                 ["--no-variants", "--splits-sweep"]],
    bench_write: [["--batch", "0"], ["--window", "0"], ["--reps", "-1"], ["--replays", "0"]],
}


@pytest.mark.parametrize("module", [bench_read, bench_write], ids=lambda m: m.__name__)
def test_help_names_the_module_and_the_defaults(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: python -m {module.__name__}" in text
    assert "Needs a CUDA GPU." in text
    assert "window L (default: 16)" in text


@pytest.mark.parametrize("module, argv", [(m, a) for m, bad in BAD.items() for a in bad],
                         ids=lambda x: x.__name__ if hasattr(x, "__name__") else " ".join(x))
def test_a_bad_argument_is_a_one_line_error(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m {module.__name__}: error: --" in err and "Traceback" not in err


@pytest.mark.parametrize("module", [bench_read, bench_write], ids=lambda m: m.__name__)
def test_without_cuda_the_benchmark_says_so(module, capsys):
    if torch.cuda.is_available():
        pytest.skip("for CPU-only machines")
    with pytest.raises(SystemExit) as exit_:
        module.main([])
    assert exit_.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
